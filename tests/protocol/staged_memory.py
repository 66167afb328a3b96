"""One staged round among 12 members of one process over in-memory streams (``memory_p2p``),
the wire code unchanged (``StagedRunner``, ``RoundRouter`` routing, one
``AllReduceRunner`` per stage): what ``test_staged_wire.py`` and
``benchmarks/staged_losses.py`` share."""

from __future__ import annotations

import asyncio
import hashlib
import math
from collections.abc import Callable
from typing import Any

import torch
from faults import Member, injected
from hivemind.p2p import PeerID
from memory_p2p import MemoryNetwork, MemoryP2P, make_identity

from diloco.codecs import get_codec
from diloco.protocol.allreduce.member import AllReduceRunner
from diloco.protocol.allreduce.routing import RoundRouter
from diloco.protocol.allreduce.runners import RoundRunners
from diloco.protocol.core.aggregation import CLIP_FACTOR
from diloco.protocol.core.budget import RoundBudget
from diloco.protocol.core.group import GroupInfo, RoundTimeouts
from diloco.protocol.core.reducer import RoundKey, RoundResult
from diloco.protocol.staged.grid import GridPlan
from diloco.protocol.staged.groups import grid_for
from diloco.protocol.staged.runner import RunnerFactory, StagedRunner
from diloco.protocol.trust.bans import BanList
from diloco.protocol.trust.identity import Identity

N, MAX_GROUP, NUMEL = 12, 4, 3_001
KEY = RoundKey(5, 9)
DIGEST = hashlib.sha256(b"staged wire test").digest()[:16]
TIMEOUTS = RoundTimeouts(  # 12 members signing and checking in one process on a busy CPU
    matchmaking_window=0.5,
    join_timeout=0.5,
    sender_timeout=8.0,
    reducer_timeout=6.0,
    report_timeout=4.0,
    verify_timeout=4.0,
    connect_timeout=2.0,
)
WEIGHTS = tuple(float(3 + i) for i in range(N))
IDENTITIES = [make_identity(i) for i in range(N)]

Factory = Callable[[int, MemoryP2P, BanList, RoundRouter], RunnerFactory]
"""``(member, its transport, its bans, its router)`` -> that member's stage runners."""


def peers() -> list[PeerID]:
    """Group order: peer id bytes (the identities' ids do not sort by index)."""
    ids = [PeerID.from_base58(identity.peer_id) for identity in IDENTITIES]
    return sorted(ids, key=PeerID.to_bytes)


def identity_of(peer: PeerID) -> Identity:
    names = [identity.peer_id for identity in IDENTITIES]
    return IDENTITIES[names.index(peer.to_base58())]


def deltas() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(16)
    return [torch.randn(NUMEL, generator=gen) * (1 + 0.1 * i) for i in range(N)]


def runner(
    cls: Member,
    transport: MemoryP2P,
    bans: BanList,
    router: RoundRouter,
    codec: str,
    identity: Identity | None,
    info: GroupInfo,
    x: torch.Tensor,
    cap: float,
) -> AllReduceRunner:
    """A stage runner of ``cls`` (a runner class or injected faults) for ``info`` at the
    member of ``transport``, on the timeouts of ``router``, as ``SwarmReducer`` makes one
    (``RoundRunners.in_stages``: nobody dropped as silent by time in a stage)."""
    runners = RoundRunners(
        transport=router.transport,
        digest=DIGEST,
        codec=get_codec(codec),
        return_codec=get_codec(codec),
        budget=RoundBudget.of(router.timeouts),
        max_norm_ratio=100.0,
        clip_factor=CLIP_FACTOR,
        bans=bans,
        identity=identity,
        faults=injected(cls),
    )
    return runners.in_stages()(info, x, cap)


async def run_round(
    codec: str,
    factory: Factory,
    victim: int | None = None,
    network: MemoryNetwork | None = None,
    timeouts: RoundTimeouts = TIMEOUTS,
) -> tuple[GridPlan, list[Any]]:
    """The plan and every member's result (or exception), once every member but
    ``victim`` ended (the victim's run is then cancelled: it may wait for ever)."""
    network = network or MemoryNetwork()
    members, values = peers(), deltas()
    codec_id = get_codec(codec).codec_id
    group = GroupInfo(KEY, bytes(range(16)), tuple(members), WEIGHTS, NUMEL, codec_id, codec_id)
    plan = grid_for(group, MAX_GROUP, math.inf)
    assert plan is not None
    runs = []
    for i, peer in enumerate(members):
        transport = network.join(peer)
        bans = BanList()
        router = RoundRouter(transport, "run-0", DIGEST, timeouts, bans)
        await router.start()
        staged = StagedRunner(
            group=group,
            plan=plan,
            me=peer,
            delta=values[i],
            factory=factory(i, transport, bans, router),
            budget=RoundBudget.of(timeouts),
            max_weight=math.inf,
        )
        router.expect(KEY).set_result(staged)
        runs.append((router, staged))

    async def one(router: RoundRouter, staged: StagedRunner) -> RoundResult:
        try:
            return await asyncio.wait_for(staged.run(), 120)
        finally:
            router.finish(KEY)

    tasks = [asyncio.ensure_future(one(*r)) for r in runs]
    try:
        await asyncio.wait([t for i, t in enumerate(tasks) if i != victim])
        for task in tasks:
            task.cancel()
        return plan, await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        network.close()
