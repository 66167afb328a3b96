"""The run's end: a node that lacks a fragment's last round heals it before it leaves, and a
node that holds it stays a while for the peers that lack it (docs/design.md "The run's
end").

While the run goes on, a node that missed a round heals before the fragment's next send
(``before_send``). The last round of a fragment has no next send: a node that missed it
(its JOIN came after the group closed, it was frozen, it started from a stale prior) ended
the run at another state than its peers, and its exported model was another model. The
peers' results of the rounds applied at the end (``FragmentSync.finish``) were not even
vouched for: their nodes left without publishing them.

So at the end each node publishes its final record (marked done) and vouches at once, then

- ``heal_at_end``: checks every fragment against the swarm, as the periodic check does,
  and fetches what is out of line from vouched donors; while it lacks a last round it
  reads again, as long as a peer whose word counts is in the run and not done (its result
  of that round may not be out yet), until ``end_wait_seconds``;
- ``linger``: keeps serving its state while a peer whose word counts holds an older
  version of a fragment than this node (the laggard heals from it), at most
  ``end_wait_seconds``.

Both end as soon as there is nothing to wait for, so a run whose nodes agree pays two
reads of the records at its end, and a poll or two for a peer a moment behind. A key that
worked in a round can hold an honest node back at most that bound, once, after its
training is done.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from diloco.errors import ProtocolError
from diloco.node.evidence.suspects import missed_rounds, version_of
from diloco.node.swarm.donors import Mine
from diloco.node.swarm.healing import VOUCH_POLL, VOUCH_WAIT, Healer
from diloco.protocol.records.nodes import NodeRecord
from diloco.protocol.state.fragment import OuterState

logger = logging.getLogger(__name__)

END_WAIT_MARGIN = 2 * VOUCH_WAIT
"""Seconds the run's end waits for peers beyond their last round's deadline: a laggard's
read, its download, and the vouches it may wait for (``VOUCH_WAIT`` each, read twice)."""
LINGER_POLL = 0.25
"""Seconds between two reads of the records while lingering: a peer that is only a moment
behind (its final record not out yet, a few tenths of a second) costs one poll, which at
0.5-1 s made every multi-node test end that much later."""


def end_wait_seconds(matchmaking_window: float, round_timeout: float) -> float:
    """How long the run's end waits for peers: a peer's last round can end up to its
    deadline (the window, then the round timeout) after ours; then it reads the records,
    downloads the state and verifies its vouches (``END_WAIT_MARGIN``)."""
    return matchmaking_window + round_timeout + END_WAIT_MARGIN


def behind_peers(
    records: Sequence[NodeRecord], versions: Sequence[int], voters: frozenset[str]
) -> list[str]:
    """The peers a node at the run's end stays for: those whose word counts (a key never
    seen working holds nobody back) that publish some fragment at an older version than
    ``versions``. A peer still training counts too: it reaches the end, misses the last
    rounds and heals from this node if it gets there within the wait; and a record is
    published only after a round or every few seconds, so its step says little of where
    a peer stands (a node stopped mid-run publishes the step of its last round)."""
    return sorted(
        r.peer_id
        for r in records
        if r.peer_id in voters and any(0 <= version_of(r, p) < v for p, v in enumerate(versions))
    )


def settle(
    healer: Healer, missed: dict[int, int], mine: Mine, step: int, deadline: float
) -> OuterState | None:
    """Worker thread: every fragment out of line with the swarm, from vouched donors. While
    ``missed`` (fragment -> last round, not applied here) is not empty and a peer whose word
    counts is in the run and not done (``NodeRecord.done``), the records are read again
    every ``VOUCH_POLL`` seconds until ``deadline`` (monotonic): its result of that round
    may not be published yet. A round that failed for everyone ends the wait as soon as
    the others are done: in a run where it did, every node waited for the others to leave
    while they waited for it, to the bound (18 s).

    Raises:
        ProtocolError: donors were found but none delivered a vouched state by ``deadline``.
    """
    fragments = sorted(mine)
    while True:
        view = healer.read_view()
        try:
            if fetched := healer.fetch_out_of_line(view, mine, step, fragments):
                return OuterState(view.step or 0, fetched)
        except ProtocolError:
            if time.monotonic() + VOUCH_POLL > deadline:
                raise
        voters = healer.evidence().voters()
        busy = any(r.peer_id in voters and not r.done for r in view.records)
        if not missed or not busy or time.monotonic() + VOUCH_POLL > deadline:
            return None
        time.sleep(VOUCH_POLL)


def heal_at_end(healer: Healer, wait_s: float, stopped: Callable[[], bool]) -> int:
    """The training thread, after the last rounds were applied: bring every fragment in
    line with the swarm before the final evaluation and export, waiting at most ``wait_s``
    seconds (``stopped`` ends the wait: a node told to stop leaves). Logged when it found
    a round missing or adopted a state; returns the fragments adopted."""
    t = healer.trainer
    start = time.monotonic()
    deadline = start + wait_s
    healed_before = healer.healed_fragments
    checked = healer.await_check(deadline, stopped)  # the check in flight may adopt
    missed = missed_rounds(t.step, healer.versions(), healer.sync_every)
    if checked:
        fragments = range(len(healer.versions()))
        healer.start_check(fragments, settle, healer, missed, healer.mine(), t.step, deadline)
        healer.await_check(deadline, stopped)
    left = missed_rounds(t.step, healer.versions(), healer.sync_every)
    healed = healer.healed_fragments - healed_before
    if missed or healed:
        seconds = time.monotonic() - start
        t.blocked_seconds += seconds  # waiting on the network: not compute
        healer.emit(
            {"event": "end_heal", "step": t.step, "missed": sorted(missed), "healed": healed}
            | {"seconds": seconds, "still_missing": sorted(left)}
        )
    return healed


def linger(
    healer: Healer,
    read_records: Callable[[], list[NodeRecord]],
    wait_s: float,
    stopped: Callable[[], bool],
) -> tuple[float, list[str], list[str]]:
    """The training thread, at the very end: wait while ``behind_peers`` finds a peer that
    lacks a version this node holds, reading the records every ``LINGER_POLL`` seconds, at
    most ``wait_s`` seconds. Returns the seconds waited, the peers waited for, and those
    still behind when it ended."""
    versions = healer.versions()
    start = time.monotonic()
    waited_for: set[str] = set()
    while True:
        voters = healer.evidence().voters() - {healer.me}
        try:
            records = read_records()
        except Exception as error:  # a failed read: leave rather than wait blind
            logger.info("could not read the run's records at its end: %r", error)
            records = []
        behind = behind_peers(records, versions, voters)
        waited_for.update(behind)
        if not behind or stopped() or time.monotonic() + LINGER_POLL > start + wait_s:
            return time.monotonic() - start, sorted(waited_for), behind
        time.sleep(LINGER_POLL)


def end_in_line(
    healer: Healer,
    publish: Callable[[], None],
    read_records: Callable[[], list[NodeRecord]],
    wait_s: float,
    stopped: Callable[[], bool],
    serves: bool = True,
) -> None:
    """The training thread, after the last rounds were applied (module docstring):
    ``publish`` the final record and vouches now, heal, publish what a heal changed, and
    linger for the peers behind, unless this node ``serves`` no state (a client behind
    NAT: nobody can dial it); each wait at most ``wait_s`` seconds."""
    publish()
    if heal_at_end(healer, wait_s, stopped):
        publish()
    if not serves:
        return
    seconds, peers, behind = linger(healer, read_records, wait_s, stopped)
    if peers:
        event = {"event": "lingered", "step": healer.trainer.step, "seconds": seconds}
        healer.emit(event | {"peers": peers, "still_behind": behind})
