"""A member of a staged round that sends no PART in stage 0 (``faults.SilentSender``), 12
members of one process over in-memory streams (``staged_memory``): its cell's members
drop it once it served them its part, and the round ends as if it had died as stage 0
started (docs/design.md "Liveness")."""

from __future__ import annotations

import asyncio

import pytest
import torch
from faults import SilentSender
from memory_p2p import MemoryP2P
from staged_memory import KEY, WEIGHTS, N, deltas, peers, run_round, runner

from diloco.codecs import get_codec
from diloco.protocol.allreduce.member import AllReduceRunner
from diloco.protocol.allreduce.routing import RoundRouter
from diloco.protocol.core.group import GroupInfo
from diloco.protocol.core.reducer import RoundResult
from diloco.protocol.staged.grid import plan_grid
from diloco.protocol.staged.reference import staged_mean
from diloco.protocol.staged.runner import RunnerFactory
from diloco.protocol.trust.bans import BanList

pytestmark = pytest.mark.clocked

VICTIM = 3


def test_member_silent_in_stage_0_dropped_on_evidence_by_its_cell() -> None:
    made: list[list[AllReduceRunner]] = [[] for _ in range(N)]

    def factory(i: int, transport: MemoryP2P, bans: BanList, router: RoundRouter) -> RunnerFactory:
        def make(info: GroupInfo, x: torch.Tensor, cap: float) -> AllReduceRunner:
            silent = i == VICTIM and not made[i]
            cls = SilentSender if silent else AllReduceRunner
            made[i].append(runner(cls, transport, bans, router, "none", None, info, x, cap))
            return made[i][-1]

        return make

    _, results = asyncio.run(run_round("none", factory, VICTIM))
    plan = plan_grid(f"{KEY.fragment}/{KEY.round}", [p.to_bytes() for p in peers()], WEIGHTS, 4)
    reference = staged_mean(plan, deltas(), get_codec("none"), lost={VICTIM: 0})
    live = [m for m in range(N) if m != VICTIM]
    expected = reference.values[live[0]].numpy().tobytes()
    cell = sorted(set(plan.group_of(VICTIM, 0).members) - {VICTIM})
    for i in live:
        r = results[i]
        assert isinstance(r, RoundResult), (i, r)
        assert r.delta.numpy().tobytes() == expected
    for i in cell:
        stage_0 = made[i][0]
        silent = stage_0.group.index(peers()[VICTIM])
        assert stage_0.starts.dropped == {silent}, i
        assert silent in stage_0.starts.served
