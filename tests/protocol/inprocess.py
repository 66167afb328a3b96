"""One all-reduce round of ``M`` production runners in one process, over ``memory_p2p``.

Shared by the in-process all-reduce and verification tests. Members have real Ed25519
identities (so chunks are signed and checked as in a swarm); each has its ``BanList``
(``Round.bans``), and every offence or ban its runner reports is also kept in
``Round.offences``. Expected values come from ``InProcessReducer``, which shares no
stream code with the runner.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from faults import Member, injected
from hivemind.p2p import PeerID
from memory_p2p import MemoryNetwork, make_identity

from diloco.codecs import get_codec
from diloco.errors import RoundFailed
from diloco.protocol.allreduce.clock import Clock
from diloco.protocol.allreduce.member import AllReduceRunner
from diloco.protocol.allreduce.routing import RoundRouter
from diloco.protocol.allreduce.runners import RoundRunners
from diloco.protocol.core.aggregation import CLIP_FACTOR
from diloco.protocol.core.budget import RoundBudget
from diloco.protocol.core.group import GroupInfo, RoundTimeouts
from diloco.protocol.core.reducer import Contribution, InProcessReducer, RoundKey, RoundResult
from diloco.protocol.trust.bans import BanList

TIMEOUTS = RoundTimeouts(
    matchmaking_window=1.0,
    join_timeout=1.0,
    sender_timeout=3.0,
    reducer_timeout=3.0,
    report_timeout=2.0,
    verify_timeout=2.0,
    connect_timeout=2.0,
)
RUN_ID = "inprocess-0123456789abcdef"
DIGEST = bytes(range(16))
KEY = RoundKey(4, 2)
Outcome = RoundResult | RoundFailed


def deltas(numel: int, num_members: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(numel + num_members)
    return [torch.randn(numel, generator=generator) * 1e-2 for _ in range(num_members)]


def expected(
    inputs: Sequence[torch.Tensor],
    weights: Sequence[float],
    codec: str = "none",
    clients: Sequence[bool] = (),
    clip_factor: float = CLIP_FACTOR,
) -> torch.Tensor:
    """What every member must get: ``InProcessReducer``'s result ("send/return" codecs)."""
    send, _, back = codec.partition("/")
    reducer = InProcessReducer(get_codec(send), get_codec(back or send), clip_factor=clip_factor)
    flags = clients or [False] * len(inputs)
    contributions = [
        Contribution(str(i), d, w, client=c)
        for i, (d, w, c) in enumerate(zip(inputs, weights, flags, strict=True))
    ]
    return reducer.reduce(KEY, contributions).result().delta


def member_id(i: int) -> PeerID:
    """The peer id of member ``i`` of a ``Round``."""
    return PeerID.from_base58(make_identity(i).peer_id)


def names(n: int, left_out: int | None = None) -> tuple[str, ...]:
    """Members' names in group order, as ``RoundResult.members`` lists them."""
    return tuple(make_identity(i).peer_id for i in range(n) if i != left_out)


class RecordingBans(BanList):
    """A ``BanList`` that also keeps every (group index, offence) reported to it."""

    def __init__(self, ids: Sequence[PeerID], clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(clock=clock)
        self.ids = list(ids)
        self.log: list[tuple[int, str]] = []

    def offend(self, peer: PeerID, reason: str, *, silence: bool = False) -> bool:
        self.log.append((self.ids.index(peer), reason))
        return super().offend(peer, reason, silence=silence)

    def ban(self, peer: PeerID, reason: str) -> None:
        self.log.append((self.ids.index(peer), reason))
        super().ban(peer, reason)


class SteppedClock:
    """A round's timers (``Clock``: routers and runners), moved by the test: past a
    deadline at once, without sleeping until it."""

    def __init__(self) -> None:
        self.now = 0.0
        self.due: list[tuple[float, Callable[..., object], tuple[Any, ...]]] = []

    def time(self) -> float:
        return self.now

    def call_at(self, when: float, callback: Callable[..., object], *args: Any) -> None:
        self.due.append((when, callback, args))

    def advance(self, to: float) -> None:
        """Move to ``to``, running (in time order) what was due by then."""
        self.now = max(self.now, to)
        ready = sorted((c for c in self.due if c[0] <= to), key=lambda c: c[0])
        self.due = [c for c in self.due if c[0] > to]
        for _, callback, args in ready:
            callback(*args)


class Round:
    """One round of ``M`` runners on one in-memory network, as ``SwarmReducer`` sets it up
    (``runner_types``: what each member runs, through the production fault hook)."""

    def __init__(
        self,
        inputs: Sequence[torch.Tensor],
        weights: Sequence[float],
        runner_types: Sequence[Member],
        codec: str = "none",
        timeouts: RoundTimeouts = TIMEOUTS,
        verify: bool = True,
        bans: Sequence[BanList] | None = None,
        max_weight: float = math.inf,
        clip_factor: float = CLIP_FACTOR,
        clients: tuple[bool, ...] = (),
        clock: Clock | None = None,
    ) -> None:
        send, _, back = codec.partition("/")
        self.max_weight, self.clip_factor = max_weight, clip_factor
        self.codec, self.return_codec = get_codec(send), get_codec(back or send)
        self.deltas, self.runner_types, self.timeouts = inputs, runner_types, timeouts
        self.verify, self.clock = verify, clock
        self.network = MemoryNetwork()
        self.identities = [make_identity(i) for i in range(len(inputs))]
        self.ids = [member_id(i) for i in range(len(inputs))]
        self.group = GroupInfo(
            KEY,
            b"G" * 16,
            tuple(self.ids),
            tuple(weights),
            inputs[0].numel(),
            self.codec.codec_id,
            self.return_codec.codec_id,
            clients,
        )
        self.runners: list[AllReduceRunner] = []
        self.tasks: list[asyncio.Task[RoundResult]] = []
        self.bans = list(bans) if bans is not None else [RecordingBans(self.ids) for _ in inputs]
        self.routers: list[RoundRouter] = []

    @property
    def offences(self) -> list[list[tuple[int, str]]]:
        """Per member, the (group index, offence) pairs its runner reported."""
        return [bans.log if isinstance(bans, RecordingBans) else [] for bans in self.bans]

    async def start(self) -> None:
        routers = []
        for peer, bans in zip(self.ids, self.bans, strict=True):
            p2p = self.network.join(peer)
            router = RoundRouter(p2p, RUN_ID, DIGEST, self.timeouts, bans, self.clock)
            await router.start()
            routers.append((router, router.expect(KEY)))
            self.routers.append(router)
        for i, (router, slot) in enumerate(routers):
            runners = RoundRunners(
                transport=router.transport,
                digest=DIGEST,
                codec=self.codec,
                return_codec=self.return_codec,
                budget=RoundBudget.of(self.timeouts),
                max_norm_ratio=100.0,
                clip_factor=self.clip_factor,
                bans=self.bans[i],
                identity=self.identities[i] if self.verify else None,
                faults=injected(self.runner_types[i]),
                clock=self.clock,
            )
            runner = runners(self.group, self.deltas[i], self.max_weight)
            runner.round = self  # type: ignore[attr-defined]  # faults look at the others
            slot.set_result(runner)
            self.runners.append(runner)
        self.tasks = [asyncio.create_task(r.run()) for r in self.runners]

    async def outcomes(self, members: Sequence[int] | None = None) -> list[Outcome]:
        tasks = [self.tasks[i] for i in members] if members is not None else self.tasks
        done = await asyncio.gather(*tasks, return_exceptions=True)
        self.network.close()
        for outcome in done:
            if not isinstance(outcome, RoundResult | RoundFailed):
                raise outcome
        return list(done)


def run_round(
    inputs: Sequence[torch.Tensor],
    weights: Sequence[float],
    runner_types: Sequence[Member],
    codec: str = "none",
    verify: bool = True,
    bans: Sequence[BanList] | None = None,
) -> tuple[list[Outcome], Round]:
    """Run one round to its end; the outcomes in group order, and the round."""

    async def main() -> tuple[list[Outcome], Round]:
        round_ = Round(inputs, weights, runner_types, codec, verify=verify, bans=bans)
        await round_.start()
        return await round_.outcomes(), round_

    return asyncio.run(main())


def delta_of(outcome: Outcome) -> torch.Tensor:
    assert isinstance(outcome, RoundResult), outcome
    return outcome.delta
