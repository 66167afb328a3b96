"""The staged all-reduce over the wire (issue 16): one ``AllReduceRunner`` per stage.

A round's group (formed by matchmaking as for a flat round) with more members than the
run's ``max_group_size`` is placed on a grid (``grid.plan_grid``, from the round's key and
the GROUP's members: the same plan on every member). Stage ``s`` is an ordinary all-reduce
among this member's stage-``s`` group, with the previous stage's result as input and the sub-cells'
carried weights (capped once, at stage 0; never again) as the members' weights, so every
stage keeps every flat rule: FP32 in group order, one encoding of each mean, exclusion,
re-reduction, reports, checks. Each stage group has its own group id (``stage_group_id``),
so the PART, REPORT and CHECK streams of different stages and groups never mix; the
routing (``routing``) finds the runner of a stage by it. The arithmetic is that of
``staged.staged_mean``, the in-process reference: the same bytes on every member.

**Faults** (``docs/staged.md``): a member lost in stage ``s >= 1`` after its cell counted
it in stage ``s - 1`` leaves a value that every other member of its sub-cell holds. Its
stage-``s`` group's survivors see it missing from their result and run their group again
at once, under a new id (``stand_in_group_id``), with the next member of the lost one's
sub-cell in line order (``stand_in_for``) in its slot: the *stand-in*, which knows from
the plan which retries it may be asked for and starts one when its first stream arrives,
with the value it held entering that stage, even after its own round ended here
(``serving_until``). Same slots, weights and inputs as every other group of the stage: the
same bytes, the mean of every member (``staged.staged_mean`` with ``lost``). Any other
loss (a member lost in stage 0 is counted in some parts and not others; a second loss in
a group; a stand-in that is itself lost) still fails the groups that did not count
everyone, at their members (no partial update is applied).

Not on the wire yet: receivers (cells of uneven size, ``grid``) and single-member cells;
such rounds run flat (``grid_for``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import math
import struct
from collections.abc import Callable

import torch
from hivemind.p2p import PeerID

from diloco.errors import RoundFailed
from diloco.protocol.aggregation import cap_weights
from diloco.protocol.allreduce import AllReduceRunner
from diloco.protocol.grid import GridPlan, plan_grid
from diloco.protocol.group import GroupInfo, RoundTimeouts
from diloco.protocol.reducer import RoundKey, RoundResult, StageMetrics
from diloco.protocol.wire import GROUP_ID_BYTES

logger = logging.getLogger(__name__)

RunnerFactory = Callable[[GroupInfo, torch.Tensor, float], AllReduceRunner]
"""``(stage group, input vector, weight cap)`` -> the runner of that stage at this member."""


def stage_group_id(group_id: bytes, stage: int, index: int) -> bytes:
    """The id of group ``index`` of stage ``stage`` of the round whose GROUP id is
    ``group_id``: what the PART, REPORT and CHECK heads of that stage group carry."""
    data = group_id + b"|stage|" + struct.pack("!II", stage, index)
    return hashlib.sha256(data).digest()[:GROUP_ID_BYTES]


def stand_in_group_id(group_id: bytes, slot: int, stand_in: bytes) -> bytes:
    """The id of stage group ``group_id`` run again with the peer ``stand_in`` in contributor
    ``slot``'s place: members with different views of who is lost stream under different
    ids and fail rather than mix."""
    data = group_id + b"|stand-in|" + struct.pack("!I", slot) + stand_in
    return hashlib.sha256(data).digest()[:GROUP_ID_BYTES]


def stand_in_for(plan: GridPlan, stage: int, member: int) -> int | None:
    """Who stands in on the wire for ``member`` lost in ``stage`` >= 1: the next member of
    its sub-cell in line order, wrapping round (``staged.staged_mean``'s rule when that one
    is live); None in stage 0 or a sub-cell of one."""
    if stage == 0:
        return None
    start, end = plan.group_of(member, stage - 1).cell
    p = plan.order.index(member)
    following = [*range(p + 1, end), *range(start, p)]
    return plan.order[following[0]] if following else None


def with_stand_in(group: GroupInfo, info: GroupInfo, slot: int, stand_in: int) -> GroupInfo:
    """Stage group ``info`` with ``group``'s member ``stand_in`` in contributor ``slot``."""
    members = list(info.members)
    members[slot] = group.members[stand_in]
    clients = list(info.clients)
    if clients:
        clients[slot] = group.is_client(stand_in)
    return dataclasses.replace(
        info,
        group_id=stand_in_group_id(info.group_id, slot, members[slot].to_bytes()),
        members=tuple(members),
        clients=tuple(clients),
    )


def round_text(key: RoundKey) -> str:
    """The key a round's grid is placed by: its fragment and round, known to every member
    before the GROUP, so no leader can draw group ids until colluders share a cell."""
    return f"{key.fragment}/{key.round}"


def grid_for(group: GroupInfo, max_group_size: int | None, max_weight: float) -> GridPlan | None:
    """The grid of ``group``'s round, or None when it runs flat: no ``max_group_size``, a
    group within it, or a plan the wire does not follow yet (a receiver, a single-member
    stage-0 cell, a stage group of clients only)."""
    if max_group_size is None or len(group.members) <= max_group_size:
        return None
    weights = cap_weights(group.weights, max_weight)
    peers = [peer.to_bytes() for peer in group.members]
    plan = plan_grid(round_text(group.key), peers, weights, max_group_size)
    for s, groups in enumerate(plan.stages):
        for g in groups:
            lone = s == 0 and len(g.contributors) == 1
            clients = len(g.contributors) > 1 and all(map(group.is_client, g.contributors))
            if g.receivers or lone or clients:
                return None
    return plan


def stage_infos(group: GroupInfo, plan: GridPlan) -> tuple[tuple[GroupInfo, ...], ...]:
    """Per stage, per group of the plan: its ``GroupInfo`` (members in the plan's
    contributor order, the order of the weighted sum; weights the carried ones)."""
    return tuple(
        tuple(
            GroupInfo(
                key=group.key,
                group_id=stage_group_id(group.group_id, s, g),
                members=tuple(group.members[i] for i in sg.contributors),
                weights=sg.weights,
                numel=group.numel,
                codec_id=group.codec_id,
                return_codec_id=group.return_codec_id,
                clients=tuple(group.is_client(i) for i in sg.contributors) if group.clients else (),
            )
            for g, sg in enumerate(groups)
        )
        for s, groups in enumerate(plan.stages)
    )


class StagedRunner:
    """One member's side of one staged round: its stage groups' runners, one after another.

    ``make_runner`` builds the runner of one stage (``SwarmReducer`` passes its own, with
    the round's codecs, bans and identity); ``max_weight`` caps the members' weights in
    stage 0 only (the plan's carried weights are sums of capped weights).
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
        make_runner: RunnerFactory,
        timeouts: RoundTimeouts,
        max_weight: float,
    ) -> None:
        self.group, self.plan, self.delta = group, plan, delta
        self.make_runner, self.timeouts, self.max_weight = make_runner, timeouts, max_weight
        self.index = index = group.index(me)
        infos = stage_infos(group, plan)
        places = [
            next(g for g, sg in enumerate(groups) if index in sg.members) for groups in plan.stages
        ]
        self.mine = tuple(infos[s][g] for s, g in enumerate(places))
        """This member's group in each stage."""
        self._plan_groups = tuple(plan.stages[s][g] for s, g in enumerate(places))
        loop = asyncio.get_running_loop()
        self._slots: dict[bytes, tuple[float, asyncio.Future[AllReduceRunner]]] = {}
        """Stage group id -> (how many stage lengths a stream may wait for it, its runner)."""
        self._retries: dict[tuple[int, int], GroupInfo] = {}
        """(stage, slot) -> this member's stage group run again with a stand-in there."""
        for s, info in enumerate(self.mine):
            self._slots[info.group_id] = (2 * s, loop.create_future())
            for slot, member in enumerate(self._plan_groups[s].contributors):
                stand_in = stand_in_for(plan, s, member)
                if member != index and stand_in is not None:
                    retry = with_stand_in(group, info, slot, stand_in)
                    self._retries[s, slot] = retry
                    self._slots[retry.group_id] = (2 * s + 1, loop.create_future())
        self._inputs = [loop.create_future() for _ in plan.stages]
        """The value entering each stage here (what a stand-in contributes)."""
        self._standing: dict[bytes, tuple[int, GroupInfo]] = {}
        """Group id -> (stage, group) of the retries this member would stand in for."""
        for s in range(1, plan.num_stages):
            cell_start, cell_end = plan.group_of(index, s - 1).cell
            for member in plan.order[cell_start:cell_end]:
                if member != index and stand_in_for(plan, s, member) == index:
                    theirs = plan.group_of(member, s)
                    info = infos[s][plan.stages[s].index(theirs)]
                    retry = with_stand_in(group, info, theirs.contributors.index(member), index)
                    self._standing[retry.group_id] = (s, retry)
        self._stood_in: dict[bytes, AllReduceRunner] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._window_end = math.inf
        self.runners: list[AllReduceRunner] = []
        """The stages' runners started so far, in stage order."""
        self.part_missing = False
        """Whether this member's own part failed in some stage (``demotion``)."""

    def _stage_wait(self, stages: float) -> float:
        t = self.timeouts
        return t.matchmaking + stages * (t.allreduce + t.verification)

    async def runner_for(self, group_id: bytes) -> AllReduceRunner | None:
        """The runner of this member's stage group ``group_id``, once that stage started
        here (an earlier stage may still run: bounded by the stages before it), or of a
        retry it stands in for; None for another group, or a stage this member never
        starts."""
        if group_id in self._standing:
            return await self._stand_in(group_id)
        if group_id not in self._slots:
            return None
        stages, future = self._slots[group_id]
        await asyncio.wait({future}, timeout=self._stage_wait(stages))
        if not future.done() or future.cancelled():
            return None
        return future.result()

    async def _stand_in(self, group_id: bytes) -> AllReduceRunner | None:
        """Start (once) the retry ``group_id`` with this member in a lost member's slot."""
        if group_id not in self._stood_in:
            stage, info = self._standing[group_id]
            value = self._inputs[stage]
            await asyncio.wait({value}, timeout=self._stage_wait(2 * stage))
            if not value.done() or value.cancelled():
                return None
            if group_id in self._stood_in:  # another stream started it meanwhile
                return self._stood_in[group_id]
            if asyncio.get_running_loop().time() > self._window_end:
                return None
            runner = self.make_runner(info, value.result(), math.inf)
            self._stood_in[group_id] = runner
            task = asyncio.create_task(self._serve_stand_in(stage, runner))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return self._stood_in[group_id]

    async def _serve_stand_in(self, stage: int, runner: AllReduceRunner) -> None:
        info = runner.group
        try:
            await runner.run()
        except RoundFailed as exc:
            logger.info("round %s: stand-in in stage %d failed: %s", info.key, stage, exc.reason)
        except Exception:
            logger.exception("round %s: stand-in in stage %d", info.key, stage)
        else:
            logger.info("round %s: stood in for a lost member in stage %d", info.key, stage)

    def serving_until(self) -> float:
        """Loop time until which this member's streams must stay routed: the retries it may
        still be asked to stand in for, and the checks of those it ran."""
        runners = self._stood_in.values()
        return max([self._window_end, *(runner.deadlines.forget for runner in runners)])

    def exclude(self, peer: PeerID, reason: str) -> None:
        """Stop waiting for ``peer`` in the stage running now."""
        if self.runners:
            self.runners[-1].exclude(peer, reason)

    async def _run_group(self, s: int, info: GroupInfo, held: torch.Tensor) -> RoundResult:
        runner = self.make_runner(info, held, self.max_weight if s == 0 else math.inf)
        self.runners.append(runner)
        self._slots[info.group_id][1].set_result(runner)
        try:
            return await runner.run()
        except RoundFailed as exc:
            raise RoundFailed(exc.fragment, exc.round, f"stage {s}: {exc.reason}") from exc
        finally:
            self.part_missing = self.part_missing or runner.part_missing

    async def _run_stage(self, s: int, held: torch.Tensor) -> RoundResult:
        """Stage ``s`` here, run again once with a stand-in if one member was lost in it."""
        info = self.mine[s]
        result = await self._run_group(s, info, held)
        missing = [k for k, n in enumerate(info.names) if n not in result.members]
        if len(missing) == 1 and (s, missing[0]) in self._retries:
            retry = self._retries[s, missing[0]]
            logger.info(
                "round %s: stage %d lost %s, again with %s standing in",
                info.key,
                s,
                info.names[missing[0]],
                retry.names[missing[0]],
            )
            again = await self._run_group(s, retry, held)
            result = dataclasses.replace(
                again,
                bytes_sent=result.bytes_sent + again.bytes_sent,
                bytes_received=result.bytes_received + again.bytes_received,
            )
            info = retry
        missing_names = [n for n in info.names if n not in result.members]
        if missing_names:
            raise RoundFailed(
                info.key.fragment,
                info.key.round,
                f"stage {s}: did not count {', '.join(missing_names)} (a staged round "
                "counts every member of every stage group, or a stand-in for it)",
            )
        return result

    async def run(self) -> RoundResult:
        """Run the stages; the last one's result, with each stage's metrics.

        Raises:
            RoundFailed: a stage failed here, or did not count all its contributors.
        """
        loop = asyncio.get_running_loop()
        start, held = loop.time(), self.delta
        stages: list[StageMetrics] = []
        try:
            for s, info in enumerate(self.mine):
                began = loop.time()
                self._inputs[s].set_result(held)
                if len(info.members) == 1:  # its sub-cell's mean is already the cell's
                    self._slots[info.group_id][1].cancel()
                    stages.append(StageMetrics(s, 1, 0, 0, 0.0))
                    continue
                result = await self._run_stage(s, held)
                held = result.delta
                seconds = loop.time() - began
                stages.append(
                    StageMetrics(
                        s, len(info.members), result.bytes_sent, result.bytes_received, seconds
                    )
                )
                logger.info(
                    "round %s: stage %d of %d done in %.3fs", info.key, s, len(self.mine), seconds
                )
        finally:
            for _, future in self._slots.values():
                if not future.done():
                    future.cancel()
            for future in self._inputs:
                if not future.done():
                    future.cancel()
            # others' retries start at most a stage after ours ended
            self._window_end = loop.time() + self._stage_wait(1)
        return RoundResult(
            delta=held,
            members=self.group.names,
            bytes_sent=sum(m.bytes_sent for m in stages),
            bytes_received=sum(m.bytes_received for m in stages),
            seconds=loop.time() - start,
            stages=tuple(stages),
        )
