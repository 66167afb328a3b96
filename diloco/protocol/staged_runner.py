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

**Faults** (``docs/allreduce.md`` "Staged rounds"): another cell or stage cannot see which
members a stage counted, and a sub-cell's weight in the next stage is fixed by the plan, so
a stage group whose result does not count every one of its contributors fails its round at
its members (no partial update is applied); a member never starts the next stage with a
mean that lacks someone. A member lost during stage ``s`` thus fails its stage-``s`` group,
and, as its slot in the later stages stays empty, every group that waits for it there;
members whose groups counted everyone apply the full staged mean.

Not on the wire yet: receivers (cells of uneven size, ``grid``) and single-member cells;
such rounds run flat (``grid_for``).
"""

from __future__ import annotations

import asyncio
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
        index = group.index(me)
        infos = stage_infos(group, plan)
        self.mine = tuple(
            infos[s][next(g for g, sg in enumerate(groups) if index in sg.members)]
            for s, groups in enumerate(plan.stages)
        )
        """This member's group in each stage."""
        loop = asyncio.get_running_loop()
        self._slots: dict[bytes, asyncio.Future[AllReduceRunner]] = {
            info.group_id: loop.create_future() for info in self.mine
        }
        self._slots_list = list(self._slots.values())
        self.runners: list[AllReduceRunner] = []
        """The stages' runners started so far, in stage order."""
        self.part_missing = False
        """Whether this member's own part failed in some stage (``demotion``)."""

    async def runner_for(self, group_id: bytes) -> AllReduceRunner | None:
        """The runner of this member's stage group ``group_id``, once that stage started
        here (an earlier stage may still run: bounded by the stages before it); None for
        another group, or a stage this member never starts."""
        future = self._slots.get(group_id)
        if future is None:
            return None
        stage = self._slots_list.index(future)
        t = self.timeouts
        await asyncio.wait({future}, timeout=t.matchmaking + stage * (t.allreduce + t.verification))
        if not future.done() or future.cancelled():
            return None
        return future.result()

    def exclude(self, peer: PeerID, reason: str) -> None:
        """Stop waiting for ``peer`` in the stage running now."""
        if self.runners:
            self.runners[-1].exclude(peer, reason)

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
                if len(info.members) == 1:  # its sub-cell's mean is already the cell's
                    self._slots[info.group_id].cancel()
                    stages.append(StageMetrics(s, 1, 0, 0, 0.0))
                    continue
                runner = self.make_runner(info, held, self.max_weight if s == 0 else math.inf)
                self.runners.append(runner)
                self._slots[info.group_id].set_result(runner)
                try:
                    result = await runner.run()
                except RoundFailed as exc:
                    raise RoundFailed(exc.fragment, exc.round, f"stage {s}: {exc.reason}") from exc
                finally:
                    self.part_missing = self.part_missing or runner.part_missing
                missing = [n for n in info.names if n not in result.members]
                if missing:
                    raise RoundFailed(
                        info.key.fragment,
                        info.key.round,
                        f"stage {s}: did not count {', '.join(missing)} (a staged round "
                        "counts every member of every stage group)",
                    )
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
            for future in self._slots.values():
                if not future.done():
                    future.cancel()
        return RoundResult(
            delta=held,
            members=self.group.names,
            bytes_sent=sum(m.bytes_sent for m in stages),
            bytes_received=sum(m.bytes_received for m in stages),
            seconds=loop.time() - start,
            stages=tuple(stages),
        )
