"""The reduction state of one all-reduce round, without streams (docs/design.md "The round").

hivemind keeps the stream code of its all-reduce apart from ``TensorPartReducer``, which
holds the arithmetic and who sent what; websockets keeps a sans-I/O core under its asyncio
glue. So do we: ``AllReduceRunner`` (``allreduce``) moves bytes and enforces deadlines, and
feeds what arrives into these classes, which never touch a stream, a clock or a loop:

* ``RoundPlan``: what every member derives alike from the group (parts, chunks, codecs)
  plus the norms of its own delta.
* ``PartReducer``: the reducer side of this member's part: which chunks arrived from whom
  (kept with their hashes and their senders' seals: evidence for disputes), who is excluded
  and why, who counts once the gather closes, the combine step
  (``aggregation.robust_mean``), and the averaged chunks.

The member side, the averaged parts it receives and what they assemble into, is in
``assembly``.

The agreement over REPORTs is in ``agreement``, the checks of other reducers' parts in
``verification``. Methods that decode or encode (``PartReducer.check_chunk``,
``PartReducer.average``) read nothing that changes while they run, so the glue runs them in
an executor; every other method is called on the event loop.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from diloco.codecs import Codec, CodecError
from diloco.errors import ProtocolError
from diloco.protocol.core.aggregation import cap_weights, check_clip_factor, robust_mean
from diloco.protocol.core.norms import (
    Span,
    block_norms,
    check_reference,
    chunk_norm,
)
from diloco.protocol.core.partition import PART_ALIGN, butterfly_parts
from diloco.protocol.wire.frames import Buffer, RoundTag
from diloco.protocol.wire.part import Averaged, PartHead

CHUNK_VALUES = 1 << 18
"""Values per chunk of a part (a multiple of ``PART_ALIGN``): 1 MiB as FP32, 136 KiB as E3M0."""

_RELEASED = torch.empty(0)


def chunk_spans(lo: int, hi: int, chunk_values: int = CHUNK_VALUES) -> list[Span]:
    """Cut part ``[lo, hi)`` into consecutive chunks; an empty part is one empty chunk.

    Chunks start at multiples of ``chunk_values`` from ``lo`` (itself a multiple of
    ``PART_ALIGN``), so encoding chunk by chunk decodes to the same values as encoding the
    whole part, as the in-process reducer does.
    """
    if chunk_values % PART_ALIGN:
        raise ValueError(f"chunk_values must be a multiple of {PART_ALIGN}")
    if hi <= lo:
        return [(lo, lo)]
    return [(a, min(a + chunk_values, hi)) for a in range(lo, hi, chunk_values)]


def check_values(x: torch.Tensor, reference_norm: float, max_norm_ratio: float) -> None:
    """Raise ProtocolError unless ``x`` is finite and its norm is within the bound.

    The bound is ``max_norm_ratio * reference_norm``, the reference one the whole group
    agrees on (``norms.check_reference``), never this node's own norm alone: a node with a
    tiny delta would refuse every honest value. A zero reference leaves only the
    finiteness check, since no scale is known. A finite FP32 norm proves every value
    finite, so the common case takes one pass.
    """
    norm = float(torch.linalg.vector_norm(x))
    if not math.isfinite(norm):
        if not bool(torch.isfinite(x).all()):
            raise ProtocolError("values are not all finite")
        norm = float(torch.linalg.vector_norm(x, dtype=torch.float64))  # FP32 overflowed
    check_norm(norm, reference_norm, max_norm_ratio)


def check_norm(norm: float, reference_norm: float, max_norm_ratio: float) -> None:
    """Raise ProtocolError unless ``norm`` is finite and within ``check_values``' bound."""
    if not math.isfinite(norm):
        raise ProtocolError("values are not all finite")
    if reference_norm > 0 and norm > max_norm_ratio * reference_norm:
        raise ProtocolError(
            f"norm {norm:.3g} > {max_norm_ratio:g} x the group's median norm {reference_norm:.3g}"
        )


def part_digest(bodies: Sequence[Buffer]) -> bytes:
    """sha256 of one part as members compare it and its reducer seals it: its AVERAGED bodies
    in chunk order (mask, norms and payload: what every member must hold alike)."""
    digest = hashlib.sha256()
    for body in bodies:
        digest.update(body)
    return digest.digest()


@dataclass(frozen=True, slots=True)
class RoundPlan:
    """One member's plan of a round: identical on every member except ``index`` and the
    norms, which are those of its own delta (its say in the group's median norm, which
    others' values are judged by: ``norms.check_reference``)."""

    tag: RoundTag
    group_id: bytes
    index: int
    weights: tuple[float, ...]
    """Members' weights in group order (tokens since their last sync, docs/design.md "Algorithm and
    schedule"), each
    clamped to the run's cap (``aggregation.cap_weights``)."""
    spans: tuple[Span, ...]
    """Part ``j`` is ``spans[j]`` of the vector (``butterfly_parts``); member ``j`` reduces it."""
    chunks: tuple[tuple[Span, ...], ...]
    chunk_norms: tuple[tuple[float, ...], ...]
    """L2 norm of this member's delta over each chunk of each part."""
    codec: Codec
    return_codec: Codec
    max_norm_ratio: float
    clip_factor: float
    """C of the norm clipping (``aggregation``); 0: the plain weighted mean."""

    @classmethod
    def build(
        cls,
        *,
        tag: RoundTag,
        group_id: bytes,
        index: int,
        weights: Sequence[float],
        delta: torch.Tensor,
        codec: Codec,
        return_codec: Codec,
        max_norm_ratio: float,
        max_weight: float,
        clip_factor: float,
        clients: Sequence[bool] = (),
    ) -> RoundPlan:
        """``clients`` marks members that reduce nothing: their parts are empty."""
        check_clip_factor(clip_factor)
        shares = [0.0 if client else 1.0 for client in clients] or None
        spans = butterfly_parts(delta.numel(), len(weights), shares)
        chunks = tuple(tuple(chunk_spans(lo, hi)) for lo, hi in spans)
        norms = tuple(
            tuple(float(torch.linalg.vector_norm(delta[a:b])) for a, b in part) for part in chunks
        )
        return cls(
            tag,
            group_id,
            index,
            cap_weights(weights, max_weight),
            tuple(spans),
            chunks,
            norms,
            codec,
            return_codec,
            max_norm_ratio,
            clip_factor,
        )

    @property
    def num_members(self) -> int:
        return len(self.weights)

    @property
    def numel(self) -> int:
        return self.spans[-1][1]

    def head(self, part: int, chunk: int) -> PartHead:
        """The head of chunk ``chunk`` of part ``part`` in this round (PART and AVERAGED)."""
        return PartHead(self.tag, self.group_id, part, chunk)

    def seal_head(self, part: int) -> PartHead:
        """The head of the SEAL of part ``part``: its chunk field counts the chunks."""
        return PartHead(self.tag, self.group_id, part, len(self.chunks[part]))


@dataclass(frozen=True, slots=True)
class Chunk:
    """A member's checked chunk as its reducer keeps it: the decoded values and their norm,
    and the bytes with their sha256 (what the sender's seal covers; evidence in disputes)."""

    values: torch.Tensor
    norm: float
    payload: Buffer
    sha256: bytes


class PartReducer:
    """The reducer side of part ``part`` at this member (docs/design.md "The round"): its own part
    ``plan.index`` by default, or the part of a reducer that failed, which this member
    re-reduces as its substitute (``substitute``; ``allreduce`` "Churn").

    Rules: chunk 0 of a member counts if it arrives valid while the gather is open; the
    gather closes (``close_gather``) once chunk 0 is in from everyone or at the glue's
    deadline, and fixes the counted mask for the whole part. Later chunks count only from
    members whose chunk 0 counted; a chunk already held (sent again on a stream opened
    after a cut) is skipped. A counted member that is excluded or stops sending after the
    gather fails the part (``stopped``), since an average cannot be taken back.
    """

    def __init__(self, plan: RoundPlan, part: int | None = None) -> None:
        self.plan = plan
        self.index = plan.index
        """This member: the one whose own values ``average`` takes."""
        self.part = plan.index if part is None else part
        self.chunks = plan.chunks[self.part]
        self.received: dict[int, list[Chunk]] = {}
        """Valid chunks of every member whose chunk 0 counted, in chunk order."""
        self.excluded: dict[int, str] = {}
        self.mask: tuple[bool, ...] | None = None
        """Members counted in this part; fixed when the gather closes."""
        self.averaged: list[Averaged] = []
        """Averaged chunks (return codec, signed): the bytes every member gets."""
        self.failed: str | None = None
        self.seals: dict[int, bytes] = {}
        """Each counted sender's seal of its chunks (the signature)."""
        self.seal: bytes | None = None
        """This reducer's seal of its averaged part, once every chunk is averaged."""

    @property
    def num_chunks(self) -> int:
        return len(self.chunks)

    @property
    def gather_closed(self) -> bool:
        return self.mask is not None

    @property
    def counted(self) -> list[int]:
        """Counted members in group order (this member included); empty before the gather closed."""
        return [i for i, bit in enumerate(self.mask or ()) if bit]

    def _others(self) -> list[int]:
        return [j for j in range(self.plan.num_members) if j != self.index]

    def counting(self, j: int, c: int) -> bool:
        """Whether chunk ``c`` of member ``j``, if valid, would count as things stand."""
        return j in self.received if c > 0 else not self.gather_closed

    def wants(self, j: int, c: int) -> bool:
        """Whether to check and keep chunk ``c`` of ``j``: not excluded, not held already."""
        return j not in self.excluded and c >= len(self.received.get(j, ()))

    def check_chunk(self, c: int, payload: Buffer) -> Chunk:
        """Decode and validate chunk ``c`` of a contribution to this part (pure).

        Its norm is judged later, against the group's (``exclude_oversized``): this
        member's own norm alone is no reference (a tiny own delta would refuse honest
        chunks and charge their senders).

        Raises:
            ProtocolError: another codec, no decode, a wrong length, non-finite values.
        """
        codec = self.plan.codec
        if payload[:1] != bytes([codec.codec_id]):
            raise ProtocolError(f"codec id {payload[:1].hex()}, expected {codec.codec_id}")
        try:
            values = codec.decode(payload)
        except CodecError as exc:
            raise ProtocolError(f"part does not decode: {exc}") from exc
        a, b = self.chunks[c]
        if values.numel() != b - a:
            raise ProtocolError(f"{values.numel()} values, expected {b - a}")
        norm = chunk_norm(values)
        if not math.isfinite(norm):  # not finite iff a value is not (``chunk_norm``)
            raise ProtocolError("values are not all finite")
        return Chunk(values, norm, payload, hashlib.sha256(payload).digest())

    def add_chunk(self, j: int, c: int, chunk: Chunk) -> bool:
        """Keep a checked chunk; False when it came too late to count (chunk 0 after the
        gather closed)."""
        if c == 0:
            if self.gather_closed:
                return False
            self.received[j] = [chunk]
        else:
            assert len(self.received[j]) == c, "chunks of a member are kept in order"
            self.received[j].append(chunk)
        return True

    def exclude(self, j: int, reason: str) -> bool:
        """Count nothing more from ``j``; False if it was excluded already."""
        if j in self.excluded:
            return False
        self.excluded[j] = reason
        return True

    def gather_complete(self) -> bool:
        """Chunk 0 is in, or a reason not to wait for it, from every other member."""
        return all(j in self.received or j in self.excluded for j in self._others())

    def exclude_oversized(self) -> dict[int, str]:
        """Exclude the members whose chunk 0 norm is over ``max_norm_ratio`` times the
        group's reference (``norms.check_reference`` of the chunk 0 norms held and this
        member's own); return them with why. Called as the gather closes: what arrives
        later no longer counts, and later chunks are bounded by clipping alone."""
        held = [j for j in self.received if j not in self.excluded]
        own = self.plan.chunk_norms[self.part][0]
        reference = check_reference([own, *(self.received[j][0].norm for j in held)])
        oversized = {}
        for j in held:
            try:
                check_norm(self.received[j][0].norm, reference, self.plan.max_norm_ratio)
            except ProtocolError as exc:
                self.exclude(j, str(exc))
                oversized[j] = str(exc)
        return oversized

    def close_gather(self) -> dict[int, str]:
        """Fix who counts; return the members left out, with why."""
        counted = (set(self.received) - set(self.excluded)) | {self.index}
        self.mask = tuple(i in counted for i in range(self.plan.num_members))
        return {
            i: self.excluded.get(i, "nothing sent")
            for i in range(self.plan.num_members)
            if i not in counted
        }

    def chunk_ready(self, c: int) -> bool:
        """Every counted sender delivered chunk ``c`` or was excluded (then it ``stopped``)."""
        return all(
            len(self.received[i]) > c or i in self.excluded for i in self.counted if i != self.index
        )

    def stopped(self, c: int) -> list[int]:
        """Counted senders without a valid chunk ``c``: the part cannot be averaged."""
        return [
            i
            for i in self.counted
            if i != self.index and (i in self.excluded or len(self.received[i]) <= c)
        ]

    def fail(self, reason: str) -> None:
        self.failed = reason

    def average(self, c: int, own: torch.Tensor) -> tuple[Averaged, torch.Tensor, list[int]]:
        """Chunk ``c`` combined over the counted members (``own`` is this member's values;
        ``aggregation.robust_mean``: weights capped and norms clipped at the lower medians,
        FP32 weighted mean in group order), encoded once with the return codec, as an
        unsigned AVERAGED with the norms it was combined by; the decoded values this member
        uses itself; the counted members that clipping scaled down (pure)."""
        assert self.mask is not None
        norms = [0.0] * self.plan.num_members
        values = []
        for i in self.counted:
            chunk = None if i == self.index else self.received[i][c]
            values.append(own if chunk is None else chunk.values)
            norms[i] = chunk_norm(own) if chunk is None else chunk.norm
        weights = [self.plan.weights[i] for i in self.counted]
        counted_norms = [norms[i] for i in self.counted]
        combined = robust_mean(values, weights, self.plan.clip_factor, counted_norms)
        encoded = self.plan.return_codec.encode(combined.mean)
        msg = Averaged(
            self.plan.head(self.part, c), self.mask, tuple(norms), block_norms(own), encoded
        )
        clipped = [self.counted[k] for k in combined.clipped]
        return msg, self.plan.return_codec.decode(encoded), clipped

    def release(self, c: int) -> None:
        """Drop the decoded values of chunk ``c`` once it is averaged; its bytes stay."""
        for chunks in self.received.values():
            if len(chunks) > c:
                chunks[c] = dataclasses.replace(chunks[c], values=_RELEASED)

    def add_average(self, c: int, msg: Averaged) -> None:
        assert len(self.averaged) == c, "averaged chunks are produced in order"
        self.averaged.append(msg)

    def hashes(self, j: int) -> list[bytes]:
        """The sha256 of each chunk held from member ``j``, in chunk order."""
        return [chunk.sha256 for chunk in self.received.get(j, ())]

    def averaged_ready(self, c: int) -> bool:
        """Averaged chunk ``c`` can be sent, or never will be (the part failed)."""
        return len(self.averaged) > c or self.failed is not None

    def digest(self) -> bytes:
        """This part as members compare it (``part_digest``), once every chunk is averaged."""
        assert len(self.averaged) == self.num_chunks
        return part_digest([msg.prefix() + bytes(msg.payload) for msg in self.averaged])
