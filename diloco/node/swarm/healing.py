"""Healing: a node whose outer state of a fragment fell out of line downloads it from a peer
(docs/design.md "Healing and joining", "Faults").

A node cannot always be sure that a round left it where its peers are: the round failed
for it but not for them, or it joined while a round was in flight. So it reads the run's
records and vouches and compares. What it may believe of them is decided in
``diloco.node.evidence.claims`` (claims bounded by the schedule, states vouched by peers whose word
counts, the robust step: docs/design.md "Evidence");
the decisions are pure functions of that ``SwarmView`` (``donors``: whom to fetch which
fragment from, which fetched fragments replace ours) and of the node's versions
(``diloco.node.evidence.suspects``: which fragments to keep checking).

``Healer`` keeps the state between checks (suspect and diverged fragments), runs a check on
the node's healing executor through a ``StateSource`` (the swarm, adapted by ``SwarmNode``),
and adopts a downloaded fragment only when its bytes hash to a vouched state.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import Executor, Future, wait
from typing import Any, Protocol

from diloco.errors import DilocoError, ProtocolError
from diloco.node.evidence.claims import (
    UNCOUNTED,
    Evidence,
    Offences,
    Schedule,
    SwarmView,
    assess,
    creator_missing,
    creator_worked,
    vouched_claims,
)
from diloco.node.evidence.suspects import (
    failed_everywhere,
    missed_rounds,
    open_suspects,
    version_of,
)
from diloco.node.evidence.witness import Witness
from diloco.node.swarm.donors import (
    MAX_LAG_STEPS,
    Mine,
    beyond_initial,
    catch_up_step,
    choose_donors,
    fragments_to_adopt,
    heal_plan,
    join_donors,
    lagging,
    skip_target,
)
from diloco.node.swarm.fetch_groups import by_donor
from diloco.node.training.trainer import NodeTrainer
from diloco.protocol.core.reducer import RoundKey, RoundResult
from diloco.protocol.records.nodes import NodeRecord, Vouch
from diloco.protocol.state.fragment import FragmentState, OuterState

logger = logging.getLogger(__name__)

SETTLE_TIMEOUT = 10.0
"""Seconds a joiner waits for the rounds that were in flight during its download."""
HEAL_CHECK_EVERY = 1.0
"""Seconds between two checks of the records while a fragment is suspect."""
VOUCH_WAIT = 8.0
"""Seconds a downloaded state of a round newer than every vouched one waits for its
vouches: members publish them within ``PUBLISH_EVERY`` (5 s) of applying the round,
usually within a second."""
VOUCH_POLL = 0.5
"""Seconds between two reads of the vouches while waiting for them."""
JOIN_RETRY = 2.0
"""Seconds between a joiner's attempts to find and download a vouched state."""
MAX_DONORS_TRIED = 8
"""Donors one download tries in turn before the check gives up until the next one."""
VERIFY_AFTER = 2.0
"""Seconds after a fragment's version moved (a round applied) before checking it against
the swarm: its members publish their vouches right after applying it."""


class StateSource(Protocol):
    """The swarm as healing sees it: records and vouches to read, fragments to fetch."""

    def read_swarm(self, fragments: Sequence[int]) -> tuple[list[NodeRecord], list[Vouch]]:
        """The node records and the vouches for ``fragments``, read at once: a heal that
        holds a send waits for one DHT lookup, not two in turn (docs/design.md "Healing and
        joining")."""
        ...

    def read_vouches(self, fragments: Sequence[int]) -> list[Vouch]: ...

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
    ``check_and_fetch`` runs on ``worker`` and touches no trainer state. ``initial_hashes``
    are the hashes of this node's fragments before any training (version 0, the run's seed):
    the only version-0 state it adopts. ``anchors`` are the peer ids of its initial peers,
    ``witness`` the rounds it applied: together with the run's creator, whose word it may
    act on (``claims.Evidence``).
    """

    def __init__(
        self,
        trainer: NodeTrainer,
        source: StateSource,
        me: str,
        worker: Executor,
        emit: Callable[[dict[str, Any]], None],
        on_adopted: Callable[[], None],
        initial_hashes: Sequence[str],
        anchors: Collection[str] = (),
        witness: Witness | None = None,
        on_behind: Callable[[], None] = lambda: None,
    ) -> None:
        self.trainer, self.source, self.me, self.worker = trainer, source, me, worker
        self.emit, self.on_adopted = emit, on_adopted
        self.on_behind = on_behind
        """Called when this node skips ahead to the swarm's step: it was behind, so the
        rounds it led alone were late ones (``SwarmReducer.set_behind``)."""
        self.initial_hashes = tuple(initial_hashes)
        self.anchors = frozenset(anchors)
        """Peer ids this node joined through (``claims``: whose word counts while it has
        seen nobody work)."""
        self.witness = witness if witness is not None else Witness(me)
        self.numel = {p: s.outer.numel() for p, s in enumerate(trainer.sync.states)}
        self.schedule = Schedule(
            trainer.run.steps, trainer.run.outer.sync_every, trainer.sync.num_fragments
        )
        self.offences = Offences()
        self.uncounted = Offences(UNCOUNTED)
        self.suspects: dict[int, int] = {}
        """Fragment -> the round that failed for it, until healed or superseded."""
        self.diverged: set[int] = set()
        """Fragments a check found behind or in the minority whose fetched state could not
        be adopted (a round was in flight, or a round was applied meanwhile), or whose check
        failed: checked again, like suspects, until a check finds them in line."""
        self.checking: list[int] = []
        """The fragments of the check in ``future``."""
        self.checked_at = 0.0
        self.future: Future[OuterState | None] | None = None
        self.last_view: SwarmView | None = None
        """The view the last check read (a worker thread sets it; the training thread reads
        it before a send: ``before_send``)."""
        self.healed_fragments = 0
        self.creator_live = False
        """Whether the last read found a record of the run's creator (``refusal``)."""
        self.creator_worked = False
        """Whether a read found the creator's vouch for a round with others (it stays so)."""
        self.seen_versions = self.versions()
        self.verify_at: dict[int, float] = {}
        """Fragment -> when to check it once: its version moved. A round that succeeds can
        still leave us apart from its other members when we entered it from another
        state (a split at the previous round: the chaos run)."""

    @property
    def sync_every(self) -> int:
        return self.trainer.run.outer.sync_every

    def versions(self) -> list[int]:
        return [s.version for s in self.trainer.sync.states]

    def mine(self) -> Mine:
        """This node's fragments, their hashes from the outer loop's cache (a fragment is
        hashed once per change, not at every check)."""
        sync = self.trainer.sync
        return {p: (s.version, sync.state_hash(p)) for p, s in enumerate(sync.states)}

    # -- reading and fetching (worker thread, or the joiner before training) ----------------

    def evidence(self) -> Evidence:
        """Whose word this check may act on: the peers this node saw work, its anchors, the
        run's creator (docs/design.md "Evidence")."""
        workers = self.witness.workers()
        return Evidence(self.me, workers, self.anchors, self.trainer.run.creator)

    def refusal(self, result: RoundResult) -> str | None:
        """Why this node should not apply ``result`` (``FragmentSync.refuse``, the training
        thread): a round without the run's creator before it has worked with anyone
        (``claims.creator_missing``; this node's own rounds with it count as its word)."""
        creator = self.trainer.run.creator
        worked = self.creator_worked or creator in self.witness.workers()
        return creator_missing(result.members, self.me, creator, self.creator_live, worked)

    def read_view(self) -> SwarmView:
        """The records and vouches of the swarm, judged (``claims.assess``); offenders and
        refused vouchers are logged once each."""
        found, vouches = self.source.read_swarm(range(self.schedule.num_fragments))
        records = [r for r in found if r.peer_id != self.me]
        creator = self.trainer.run.creator
        self.creator_live = any(r.peer_id == creator for r in records)
        self.creator_worked = self.creator_worked or creator_worked(vouches, creator)
        view = assess(records, vouches, self.schedule, self.initial_hashes, self.evidence())
        self.offences.report_all(view.offences)
        self.uncounted.report_all(view.uncounted)
        self.last_view = view
        return view

    def fetch_vouched(
        self, fragments: Sequence[int], donors: Sequence[str], view: SwarmView
    ) -> OuterState:
        """``fragments`` from the first of ``donors`` whose download is vouched for.

        Raises:
            ProtocolError: no donor delivered a valid, vouched state (each reason logged).
        """
        errors = []
        for donor in donors[:MAX_DONORS_TRIED]:
            try:
                state = self.source.fetch_state(fragments, self.numel, [donor])
                self.verify(state, view, donor)
                return state
            except ProtocolError as error:
                errors.append(f"{donor}: {error}")
        raise ProtocolError(f"no donor delivered a vouched state: {errors}")

    def verify(self, state: OuterState, view: SwarmView, donor: str) -> None:
        """Raise unless every fragment of ``state`` (from ``donor``) hashes to a vouched
        state, or to our initial state at version 0. A round newer than every vouched one
        may be vouched a few seconds later: for such fragments the vouches are read again,
        until ``VOUCH_WAIT``. A state of an already vouched round with another hash (or of
        a round the run never sends) is a forgery: the donor is logged as an offender.

        Raises:
            ProtocolError: a fragment not adoptable on this node's evidence.
        """
        claims = view.vouched
        pending = {p: (s.version, s.sha256()) for p, s in state.fragments.items()}
        deadline = time.monotonic() + VOUCH_WAIT
        while pending := {p: vh for p, vh in pending.items() if (p, *vh) not in claims}:
            p, (k, h) = min(pending.items())
            why = f"fragment {p} at version {k} with hash {h[:16]}... is not vouched"
            last = self.schedule.last_round(self.schedule.steps, p)
            if not all(view.newest_vouched(q) < v <= last for q, (v, _) in pending.items()):
                self.offences.report(donor, f"download refused: a forged state: {why}")
                raise ProtocolError(f"{why} by the peers this node counts")
            if time.monotonic() > deadline:
                raise ProtocolError(f"{why} after {VOUCH_WAIT:.0f} s")
            time.sleep(VOUCH_POLL)
            vouches = self.source.read_vouches(sorted(pending))
            claims = vouched_claims(vouches, self.schedule, self.initial_hashes, self.evidence())

    # -- joining ------------------------------------------------------------------------------

    def join(self, deadline: float) -> None:
        """A joiner's first act: download every fragment from a donor whose whole state is
        vouched (but those no round has changed yet: ``beyond_initial``), and start at the
        swarm's robust step as read after the download (raised to the send step of the
        newest round adopted, so that our own record stays plausible). Donors are retried
        until ``deadline``: a fresh daemon's first dials can fail, vouches of the newest
        rounds come a few seconds after them, and a busy donor may refuse.

        Raises:
            DilocoError: no vouched state by ``deadline``.
        """
        fragments = list(range(self.schedule.num_fragments))
        # Asked for when no round has been applied yet (the initial state is ours already):
        # a peer that took its donor's state keeps that donor from rounds of one
        # (docs/design.md "Algorithm and schedule").
        smallest = min(fragments, key=lambda p: self.numel[p])
        while True:
            view = self.read_view()
            try:
                donors = [r.peer_id for r in join_donors(view, len(fragments))]
                if not donors:
                    raise ProtocolError("no node publishes a vouched state yet")
                wanted = beyond_initial(view, fragments, self.initial_hashes) or [smallest]
                state = self.fetch_vouched(wanted, donors, view)
                break
            except ProtocolError as error:
                if time.monotonic() > deadline:
                    raise DilocoError(f"could not download the run's state: {error}") from error
                logger.warning("no state yet (%s); retrying", error)
                time.sleep(JOIN_RETRY)
        # The swarm trained on during the download (seconds with a busy donor; a joiner of
        # the healing-attack swarm once started 7.5 s behind its creator and stayed behind),
        # so the step is read again after it; rounds the download missed are settled next.
        robust = max(view.step or 0, self.read_view().step or 0)
        step = catch_up_step(state.fragments, robust, self.sync_every, len(self.numel))
        self.trainer.adopt_outer_state(dict(state.fragments), step=step)
        self.on_adopted()

    def settle_rounds_in_flight(self, deadline: float) -> None:
        """A joiner's download can predate a round in flight: fetch those fragments again
        once peers applied and vouched for that round (until ``deadline``; a round that
        failed for everyone never shows up). What is still missing then is healed while
        training. Rounds that every peer's record shows as failed are not waited for."""
        tau = self.trainer.run.outer.fragment_sync_delay
        while missed := missed_rounds(self.trainer.step, self.versions(), self.sync_every):
            if time.monotonic() > deadline:
                self.suspects.update(missed)
                return
            view = self.read_view()
            if failed_everywhere(view, missed, self.schedule, tau):
                self.suspects.update(missed)
                return
            mine = self.mine()
            for p, k in missed.items():
                ahead = choose_donors(view, p, *mine[p])
                donors = [r.peer_id for r in ahead if version_of(r, p) >= k]
                if donors:
                    try:
                        self.adopt(self.fetch_vouched([p], donors, view))
                    except ProtocolError as error:
                        logger.info("fragment %d not settled yet: %s", p, error)
            if missed_rounds(self.trainer.step, self.versions(), self.sync_every):
                time.sleep(0.5)

    # -- healing while training ------------------------------------------------------------

    def adopt(self, state: OuterState) -> list[int]:
        """Adopt what ``fragments_to_adopt`` picks of ``state`` (already verified), and move
        on to the step of the newest round adopted (``catch_up_step``) if we are behind it."""
        t, sync = self.trainer, self.trainer.sync
        adopted = fragments_to_adopt(state.fragments, self.mine(), sync.in_flight())
        taken = {p: state.fragments[p] for p in adopted}
        step = catch_up_step(taken, t.step, self.sync_every, len(self.numel))
        moved = step > t.step
        if moved:
            self.emit({"event": "caught_up", "from_step": t.step, "to_step": step})
            self.on_behind()
        t.adopt_outer_state(taken, step=step)
        if moved:  # the rounds of the steps skipped are missed, like a lagging node's
            self.suspects.update(missed_rounds(t.step, self.versions(), self.sync_every))
        self.on_adopted()
        return adopted

    def check_and_fetch(self, fragments: list[int], mine: Mine, my_step: int) -> OuterState | None:
        """Worker thread: fetch the fragments that ``heal_plan`` finds out of line (docs/design.md
        "The round": a member "compares the state hash the others publish and heals from a peer if
        it differs"), from vouched donors only. The global step returned is the swarm's robust
        step (None when there is nothing to do)."""
        view = self.read_view()
        fetched = self.fetch_out_of_line(view, mine, my_step, fragments)
        if not fetched and not lagging(view, my_step):
            return None
        return OuterState(view.step or 0, fetched)

    def fetch_out_of_line(
        self, view: SwarmView, mine: Mine, my_step: int, fragments: Sequence[int]
    ) -> dict[int, FragmentState]:
        """Worker thread: those of ``fragments`` that ``heal_plan`` finds out of line in
        ``view``, each from the first of its donors that delivers a vouched state.

        Raises:
            ProtocolError: a fragment's donors all failed.
        """
        fetched: dict[int, FragmentState] = {}
        for group, donors in by_donor(heal_plan(view, mine, my_step, fragments)):
            fetched.update(self.fetch_vouched(group, donors, view).fragments)
        return fetched

    def maybe_heal(self, failed: Sequence[RoundKey]) -> None:
        """Between steps: apply a finished check, or start one when there is reason to.

        A fragment whose round failed (``failed``, at its receive step, or any round in
        flight that failed already) stays suspect until ``open_suspects`` drops it; every
        ``H`` steps all fragments are checked. A fragment found out of line whose fetched
        state could not be adopted (its round was in flight, or a round was applied
        meanwhile: a joiner that arrives while a round is in flight misses that round) is
        checked again every ``HEAL_CHECK_EVERY`` seconds until a check finds it in line.
        Before, such a fragment waited for the next ``H``-step check, which falls on
        fragment 0's send step: a joiner could stay diverged on it for the whole run.
        A fragment whose version moved (a round applied) is checked once ``VERIFY_AFTER``
        seconds later: members that entered the round from different states leave it with
        different states, all of them "successful".
        """
        t = self.trainer
        # A round in flight that failed already (refused by its leader, a diverged prior)
        # is suspect now, not at its receive step: a heal needs the peers' result of it
        # before this fragment's next send, tau steps fewer away.
        early = [r.key for r in t.sync.pending if r.failure() is not None]
        for key in [*failed, *early]:
            self.suspects[key.fragment] = key.round
        if self.future is not None and self.future.done():
            self.apply_check(self.future)
            self.future = None
        H = self.sync_every
        now, versions = time.monotonic(), self.versions()
        for p, (before, after) in enumerate(zip(self.seen_versions, versions, strict=True)):
            if after > before:
                self.verify_at[p] = now + VERIFY_AFTER
        self.seen_versions = versions
        self.suspects = open_suspects(self.suspects, versions, t.step, H)
        periodic = t.step % H == 0
        rested = now - self.checked_at > HEAL_CHECK_EVERY
        due = {p for p, at in self.verify_at.items() if at <= now}
        recheck = set(self.suspects) | self.diverged | due
        if self.future is None and ((recheck and rested) or periodic):
            checking = list(range(len(self.numel))) if periodic else sorted(recheck)
            for p in checking:
                self.verify_at.pop(p, None)
            self.start_check(checking, self.check_and_fetch, checking, self.mine(), t.step)

    def start_check(
        self, fragments: Sequence[int], work: Callable[..., OuterState | None], *args: object
    ) -> None:
        """Run ``work(*args)`` on the healing executor as the check of ``fragments``; what
        it fetches is applied between later steps (``apply_check``)."""
        self.checked_at = time.monotonic()
        self.checking = list(fragments)
        self.future = self.worker.submit(work, *args)

    def await_check(self, deadline: float, stopped: Callable[[], bool] = lambda: False) -> bool:
        """Between steps: wait until ``deadline`` (monotonic) for the check in flight and
        apply it; whether it was done (none in flight: done). ``stopped`` (asked every
        ``VOUCH_POLL``) ends the wait early: a node told to stop does not wait for peers."""
        future = self.future
        if future is None:
            return True
        while not future.done() and not stopped():
            wait([future], timeout=max(0.0, min(VOUCH_POLL, deadline - time.monotonic())))
            if time.monotonic() >= deadline:
                break
        if not future.done():
            return False
        self.future = None
        self.apply_check(future)
        return True

    def apply_check(self, future: Future[OuterState | None]) -> None:
        """Between steps: adopt what a finished check fetched; the fragments of a check
        that failed stay diverged (checked again soon)."""
        t = self.trainer
        try:
            state = future.result()
            self.diverged -= set(self.checking)
        except Exception as error:  # a donor that fails is the donor's problem
            logger.warning("healing failed: %s", error)
            self.diverged |= set(self.checking)
            return
        if state is None:
            return
        to = skip_target(t.step, state.global_step, self.sync_every, len(self.numel))
        if state.global_step > t.step + MAX_LAG_STEPS and to > t.step:
            # A slow node skips ahead to the swarm's robust step rather than miss every
            # round from now on (never to one donor's claim), but not past a round still
            # forming (``skip_target``).
            self.emit({"event": "caught_up", "from_step": t.step, "to_step": to})
            self.on_behind()
            t.adopt_outer_state({}, step=to)
            self.suspects.update(missed_rounds(t.step, self.versions(), self.sync_every))
        adopted = self.adopt(state)
        self.diverged |= set(state.fragments) - set(adopted)
        if adopted:
            self.healed_fragments += len(adopted)
            self.emit({"event": "healed", "step": t.step, "fragments": adopted})
