"""A fragment that lacks its last round heals before it is sent again (docs/design.md
"Healing and joining").

A node whose round ``k`` of fragment ``p`` failed (it started from another state than its
peers, it was frozen, its process was restarted) or that skipped it holds ``p`` at an older
version than its peers once they applied ``k``. Its round ``k + 1`` then starts from that
stale prior: nobody shares it, the round fails, the peers apply ``k + 1`` and the node is
one round behind again. The heal that the failure starts does not break that circle on a
loaded machine: it reads the records before the peers' version ``k`` is out (nothing to
fetch, next check a second later), and what it fetches lands after the send step of
``k + 1``, already stale. The chaos run showed a joiner doing that for the rest of the run.

So at the step before ``p``'s send, a node that lacks round ``k`` waits, at most ``wait_s``
seconds, for a check that fetches ``p``'s newest vouched state: the check in flight, then
one that reads the records again while a peer whose word counts claims round ``k`` applied
(its vouches may come a little later) and until peers vouch for a newer state than ours.
When no such record claims ``k``, it failed for everyone as far as the node can tell, or
nobody it may follow has it: it sends at once. When the records that the last check read
already show it, every holder of a vouched state of ``p`` past the round's latest receive
step (its send plus the longest tau auto may pick) without it, the send is not held at
all: at 300 ms the read alone took the whole hold, 1.2 s, at every such send. The round is
then declared from the healed prior (``ahead`` announces no round of a fragment that lacks
its last one: its stale declaration would end the peers' wait at once). What is adopted is
what every heal adopts: a state that peers whose word counts vouch for (docs/design.md
"Evidence").
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Mapping, Sequence

from diloco.errors import ProtocolError
from diloco.node.evidence.suspects import failed_everywhere, missed_rounds, version_of
from diloco.node.model.fragments import sends_at
from diloco.node.swarm.donors import Mine
from diloco.node.swarm.healing import VOUCH_POLL, Healer
from diloco.node.training.tau import tau_bounds
from diloco.protocol.state.fragment import OuterState

logger = logging.getLogger(__name__)

ROUND_TRIPS_AFTER_HOLD = 4
"""Round trips a held node still needs after its heal before its JOIN reaches the round's
leader: declaring the round (2; a fragment that lacked its last round was not announced
ahead), reading it (1) and the JOIN itself (1)."""


def hold_seconds(window: float, round_trip: float) -> float:
    """How long a heal may hold the send: the peers wait for this node at most ``window``
    (the matchmaking window their rounds use now) from their send step, and after the hold
    it still needs ``ROUND_TRIPS_AFTER_HOLD`` round trips to JOIN. A longer hold makes it
    miss the round it waited for, and its next fragments' rounds too (docs/design.md
    "Across the internet")."""
    return max(0.0, window - ROUND_TRIPS_AFTER_HOLD * round_trip)


def missed_before_send(
    step: int, versions: Sequence[int], busy: Collection[int], sync_every: int
) -> dict[int, int]:
    """Fragment -> its last round sent, for the fragments that send at ``step + 1`` and
    never applied that round (``busy``: fragments with a round in flight, not yet due)."""
    sending = {p for p, _ in sends_at(step + 1, sync_every, len(versions))}
    missed = missed_rounds(step, versions, sync_every)
    return {p: k for p, k in missed.items() if p in sending and p not in busy}


def fetch_missed(
    healer: Healer, missed: Mapping[int, int], mine: Mine, step: int, deadline: float
) -> OuterState | None:
    """Worker thread: the fragments of ``missed`` that peers hold newer (or, at our version,
    under the majority's hash), from vouched donors; the records are read again every
    ``VOUCH_POLL`` seconds until ``deadline`` (monotonic) while a peer whose vouches count
    claims a missed round (its vouches may be on their way; a claim only makes us wait,
    never adopt, and a key we never saw work cannot hold our sends). None: nothing to fetch.

    Raises:
        ProtocolError: donors were found but none delivered a vouched state by ``deadline``.
    """
    while True:
        view = healer.read_view()
        try:
            fetched = healer.fetch_out_of_line(view, mine, step, sorted(missed))
            if fetched:
                return OuterState(view.step or 0, fetched)
        except ProtocolError:
            if time.monotonic() + VOUCH_POLL > deadline:
                raise
        voters = healer.evidence().voters()
        claimed = any(
            r.peer_id in voters and version_of(r, p) >= k
            for r in view.records
            for p, k in missed.items()
        )
        if not claimed or time.monotonic() + VOUCH_POLL > deadline:
            return None
        time.sleep(VOUCH_POLL)


def heal_before_send(healer: Healer, wait_s: float) -> None:
    """Between two steps (training thread): hold the next step back, at most ``wait_s``
    seconds, until the fragments it sends that lack their last round are healed (module
    docstring). A wait that ends first leaves the check running; its result is applied
    between later steps, as any check's."""
    t = healer.trainer
    busy = {r.key.fragment for r in t.sync.pending}
    held = missed_before_send(t.step, healer.versions(), busy, healer.sync_every)
    if not held or wait_s <= 0:
        return
    view, longest_tau = healer.last_view, tau_bounds(healer.sync_every)[1]
    if view is not None and failed_everywhere(view, held, healer.schedule, longest_tau):
        return  # what the last check read shows these rounds failed for everyone
    start = time.monotonic()
    deadline = start + wait_s
    if healer.await_check(deadline):
        missed = missed_before_send(t.step, healer.versions(), busy, healer.sync_every)
        if missed:
            mine = healer.mine()
            healer.start_check(sorted(missed), fetch_missed, healer, missed, mine, t.step, deadline)
            healer.await_check(deadline)
    left = missed_before_send(t.step, healer.versions(), busy, healer.sync_every)
    seconds = time.monotonic() - start
    t.blocked_seconds += seconds  # waiting on the network: not compute (its CU says so)
    healer.emit(
        {"event": "send_held", "step": t.step, "fragments": sorted(held), "seconds": seconds}
        | {"still_missing": sorted(left)}
    )
