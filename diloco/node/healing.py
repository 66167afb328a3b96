"""Healing: a node whose outer state of a fragment fell out of line downloads it from a peer
(SPEC 4 "State transfer", "Faults").

A node cannot always be sure that a round left it where its peers are: the round failed
for it but not for them, or it joined while a round was in flight. So it reads the run's
records and compares. The decisions are pure functions of the records, next to each other
and tested on hand-made record sets:

- ``choose_donors``: whom to fetch a fragment from (peers ahead of us; else the holders of
  the majority hash at our version, when ours is not it; else, when our step lags the
  swarm's, the peer furthest ahead);
- ``heal_plan``: which fragments to fetch, and from whom;
- ``fragments_to_adopt``: which fetched fragments replace ours;
- ``missed_rounds`` and ``open_suspects``: which fragments to keep checking.

``Healer`` keeps the state between checks (suspect and diverged fragments) and runs a check
on the node's worker thread through a ``StateSource`` (the swarm, adapted by ``SwarmNode``).

Known limit (issue 11): records are unsigned claims, so a peer that claims newer versions
is believed. Healing is to adopt only states vouched for by a majority of the round's
members, with claims bounded by the schedule; that decision belongs in ``choose_donors``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import Executor, Future
from typing import Any, Protocol

from diloco.errors import ProtocolError
from diloco.node.fragments import last_sent_round, send_step
from diloco.node.trainer import NodeTrainer
from diloco.protocol.fragment_state import FragmentState, OuterState
from diloco.protocol.records import NodeRecord, divergent_peers
from diloco.protocol.reducer import RoundKey

logger = logging.getLogger(__name__)

MAX_LAG_STEPS = 2
"""A node further behind its donor than this skips ahead to the donor's step when healing."""
SETTLE_TIMEOUT = 10.0
"""Seconds a joiner waits for the rounds that were in flight during its download."""
HEAL_CHECK_EVERY = 1.0
"""Seconds between two checks of the records while a fragment is suspect."""

Mine = Mapping[int, tuple[int, str]]
"""This node's fragments: fragment -> (version, state hash)."""


def version_of(record: NodeRecord, fragment: int) -> int:
    """The version ``record`` claims for ``fragment`` (-1: none published)."""
    entry = record.fragment(fragment)
    return entry.version if entry else -1


def hash_of(record: NodeRecord, fragment: int) -> str:
    entry = record.fragment(fragment)
    return entry.state_hash if entry else ""


def majority_hash(
    records: Sequence[NodeRecord], fragment: int, version: int, state_hash: str
) -> str:
    """The state hash most nodes hold at ``version``, counting this node's ``state_hash``.

    A tie goes to the smaller hash, so that every node of a split picks the same side.
    """
    counts = Counter([state_hash])
    counts.update(hash_of(r, fragment) for r in records if version_of(r, fragment) == version)
    return min(counts.items(), key=lambda item: (-item[1], item[0]))[0]


def far_ahead(
    records: Sequence[NodeRecord], my_step: int, max_lag: int = MAX_LAG_STEPS
) -> list[NodeRecord]:
    """Peers whose global step is more than ``max_lag`` ahead of ours, furthest first.

    A node that lags by more misses every round (its peers leave the matchmaking window
    before it arrives), so it skips ahead to such a peer's step.
    """
    ahead = [r for r in records if r.global_step > my_step + max_lag]
    return sorted(ahead, key=lambda r: -r.global_step)


def choose_donors(
    records: Sequence[NodeRecord], fragment: int, version: int, state_hash: str, my_step: int
) -> list[NodeRecord]:
    """Peers to fetch ``fragment`` from, best first; empty when ours is in line.

    ``records`` are the other nodes'; ``version``, ``state_hash`` and ``my_step`` ours. In
    order: peers with a newer version (newest first); else, when the majority at our version
    holds another state, its holders; else, when we lag the swarm, the peer furthest ahead.
    """
    ahead, conflicting = divergent_peers(records, fragment, version, state_hash)
    if ahead:
        return sorted(ahead, key=lambda r: -version_of(r, fragment))
    if conflicting:
        best = majority_hash(records, fragment, version, state_hash)
        if best != state_hash:
            return [r for r in conflicting if hash_of(r, fragment) == best]
    return far_ahead(records, my_step)[:1]


def heal_plan(
    records: Sequence[NodeRecord], mine: Mine, my_step: int, fragments: Sequence[int]
) -> dict[int, list[NodeRecord]]:
    """Fragment -> donors, for the ``fragments`` checked that are out of line; a node that
    lags the swarm checks all of ``mine`` (it takes the fresh step of the donor)."""
    if far_ahead(records, my_step):
        fragments = sorted(mine)
    plan = {}
    for p in fragments:
        version, state_hash = mine[p]
        if donors := choose_donors(records, p, version, state_hash, my_step):
            plan[p] = donors
    return plan


def fragments_to_adopt(
    fetched: Mapping[int, FragmentState],
    mine: Sequence[FragmentState],
    in_flight: Collection[int],
    take_all: bool = False,
) -> list[int]:
    """Fetched fragments that replace ours: newer, or at our version with another hash
    (``choose_donors`` fetched it from the majority); all of them when joining.

    A fragment with a round in flight is left for a later check: that round's result is
    about to change it anyway.
    """
    adopted = []
    for p, theirs in sorted(fetched.items()):
        ours = mine[p]
        newer = theirs.version > ours.version
        conflict = theirs.version == ours.version and theirs.sha256() != ours.sha256()
        if p not in in_flight and (take_all or newer or conflict):
            adopted.append(p)
    return adopted


def missed_rounds(step: int, versions: Sequence[int], sync_every: int) -> dict[int, int]:
    """Fragment -> the last round sent by ``step``, for fragments whose version is older
    (a state downloaded while that round was in flight lacks its result)."""
    num_fragments = len(versions)
    missed = {}
    for p, version in enumerate(versions):
        k = last_sent_round(step, p, sync_every, num_fragments)
        if k >= 1 and version < k:
            missed[p] = k
    return missed


def open_suspects(
    suspects: Mapping[int, int], versions: Sequence[int], step: int, sync_every: int
) -> dict[int, int]:
    """The suspects (fragment -> round that failed) still in doubt: the version has not
    caught up with that round (peers publish theirs every few seconds) and the fragment's
    next round is not sent yet (that round tells anew)."""
    num_fragments = len(versions)
    return {
        p: k
        for p, k in suspects.items()
        if versions[p] < k and step < send_step(p, k + 1, sync_every, num_fragments)
    }


class StateSource(Protocol):
    """The swarm as healing sees it: records to read, fragments to fetch from peers."""

    def read_records(self) -> list[NodeRecord]: ...

    def fetch_state(
        self, fragments: Sequence[int], expected_numel: Mapping[int, int], donors: Sequence[str]
    ) -> OuterState:
        """The fragments from the first donor (peer id, base58) that delivers a valid state.

        Raises:
            ProtocolError: none did.
        """
        ...


class Healer:
    """One node's healing between two checks: the fragments in doubt and the check running.

    Everything but ``check_and_fetch`` runs in the training thread, between steps;
    ``check_and_fetch`` runs on ``worker`` and touches no trainer state.
    """

    def __init__(
        self,
        trainer: NodeTrainer,
        source: StateSource,
        me: str,
        worker: Executor,
        emit: Callable[[dict[str, Any]], None],
        on_adopted: Callable[[], None],
    ) -> None:
        self.trainer, self.source, self.me, self.worker = trainer, source, me, worker
        self.emit, self.on_adopted = emit, on_adopted
        self.numel = {p: s.outer.numel() for p, s in enumerate(trainer.sync.states)}
        self.suspects: dict[int, int] = {}
        """Fragment -> the round that failed for it, until healed or superseded."""
        self.diverged: set[int] = set()
        """Fragments a check found behind or in the minority whose fetched state could not
        be adopted (a round was in flight, or a round was applied meanwhile): checked
        again, like suspects, until a check finds them in line."""
        self.checking: list[int] = []
        """The fragments of the check in ``future``."""
        self.checked_at = 0.0
        self.future: Future[OuterState | None] | None = None
        self.healed_fragments = 0

    @property
    def sync_every(self) -> int:
        return self.trainer.run.outer.sync_every

    def versions(self) -> list[int]:
        return [s.version for s in self.trainer.sync.states]

    def adopt(self, state: OuterState, take_step: bool = False) -> list[int]:
        """Adopt what ``fragments_to_adopt`` picks (and the global step when joining)."""
        sync = self.trainer.sync
        adopted = fragments_to_adopt(state.fragments, sync.states, sync.in_flight(), take_step)
        self.trainer.adopt_outer_state(
            {p: state.fragments[p] for p in adopted}, state.global_step if take_step else None
        )
        self.on_adopted()
        return adopted

    def settle_rounds_in_flight(self, deadline: float) -> None:
        """A joiner's download can predate a round in flight: fetch those fragments again
        once a peer has applied that round (until ``deadline``; a round that failed for
        everyone never shows up). What is still missing then is healed while training."""
        while missed := missed_rounds(self.trainer.step, self.versions(), self.sync_every):
            if time.monotonic() > deadline:
                self.suspects.update(missed)
                return
            records = self.source.read_records()
            for p, k in missed.items():
                donors = [r.peer_id for r in records if version_of(r, p) >= k]
                if donors:
                    with contextlib.suppress(ProtocolError):
                        self.adopt(self.source.fetch_state([p], {p: self.numel[p]}, donors))
            if missed_rounds(self.trainer.step, self.versions(), self.sync_every):
                time.sleep(0.5)

    def check_and_fetch(self, fragments: list[int], mine: Mine, my_step: int) -> OuterState | None:
        """Worker thread: fetch the fragments that ``heal_plan`` finds out of line (SPEC 4:
        a member "compares the state hash the others publish and heals from a peer if it
        differs"). The global step returned is the last donor's."""
        records = [r for r in self.source.read_records() if r.peer_id != self.me]
        fetched: dict[int, FragmentState] = {}
        global_step = 0
        for p, donors in heal_plan(records, mine, my_step, fragments).items():
            peers = [r.peer_id for r in donors]
            state = self.source.fetch_state([p], {p: self.numel[p]}, peers)
            fetched[p] = state.fragments[p]
            global_step = state.global_step
        return OuterState(global_step, fetched) if fetched else None

    def maybe_heal(self, failed: Sequence[RoundKey]) -> None:
        """Between steps: apply a finished check, or start one when there is reason to.

        A fragment whose round failed stays suspect until ``open_suspects`` drops it; every
        ``H`` steps all fragments are checked. A fragment found out of line whose fetched
        state could not be adopted (its round was in flight, or a round was applied
        meanwhile: a joiner that arrives while a round is in flight misses that round) is
        checked again every ``HEAL_CHECK_EVERY`` seconds until a check finds it in line.
        Before, such a fragment waited for the next ``H``-step check, which falls on
        fragment 0's send step: a joiner could stay diverged on it for the whole run.
        """
        t = self.trainer
        for key in failed:
            self.suspects[key.fragment] = key.round
        if self.future is not None and self.future.done():
            self._apply_check(self.future)
            self.future = None
        H = self.sync_every
        self.suspects = open_suspects(self.suspects, self.versions(), t.step, H)
        periodic = t.step % H == 0
        rested = time.monotonic() - self.checked_at > HEAL_CHECK_EVERY
        recheck = set(self.suspects) | self.diverged
        if self.future is None and ((recheck and rested) or periodic):
            self.checked_at = time.monotonic()
            self.checking = list(range(len(self.numel))) if periodic else sorted(recheck)
            mine = {p: (s.version, s.sha256()) for p, s in enumerate(t.sync.states)}
            self.future = self.worker.submit(self.check_and_fetch, self.checking, mine, t.step)

    def _apply_check(self, future: Future[OuterState | None]) -> None:
        t = self.trainer
        try:
            state = future.result()
            self.diverged -= set(self.checking)
        except Exception as error:  # a donor that fails is the donor's problem
            logger.warning("healing failed: %s", error)
            return
        if state is None:
            return
        adopted = self.adopt(state)
        self.diverged |= set(state.fragments) - set(adopted)
        if adopted:
            self.healed_fragments += len(adopted)
            self.emit({"event": "healed", "step": t.step, "fragments": adopted})
        if state.global_step > t.step + MAX_LAG_STEPS:
            # A slow node skips ahead rather than miss every round from now on.
            self.emit({"event": "caught_up", "from_step": t.step, "to_step": state.global_step})
            t.step = state.global_step
            self.suspects.update(missed_rounds(t.step, self.versions(), self.sync_every))
