"""The staged all-reduce over the wire: one ``AllReduceRunner`` per stage.

A round's group (formed by matchmaking as for a flat round) with more members than the
run's ``max_group_size`` is placed on a grid (``grid.plan_grid``, from the round's key and
the GROUP's members: the same plan on every member). Stage ``s`` is an ordinary all-reduce
among this member's stage-``s`` group, with the previous stage's result as input and the
sub-cells' carried weights (capped once, at stage 0; never again) as the members' weights, so every
stage keeps every flat rule: FP32 in group order, one encoding of each mean, exclusion,
re-reduction, reports, checks. Each stage group has its own group id (``stage_group_id``),
so the PART, REPORT and CHECK streams of different stages and groups never mix; the
routing (``routing``) finds the runner of a stage by it. The arithmetic is that of
``staged.staged_mean``, the in-process reference: the same bytes on every member.

**Faults** (``docs/staged.md``, ``stage_views``): when exactly one contributor is missing
from a stage group's agreed result, its members run the group once more as a *view* with
its own id: in stage 0 the cell without the lost member (its survivors' value then counts
the cell but that one, and says so in every later stage's slot weight and id); in a later
stage, the lost contributor's slot taken by a *stand-in*, the next member of its sub-cell
in line order, which holds the same bytes. Who knows starts: a member whose sub-cell lost
someone runs its own view at once and refuses the plan's group (NOT_MEMBER), the stand-in
of a member lost in an earlier stage starts that member's view at once; a stream from a
member of a view moves every other member of the group into it (``_pull``), whatever it was
running. The members of a group that lost a member nobody else knows about (counted
before, lost in this stage) try its stand-in themselves; the stand-in knows from the plan
which such views it may be asked for and serves them, with the value it held entering that
stage, when their first stream arrives, also for a while after its own round ended
(``serving_until``). Every group of a stage thus reduces the same slots, weights and bytes,
and every survivor holds the same value: ``staged.staged_mean`` with ``lost``. Not handled
(the group fails at its members, no partial update is applied): two losses in one stage
group or one cell, a stand-in that is itself lost.

Not on the wire yet: receivers (cells of uneven size, ``grid``) and single-member cells;
such rounds run flat (``grid_for``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from dataclasses import dataclass
from typing import Protocol

import torch
from hivemind.p2p import PeerID

from diloco.errors import RoundFailed
from diloco.protocol.allreduce.member import AllReduceRunner
from diloco.protocol.core.aggregation import cap_weights
from diloco.protocol.core.budget import STAGE_ATTEMPTS, RoundBudget
from diloco.protocol.core.group import GroupInfo
from diloco.protocol.core.reducer import RoundResult, StageMetrics
from diloco.protocol.staged.grid import GridPlan
from diloco.protocol.staged.groups import stage_infos
from diloco.protocol.staged.views import (
    SlotView,
    candidate_views,
    standing_views,
    view_id,
    view_info,
)

logger = logging.getLogger(__name__)


class RunnerFactory(Protocol):
    """Builds the runner of one stage group at this member (``allreduce.runners``)."""

    def __call__(
        self, group: GroupInfo, delta: torch.Tensor, max_weight: float, /
    ) -> AllReduceRunner:
        """The runner of ``group`` with input ``delta``, weights capped at ``max_weight``."""
        ...


@dataclass(frozen=True, slots=True)
class _Moved:
    """Where a stage group went instead of finishing here: the view others pulled this
    member into, or the slot whose member refused or was missing."""

    pull: bytes | None = None
    refused: int | None = None
    missing: int | None = None


class StagedRunner:
    """One member's side of one staged round: its stage groups' runners, one after another.

    ``factory`` builds the runner of one stage (``SwarmReducer`` passes its round's
    ``RoundRunners.in_stages``); ``budget`` says how long a stage may take; ``max_weight``
    caps the members' weights in stage 0 only (the plan's carried weights are sums of
    capped weights).
    """

    transfer_seconds: float | None = None
    """Not measured for staged rounds (``adaptive`` learns from flat ones)."""

    def __init__(
        self,
        *,
        group: GroupInfo,
        plan: GridPlan,
        me: PeerID,
        delta: torch.Tensor,
        factory: RunnerFactory,
        budget: RoundBudget,
        max_weight: float,
    ) -> None:
        self.group, self.plan, self.delta = group, plan, delta
        self.factory, self.budget, self.max_weight = factory, budget, max_weight
        self.index = index = group.index(me)
        self._capped = cap_weights(group.weights, max_weight)
        infos = stage_infos(group, plan)
        places = [
            next(g for g, sg in enumerate(groups) if index in sg.members) for groups in plan.stages
        ]
        self.mine = tuple(infos[s][g] for s, g in enumerate(places))
        """This member's group in each stage."""
        self._infos = infos
        loop = asyncio.get_running_loop()
        self._slots: dict[bytes, tuple[float, asyncio.Future[AllReduceRunner]]] = {}
        """Stage group id -> (how many stage lengths a stream may wait for it, its runner)."""
        self._views: dict[bytes, tuple[SlotView, GroupInfo]] = {}
        """Views of this member's stage groups that another slot's loss may lead it to run,
        by id: the view and the plan's group it changes (``_seen`` builds the view's)."""
        self._seen_infos: dict[bytes, GroupInfo] = {}
        self._pulls: list[list[bytes]] = [[] for _ in plan.stages]
        """Per stage, ids of views of this member's group a member of theirs streamed under,
        first first: the group runs as that view (``_run_stage`` joins it)."""
        self._pulled = [asyncio.Event() for _ in plan.stages]
        for s, info in enumerate(self.mine):
            self._slots[info.group_id] = (STAGE_ATTEMPTS * s, loop.create_future())
            for view in candidate_views(plan, s, index):
                group_id = view_id(group, info, view)
                self._views[group_id] = (view, info)
                self._slots[group_id] = (STAGE_ATTEMPTS * s + 1, loop.create_future())
        self._inputs: list[asyncio.Future[tuple[torch.Tensor, tuple[int, ...]]]] = [
            loop.create_future() for _ in plan.stages
        ]
        """(value, members of its sub-cell it does not count) entering each stage here."""
        self._standing: dict[bytes, tuple[SlotView, GroupInfo]] = {}
        """Views this member may be asked to stand in for, a member counted before and lost
        in that stage."""
        for s in range(1, plan.num_stages):
            for other, view in standing_views(plan, s, index, ()):
                self._standing.update([self._view_of(other, view)])
        self._stood_in: dict[bytes, AllReduceRunner] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._window_end = math.inf
        self._sent = self._received = 0
        self._tried: set[bytes] = set()
        self.runners: list[AllReduceRunner] = []
        """The stages' runners started so far, in stage order."""
        self.part_missing = False
        """Whether this member's own part failed in some stage (``demotion``)."""

    def _view_of(self, member: int, view: SlotView) -> tuple[bytes, tuple[SlotView, GroupInfo]]:
        """``member``'s stage group seen through ``view``, by its id."""
        planned = self.plan.group_of(member, view.stage)
        info = self._infos[view.stage][self.plan.stages[view.stage].index(planned)]
        seen = view_info(self.group, self.plan, self._capped, info, view)
        return seen.group_id, (view, seen)

    async def runner_for(self, group_id: bytes, sender: PeerID) -> AllReduceRunner | None:
        """The runner of this member's stage group ``group_id`` (or a view of it), once that
        stage started here (an earlier stage may still run: bounded by the stages before
        it), or of a view it stands in for; None for another group, or a stage this member
        never starts. A stream from a member of a view tells that the view runs
        (``_pull``)."""
        if group_id in self._stood_in:
            return self._stood_in[group_id]
        if group_id in self._standing:
            return await self._stand_in(group_id)
        if group_id not in self._slots:
            return None
        if group_id in self._views and sender in self._seen(group_id).members:
            self._pull(group_id)
        stages, future = self._slots[group_id]
        await asyncio.wait({future}, timeout=self.budget.stage_wait(stages))
        if not future.done() or future.cancelled():
            return None
        return future.result()

    def _seen(self, group_id: bytes) -> GroupInfo:
        """The stage group of view ``group_id`` (one of ``_views``), built once."""
        if group_id not in self._seen_infos:
            view, info = self._views[group_id]
            seen = view_info(self.group, self.plan, self._capped, info, view)
            self._seen_infos[group_id] = seen
        return self._seen_infos[group_id]

    def _pull(self, group_id: bytes) -> None:
        """A member of a view of one of this member's groups streamed under it: the view
        runs, so this member's group of that stage joins it."""
        view, _ = self._views[group_id]
        if group_id not in self._pulls[view.stage]:
            logger.info("round %s: member %d pulled into %s", self.group.key, self.index, view)
            self._pulls[view.stage].append(group_id)
            self._pulled[view.stage].set()

    async def _stand_in(self, group_id: bytes) -> AllReduceRunner | None:
        """Start (once) the view ``group_id`` with this member in a lost member's slot."""
        view, info = self._standing[group_id]
        entering = self._inputs[view.stage]
        await asyncio.wait({entering}, timeout=self.budget.stage_wait(STAGE_ATTEMPTS * view.stage))
        if not entering.done() or entering.cancelled():
            return None
        value, lost = entering.result()
        if lost != view.lost or asyncio.get_running_loop().time() > self._window_end:
            return None  # it would count its sub-cell otherwise than the view says
        return self._start_stand_in(group_id, view, info, value)

    def _start_stand_in(
        self, group_id: bytes, view: SlotView, info: GroupInfo, value: torch.Tensor
    ) -> AllReduceRunner:
        if group_id not in self._stood_in:
            runner = self.factory(info, value, math.inf)
            self._stood_in[group_id] = runner
            task = asyncio.create_task(self._serve_stand_in(view.stage, runner))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return self._stood_in[group_id]

    async def _serve_stand_in(self, stage: int, runner: AllReduceRunner) -> None:
        info = runner.group
        try:
            await runner.run()
        except RoundFailed as exc:
            logger.info(
                "round %s: member %d stood in stage %d, failed: %s",
                info.key,
                self.index,
                stage,
                exc.reason,
            )
        except Exception:
            logger.exception("round %s: stand-in in stage %d", info.key, stage)
        else:
            logger.info("round %s: member %d stood in in stage %d", info.key, self.index, stage)

    def serving_until(self) -> float:
        """Loop time until which this member's streams must stay routed: the views it may
        still be asked to stand in for, and the checks of those it ran."""
        runners = self._stood_in.values()
        return max([self._window_end, *(runner.deadlines.forget for runner in runners)])

    def exclude(self, peer: PeerID, reason: str) -> None:
        """Stop waiting for ``peer`` in the stage running now."""
        if self.runners:
            self.runners[-1].exclude(peer, reason)

    async def _run_group(
        self, s: int, info: GroupInfo, held: torch.Tensor, watch: int | None = -1
    ) -> RoundResult | _Moved:
        """Run ``info`` here: its result, or where the group moved, the run then cancelled:
        a member of ``watch``'s slot (None: any; -1: none) refused it as not its group, or
        a member streamed under a view of it not tried yet (``_pull``)."""
        runner = self.factory(info, held, self.max_weight if s == 0 else math.inf)
        self.runners.append(runner)
        self._slots[info.group_id][1].set_result(runner)
        self._tried.add(info.group_id)
        task = asyncio.ensure_future(runner.run())
        try:
            while True:
                moved = self._moved(s, runner, watch)
                if moved is not None:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError, RoundFailed):
                        await task
                    logger.info("round %s: member %d, stage %d: %s", info.key, self.index, s, moved)
                    return moved
                signals = [
                    asyncio.ensure_future(runner.not_member.wait()),
                    asyncio.ensure_future(self._pulled[s].wait()),
                ]
                await asyncio.wait({task, *signals}, return_when=asyncio.FIRST_COMPLETED)
                for signal in signals:
                    signal.cancel()
                if task.done():
                    return task.result()
                runner.not_member.clear()
                self._pulled[s].clear()
        except RoundFailed as exc:
            raise RoundFailed(exc.fragment, exc.round, f"stage {s}: {exc.reason}") from exc
        finally:
            task.cancel()
            self.part_missing = self.part_missing or runner.part_missing
            self._sent += runner.counter.sent
            self._received += runner.counter.received

    def _moved(self, s: int, runner: AllReduceRunner, watch: int | None) -> _Moved | None:
        if watch == -1:
            return None
        pull = self._next_pull(s)
        if pull is not None:
            return _Moved(pull=pull)
        refused = [k for k in sorted(runner.not_members) if watch in (None, k)]
        return _Moved(refused=refused[0]) if refused else None

    def _next_pull(self, s: int) -> bytes | None:
        """A view of this member's stage-``s`` group that runs and was not tried here: one
        whose sub-cell lost someone (its source knows) before a plain stand-in."""
        pending = [i for i in self._pulls[s] if i not in self._tried]
        knowing = [i for i in pending if self._views[i][0].lost]
        return knowing[0] if knowing else pending[0] if pending else None

    async def _run_stage(
        self, s: int, held: torch.Tensor, lost: tuple[int, ...]
    ) -> tuple[RoundResult, GroupInfo, tuple[int, ...]]:
        """Stage ``s`` here with ``held``, which counts this member's sub-cell but ``lost``:
        the result, the group it came from, and the members it does not count.

        The plan's group first. A member of the group streaming under one of its views
        moves this member there at once (the view's source knows best). When one slot
        ``k`` of the plan's group went missing, this member tries in stage 0 the cell
        without ``k``'s member, later ``k``'s stand-in counting its whole sub-cell; so too
        when the group failed here with only ``k``'s member taken for gone (``_gone``).
        When it refused the group as not its own, or that failed, it waits a stage length
        for a view to run.

        Raises:
            RoundFailed: an attempt failed here and nothing was left to try.
        """
        info, me = self.mine[s], self.group.members[self.index]
        if lost:  # this member's slot differs from the plan's: it runs its view at once
            self._slots[info.group_id][1].cancel()
            slot = info.members.index(me)
            own_id, (_, own) = self._view_of(self.index, SlotView(s, slot, self.index, lost))
            self._slots[own_id] = (STAGE_ATTEMPTS * s, asyncio.get_running_loop().create_future())
            for other, view in standing_views(self.plan, s, self.index, lost):
                group_id, (_, theirs) = self._view_of(other, view)
                self._start_stand_in(group_id, view, theirs, held)
            result = await self._run_group(s, own, held)
            assert isinstance(result, RoundResult)  # -1: nothing moves it
            return result, own, lost
        current, view = info, SlotView(s, -1, None, ())
        failure: RoundFailed | None = None
        outcome: RoundResult | _Moved
        for _ in range(STAGE_ATTEMPTS):
            try:
                outcome = await self._run_group(
                    s, current, held, watch=None if current is info else view.slot
                )
            except RoundFailed as exc:  # a member gone mid-stage may split the others
                outcome, failure = _Moved(missing=self._gone(self.runners[-1])), exc
            else:
                failure = None
            if isinstance(outcome, RoundResult):
                missing = [k for k, n in enumerate(current.names) if n not in outcome.members]
                if not missing:
                    return outcome, current, view.lost
                if len(missing) == 1 and current.members[missing[0]] != me:
                    outcome = _Moved(missing=missing[0])
                else:
                    outcome = _Moved()
            pull = outcome.pull
            if pull is None and current is info and outcome.missing is not None:
                pull = self._fallback(s, outcome.missing)  # a refusal: its view will come
            if pull is None:
                pull = await self._await_pull(s)
            if pull is None:
                break
            view, current = self._views[pull][0], self._seen(pull)
            logger.info("round %s: member %d, stage %d: now %s", info.key, self.index, s, view)
        if failure is not None:
            raise failure
        raise RoundFailed(
            info.key.fragment,
            info.key.round,
            f"stage {s}: did not count every member of {', '.join(current.names)} (a staged "
            "round counts every member of every stage group, or a stand-in for it)",
        )

    @staticmethod
    def _gone(runner: AllReduceRunner) -> int | None:
        """The slot of the one member ``runner`` lost, if exactly one: taken for gone (its
        streams broke in transport) or silent (no REPORT). A member that dies while
        delivering its averaged part leaves the others of its group holding different
        results, so all fail; each then tries that slot's view as if the member were
        missing from an agreed result."""
        n, me = len(runner.group.members), runner.index
        silent = {i for i in range(n) if i != me and i not in runner.reports.received}
        lost = runner.substitutes.gone | silent
        return next(iter(lost)) if len(lost) == 1 else None

    def _fallback(self, s: int, k: int) -> bytes | None:
        """The view this member tries itself when slot ``k`` of its stage-``s`` group is
        missing: the cell without it (stage 0), or its stand-in counting it all."""
        for group_id, (view, _) in self._views.items():
            if (view.stage, view.slot) == (s, k) and (s == 0 or not view.lost):
                return group_id if group_id not in self._tried else None
        return None

    async def _await_pull(self, s: int) -> bytes | None:
        """A view of this member's stage-``s`` group that others run, waited for a stage
        length (its source may still be in the previous stage)."""
        with contextlib.suppress(asyncio.TimeoutError):
            async with asyncio.timeout(self.budget.stage_wait(1)):
                while (pull := self._next_pull(s)) is None:
                    self._pulled[s].clear()
                    await self._pulled[s].wait()
                return pull
        return None

    async def run(self) -> RoundResult:
        """Run the stages; the last one's result, with each stage's metrics.

        Raises:
            RoundFailed: a stage failed here, or did not count all its contributors.
        """
        loop = asyncio.get_running_loop()
        start, held = loop.time(), self.delta
        lost: tuple[int, ...] = ()
        stages: list[StageMetrics] = []
        try:
            for s, info in enumerate(self.mine):
                began = loop.time()
                self._inputs[s].set_result((held, lost))
                if len(info.members) == 1:  # its sub-cell's mean is already the cell's
                    self._slots[info.group_id][1].cancel()
                    stages.append(StageMetrics(s, 1, 0, 0, 0.0))
                    continue
                sent, received = self._sent, self._received
                result, ran, lost = await self._run_stage(s, held, lost)
                missing = [n for n in ran.names if n not in result.members]
                if missing:
                    raise RoundFailed(
                        info.key.fragment,
                        info.key.round,
                        f"stage {s}: did not count {', '.join(missing)} (a staged round "
                        "counts every member of every stage group, or a stand-in for it)",
                    )
                held = result.delta
                seconds = loop.time() - began
                stages.append(
                    StageMetrics(
                        s, len(ran.members), self._sent - sent, self._received - received, seconds
                    )
                )
                logger.info(
                    "round %s: stage %d of %d done in %.3fs", info.key, s, len(self.mine), seconds
                )
        finally:
            for _, future in self._slots.values():
                if not future.done():
                    future.cancel()
            for entering in self._inputs:
                if not entering.done():
                    entering.cancel()
            # others' views start at most a few stage lengths after ours ended
            self._window_end = loop.time() + self.budget.stage_wait(STAGE_ATTEMPTS - 1)
        names = self.group.names
        return RoundResult(
            delta=held,
            members=tuple(n for i, n in enumerate(names) if i not in lost),
            weights={
                n: w
                for i, (n, w) in enumerate(zip(names, self.group.weights, strict=True))
                if i not in lost
            },
            bytes_sent=sum(m.bytes_sent for m in stages),
            bytes_received=sum(m.bytes_received for m in stages),
            seconds=loop.time() - start,
            stages=tuple(stages),
        )
