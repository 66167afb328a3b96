"""Members that send what a broken or hostile peer sends (fault injection by subclass).

Shared by the real-process tests (``swarm_peers``) and the in-process ones: the sender
faults corrupt only what a member *sends* as contributions, so a faulty member still reduces
its own part honestly; ``LYING_REDUCER`` is honest everywhere except in its own part. The
faulty classes reach a round through the production hook (``runners.Faults``): ``Injected``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import os
from dataclasses import dataclass
from typing import Any

import torch
from hivemind.p2p import PeerID

from diloco.errors import RoundFailed
from diloco.protocol.allreduce.member import AllReduceRunner
from diloco.protocol.allreduce.part_server import PartServer
from diloco.protocol.core.assembly import Assembled
from diloco.protocol.core.group import GroupInfo
from diloco.protocol.core.reducer import RoundKey
from diloco.protocol.matchmaking.matchmaker import Matchmaker
from diloco.protocol.runtime.streams import write_frame
from diloco.protocol.wire.check import Seal
from diloco.protocol.wire.frames import Kind, RoundTag
from diloco.protocol.wire.part import Averaged, PartHead


@dataclass(frozen=True)
class Injected:
    """The classes one member runs in every group (a ``runners.Faults``)."""

    runner: type[AllReduceRunner] = AllReduceRunner
    server: type[PartServer] = PartServer

    def runner_type(self, group: GroupInfo) -> type[AllReduceRunner]:
        return self.runner

    def server_type(self, group: GroupInfo) -> type[PartServer]:
        return self.server


Member = type[AllReduceRunner] | Injected
"""What a test says a member runs: a runner class, or the classes a fault injects."""


def injected(member: Member) -> Injected:
    """``member`` as the production fault hook takes it."""
    return member if isinstance(member, Injected) else Injected(runner=member)


class Fault(enum.Enum):
    NONE = "none"
    GARBAGE_RANDOM = "garbage_random"
    WRONG_LENGTH = "wrong_length"
    WRONG_RUN = "wrong_run"
    WRONG_CODEC = "wrong_codec"
    OVERSIZE = "oversize"
    NAN = "nan"
    HUGE_NORM = "huge_norm"
    BAD_SEAL = "bad_seal"
    STALL_MEMBER = "stall_member"
    DIE_AS_LEADER = "die_as_leader"
    CUT_FIRST_JOIN = "cut_first_join"
    LYING_REDUCER = "lying_reducer"
    SCALED_CONTRIBUTION = "scaled_contribution"
    SILENT_LEADER = "silent_leader"
    SILENT_SENDER = "silent_sender"


GARBAGE = [
    Fault.GARBAGE_RANDOM,
    Fault.WRONG_LENGTH,
    Fault.WRONG_RUN,
    Fault.WRONG_CODEC,
    Fault.OVERSIZE,
    Fault.NAN,
    Fault.HUGE_NORM,
    Fault.BAD_SEAL,
]
"""Faults of a sender whose every chunk must be refused (codec ``none``: NAN needs it;
BAD_SEAL: parts of one chunk, which its invalid seal makes invalid)."""


class CorruptSender(AllReduceRunner):
    """Sends corrupted chunks to every other reducer (``fault`` picks how)."""

    fault = Fault.NONE

    def _encode_chunk(self, j: int, c: int) -> bytes:
        payload = super()._encode_chunk(j, c)
        a, b = self.plan.chunks[j][c]
        if self.fault == Fault.GARBAGE_RANDOM:
            return bytes([255]) + os.urandom(len(payload) - 1)
        if self.fault == Fault.WRONG_LENGTH:
            return payload[:-3]
        if self.fault == Fault.WRONG_CODEC:
            other = 2 if payload[0] != 2 else 1
            return bytes([other]) + payload[1:]
        if self.fault == Fault.OVERSIZE:
            return payload + bytes(8 << 20)
        if self.fault == Fault.NAN:
            assert self.plan.codec.name == "none", "NaN payloads are built for the none codec"
            return payload[:5] + torch.full((b - a,), float("nan")).numpy().tobytes()
        if self.fault == Fault.HUGE_NORM:
            return self.plan.codec.encode((self.delta[a:b] * 1e6).contiguous())
        return payload

    def _seal(self, j: int) -> bytes:
        if self.fault == Fault.BAD_SEAL:
            return Seal(self.plan.seal_head(j), os.urandom(64)).serialize()
        return super()._seal(j)

    def _part_head(self, j: int, c: int) -> PartHead:
        head = super()._part_head(j, c)
        if self.fault == Fault.WRONG_RUN:
            tag = RoundTag(bytes(16), head.tag.fragment, head.tag.round)
            return PartHead(tag, head.group_id, head.part, head.chunk)
        return head


def corrupt_sender(fault: Fault) -> type[AllReduceRunner]:
    """A ``CorruptSender`` class for one of the ``GARBAGE`` faults."""
    return type(f"Corrupt_{fault.value}", (CorruptSender,), {"fault": fault})


class CutPartStreams(AllReduceRunner):
    """Its first PART stream to every reducer is cut right after the first two chunks went
    out (a stream lost in transit); it then opens the stream again, as any member does,
    and sends every chunk again: the reducer must skip the two it holds."""

    async def _exchange_inner(self, j: int, peer: PeerID, r: int) -> Any:
        cut: set[int] = self.__dict__.setdefault("_cut", set())
        if j in cut:
            return await super()._exchange_inner(j, peer, r)
        cut.add(j)
        loop = asyncio.get_running_loop()
        _, _, writer = await self.p2p.call_binary_stream_handler(peer, self.part_handler)
        for c in range(min(2, len(self.plan.chunks[j]))):
            frame = await loop.run_in_executor(None, self._part_frame, j, c)
            await write_frame(writer, Kind.PART, *frame, counter=self.counter)
        await asyncio.sleep(0.05)
        writer.close()
        raise ConnectionResetError("test fault: PART stream cut")


class ScalingServer(PartServer):
    """Averages honestly, then sends ``factor`` times the mean over ``blocks`` (of 256
    values; None: all), encoded once and sealed: the same bytes to every member, so their
    REPORT digests agree (attack 2)."""

    factor = -30.0
    blocks: tuple[int, ...] | None = None

    def average_chunk(self, c: int, own: torch.Tensor) -> tuple[Averaged, torch.Tensor, list[int]]:
        msg, _, clipped = self.reducer.average(c, own)
        codec = self.plan.return_codec
        lie = codec.decode(msg.payload)
        for block in self.blocks or range(-(-lie.numel() // 256)):
            lie[block * 256 : (block + 1) * 256] *= self.factor
        msg = dataclasses.replace(msg, payload=codec.encode(lie))
        return msg, codec.decode(msg.payload), clipped


LYING_REDUCER = Injected(server=ScalingServer)
"""Honest member, lying reducer: its part is -30 times the true mean."""


class LyingReporter(AllReduceRunner):
    """Reduces honestly, then reports a result digest nobody assembled."""

    async def _exchange_reports(self, assembled: Assembled) -> None:
        await super()._exchange_reports(dataclasses.replace(assembled, digest=b"\x00" * 32))


SCALE = 50.0
"""How much ``ScaledContribution`` inflates its delta: under the reducers' ``max_norm_ratio``
(100), so its chunks are valid and only clipping bounds them."""


class ScaledContribution(AllReduceRunner):
    """Contributes ``SCALE`` times its delta, everywhere."""

    def __init__(self, *, delta: torch.Tensor, **kwargs: Any) -> None:
        super().__init__(delta=delta * SCALE, **kwargs)


class SilentLeader(Matchmaker):
    """Honest as a follower; as leader it takes the JOINs and answers none of them, holding
    their streams open until its matchmaking bound (alive, yet silent)."""

    async def _lead(self, key: RoundKey, lobby: Any, view: set[PeerID], wait: float) -> Any:
        await asyncio.sleep(self.timeouts.matchmaking)
        raise RoundFailed(key.fragment, key.round, "test fault: silent leader")


class SilentSender(AllReduceRunner):
    """In the group, reduces its own part honestly, and sends no PART to any reducer."""

    async def _exchange(self, j: int) -> None:
        return None
