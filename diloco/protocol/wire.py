"""Message framing and validation for every stream of the protocol.

Our streams carry opaque codec bytes, so they use p2pd binary streams with this framing
(not hivemind's protobuf enum of compression types). Every frame::

    magic b"DL" (2) | protocol version (uint8) | kind (uint8) | body length (uint64) | body

All integers are big-endian (``!``). A reader checks magic, version, kind and the body
length against the caller's limit *before* it reads the body, so an oversize or unexpected
frame costs the receiver nothing. Bodies are written in ``CHUNK_BYTES`` pieces with a drain
after each, which streams large parts with bounded buffering. Each body kind is a frozen
dataclass with ``parse``/``serialize``/``check`` (websockets' ``frames.py`` shape);
``check`` runs on both paths and raises ``ProtocolError``.

Body layouts (``digest`` is the 16-byte run digest, ``gid`` the 16-byte group id)::

    JOIN      digest | fragment u32 | round u32 | numel u64 | codec u8 | return codec u8
              | weight f64
    GROUP     digest | fragment u32 | round u32 | gid | numel u64 | codec u8 | return codec u8
              | count u16 | count x (peer id length u16 | peer id | weight f64)
    REJECT    code u8 | peer id length u16 | peer id (a redirect, may be empty) | utf-8 reason
    PART      digest | fragment u32 | round u32 | gid | part u16 | chunk u32 | codec payload
    AVERAGED  digest | fragment u32 | round u32 | gid | part u16 | chunk u32 | mask length u16
              | counted mask | codec payload
              (a part travels as consecutive chunks, each encoded on its own, so that a
              reducer averages and returns chunk c while chunk c + 1 is still arriving)
    REPORT    digest | fragment u32 | round u32 | gid | mask length u16 | parts mask
              | result sha256 (32)
    ACK       (empty)
    STATE_REQ digest | count u16 | count x fragment u32   (count 0: every fragment)
    STATE_HDR digest | global step u64 | count u16 | count x (fragment u32 | version u64
              | numel u64 | sha256 (32))
    STATE_DAT raw little-endian float32 values: params then momentum of one fragment
"""

from __future__ import annotations

import asyncio
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum

from diloco.errors import ProtocolError
from diloco.protocol.run_id import DIGEST_BYTES

MAGIC = b"DL"
PROTOCOL_VERSION = 1
FRAME_HEADER = struct.Struct("!2sBBQ")
CHUNK_BYTES = 1 << 20
GROUP_ID_BYTES = 16
SHA256_BYTES = 32
MAX_GROUP_SIZE = 256
MAX_PEER_ID_BYTES = 128
MAX_REASON_BYTES = 1024
MAX_SMALL_BODY = 64 * 1024  # every control message (JOIN, GROUP, REJECT, REPORT...) fits

Buffer = bytes | bytearray | memoryview

_ROUND = struct.Struct(f"!{DIGEST_BYTES}sII")
_ROUND_GROUP = struct.Struct(f"!{DIGEST_BYTES}sII{GROUP_ID_BYTES}s")
_JOIN = struct.Struct(f"!{DIGEST_BYTES}sIIQBBd")
_GROUP_HEAD = struct.Struct(f"!{DIGEST_BYTES}sII{GROUP_ID_BYTES}sQBBH")
_U16 = struct.Struct("!H")
_U32 = struct.Struct("!I")
_F64 = struct.Struct("!d")
_REJECT_HEAD = struct.Struct("!BH")
_STATE_HDR_HEAD = struct.Struct(f"!{DIGEST_BYTES}sQH")
_STATE_ENTRY = struct.Struct(f"!IQQ{SHA256_BYTES}s")


class Kind(IntEnum):
    """Frame kinds; the value is the kind byte."""

    JOIN = 1
    GROUP = 2
    REJECT = 3
    PART = 4
    AVERAGED = 5
    REPORT = 6
    ACK = 7
    STATE_REQ = 8
    STATE_HDR = 9
    STATE_DAT = 10


class RejectCode(IntEnum):
    """Why a request was refused; answered instead of raising (hivemind ``DHTProtocol``)."""

    WRONG_RUN = 1
    UNKNOWN_ROUND = 2
    NOT_LEADER = 3
    GROUP_CLOSED = 4
    MISMATCH = 5
    NOT_MEMBER = 6
    BAD_PART = 7
    GROUP_TOO_SMALL = 8
    NO_STATE = 9
    MALFORMED = 10


@dataclass
class ByteCounter:
    """Bytes this process wrote to and read from protocol streams (frames included)."""

    sent: int = 0
    received: int = 0


@dataclass(frozen=True, slots=True)
class Frame:
    """A frame header as read from a stream; the body is read separately."""

    kind: Kind
    body_len: int


@dataclass(frozen=True, slots=True)
class RoundTag:
    """Run digest, fragment and round: the address every round message starts with."""

    digest: bytes
    fragment: int
    round: int

    def check(self) -> None:
        _require(len(self.digest) == DIGEST_BYTES, "run digest length")
        _require(0 <= self.fragment < 2**32 and 0 <= self.round < 2**32, "fragment/round range")


@dataclass(frozen=True, slots=True)
class Join:
    """A follower asks a leader to admit it to round ``tag``."""

    tag: RoundTag
    numel: int
    codec_id: int
    return_codec_id: int
    weight: float

    def check(self) -> None:
        self.tag.check()
        _require(0 <= self.numel < 2**63, "numel range")
        _require(0 <= self.codec_id < 256 and 0 <= self.return_codec_id < 256, "codec id range")
        _require(math.isfinite(self.weight) and self.weight > 0, f"weight {self.weight!r}")

    def serialize(self) -> bytes:
        self.check()
        t = self.tag
        return _JOIN.pack(
            t.digest,
            t.fragment,
            t.round,
            self.numel,
            self.codec_id,
            self.return_codec_id,
            self.weight,
        )

    @classmethod
    def parse(cls, body: Buffer) -> Join:
        _require(len(body) == _JOIN.size, "JOIN length")
        digest, frag, rnd, numel, codec, ret, weight = _JOIN.unpack(body)
        msg = cls(RoundTag(digest, frag, rnd), numel, codec, ret, weight)
        msg.check()
        return msg


@dataclass(frozen=True, slots=True)
class Group:
    """The leader's final member list for a round, in group order, with weights."""

    tag: RoundTag
    group_id: bytes
    numel: int
    codec_id: int
    return_codec_id: int
    members: tuple[bytes, ...]
    weights: tuple[float, ...]

    def check(self) -> None:
        self.tag.check()
        _require(len(self.group_id) == GROUP_ID_BYTES, "group id length")
        _require(0 <= self.numel < 2**63, "numel range")
        _require(0 <= self.codec_id < 256 and 0 <= self.return_codec_id < 256, "codec id range")
        _require(0 < len(self.members) <= MAX_GROUP_SIZE, f"group of {len(self.members)}")
        _require(len(self.weights) == len(self.members), "one weight per member")
        _require(len(set(self.members)) == len(self.members), "duplicate members")
        for peer in self.members:
            _require(0 < len(peer) <= MAX_PEER_ID_BYTES, "peer id length")
        for w in self.weights:
            _require(math.isfinite(w) and w > 0, f"weight {w!r}")

    def serialize(self) -> bytes:
        self.check()
        t = self.tag
        out = [
            _GROUP_HEAD.pack(
                t.digest,
                t.fragment,
                t.round,
                self.group_id,
                self.numel,
                self.codec_id,
                self.return_codec_id,
                len(self.members),
            )
        ]
        for peer, weight in zip(self.members, self.weights, strict=True):
            out += [_U16.pack(len(peer)), peer, _F64.pack(weight)]
        return b"".join(out)

    @classmethod
    def parse(cls, body: Buffer) -> Group:
        _require(len(body) >= _GROUP_HEAD.size, "GROUP length")
        digest, frag, rnd, gid, numel, codec, ret, count = _GROUP_HEAD.unpack_from(body)
        offset = _GROUP_HEAD.size
        members, weights = [], []
        try:
            for _ in range(count):
                (size,) = _U16.unpack_from(body, offset)
                offset += _U16.size
                _require(offset + size <= len(body), "GROUP peer id truncated")
                members.append(bytes(body[offset : offset + size]))
                offset += size
                (weight,) = _F64.unpack_from(body, offset)
                weights.append(weight)
                offset += _F64.size
        except struct.error as exc:
            raise ProtocolError("GROUP truncated") from exc
        _require(offset == len(body), "GROUP trailing bytes")
        msg = cls(
            RoundTag(digest, frag, rnd), gid, numel, codec, ret, tuple(members), tuple(weights)
        )
        msg.check()
        return msg


@dataclass(frozen=True, slots=True)
class Reject:
    """A refusal with a code, an optional redirect peer and a human reason."""

    code: RejectCode
    redirect: bytes = b""
    reason: str = ""

    def check(self) -> None:
        _require(len(self.redirect) <= MAX_PEER_ID_BYTES, "redirect length")
        _require(len(self.reason.encode()) <= MAX_REASON_BYTES, "reason length")

    def serialize(self) -> bytes:
        self.check()
        return (
            _REJECT_HEAD.pack(self.code, len(self.redirect)) + self.redirect + self.reason.encode()
        )

    @classmethod
    def parse(cls, body: Buffer) -> Reject:
        _require(len(body) >= _REJECT_HEAD.size, "REJECT length")
        code, size = _REJECT_HEAD.unpack_from(body)
        _require(code in RejectCode._value2member_map_, f"reject code {code}")
        start = _REJECT_HEAD.size
        _require(start + size <= len(body), "REJECT redirect truncated")
        try:
            reason = bytes(body[start + size :]).decode()
        except UnicodeDecodeError as exc:
            raise ProtocolError("REJECT reason is not utf-8") from exc
        msg = cls(RejectCode(code), bytes(body[start : start + size]), reason)
        msg.check()
        return msg


@dataclass(frozen=True, slots=True)
class PartHead:
    """Prefix of PART and AVERAGED bodies: which round, group, part and chunk follows."""

    tag: RoundTag
    group_id: bytes
    part: int
    chunk: int = 0

    SIZE = _ROUND_GROUP.size + _U16.size + _U32.size

    def check(self) -> None:
        self.tag.check()
        _require(len(self.group_id) == GROUP_ID_BYTES, "group id length")
        _require(0 <= self.part < MAX_GROUP_SIZE, f"part index {self.part}")
        _require(0 <= self.chunk < 2**32, f"chunk index {self.chunk}")

    def serialize(self) -> bytes:
        self.check()
        t = self.tag
        return (
            _ROUND_GROUP.pack(t.digest, t.fragment, t.round, self.group_id)
            + _U16.pack(self.part)
            + _U32.pack(self.chunk)
        )

    @classmethod
    def parse(cls, body: Buffer) -> PartHead:
        _require(len(body) >= cls.SIZE, "part prefix length")
        digest, frag, rnd, gid = _ROUND_GROUP.unpack_from(body)
        (part,) = _U16.unpack_from(body, _ROUND_GROUP.size)
        (chunk,) = _U32.unpack_from(body, _ROUND_GROUP.size + _U16.size)
        msg = cls(RoundTag(digest, frag, rnd), gid, part, chunk)
        msg.check()
        return msg


def mask_bytes(num_members: int) -> int:
    """Bytes of a bit mask over ``num_members`` members (bit i of byte i // 8)."""
    return (num_members + 7) // 8


def pack_mask(bits: Sequence[bool]) -> bytes:
    out = bytearray(mask_bytes(len(bits)))
    for i, bit in enumerate(bits):
        if bit:
            out[i // 8] |= 1 << (i % 8)
    return bytes(out)


def unpack_mask(data: Buffer, num_members: int) -> tuple[bool, ...]:
    """Inverse of ``pack_mask``; padding bits must be zero.

    Raises:
        ProtocolError: for a wrong length or set padding bits.
    """
    _require(len(data) == mask_bytes(num_members), "mask length")
    bits = tuple(bool(data[i // 8] >> (i % 8) & 1) for i in range(num_members))
    _require(pack_mask(bits) == bytes(data), "mask padding bits")
    return bits


@dataclass(frozen=True, slots=True)
class Report:
    """A member's view after the gather phase: which parts it holds, and their sha256."""

    tag: RoundTag
    group_id: bytes
    parts: tuple[bool, ...]
    digest: bytes

    def check(self) -> None:
        self.tag.check()
        _require(len(self.group_id) == GROUP_ID_BYTES, "group id length")
        _require(0 < len(self.parts) <= MAX_GROUP_SIZE, "parts mask size")
        _require(len(self.digest) == SHA256_BYTES, "result digest length")

    def serialize(self) -> bytes:
        self.check()
        t = self.tag
        mask = pack_mask(self.parts)
        return (
            _ROUND_GROUP.pack(t.digest, t.fragment, t.round, self.group_id)
            + _U16.pack(len(self.parts))
            + mask
            + self.digest
        )

    @classmethod
    def parse(cls, body: Buffer) -> Report:
        _require(len(body) >= _ROUND_GROUP.size + _U16.size, "REPORT length")
        digest, frag, rnd, gid = _ROUND_GROUP.unpack_from(body)
        (count,) = _U16.unpack_from(body, _ROUND_GROUP.size)
        start = _ROUND_GROUP.size + _U16.size
        size = mask_bytes(count)
        _require(len(body) == start + size + SHA256_BYTES, "REPORT length")
        _require(0 < count <= MAX_GROUP_SIZE, "parts mask size")
        parts = unpack_mask(bytes(body[start : start + size]), count)
        msg = cls(RoundTag(digest, frag, rnd), gid, parts, bytes(body[start + size :]))
        msg.check()
        return msg


@dataclass(frozen=True, slots=True)
class StateRequest:
    """Ask a donor for the outer state of ``fragments`` (empty: all of them)."""

    digest: bytes
    fragments: tuple[int, ...] = ()

    def check(self) -> None:
        _require(len(self.digest) == DIGEST_BYTES, "run digest length")
        _require(len(self.fragments) < 2**16, "too many fragments")
        _require(len(set(self.fragments)) == len(self.fragments), "duplicate fragments")
        for p in self.fragments:
            _require(0 <= p < 2**32, f"fragment {p}")

    def serialize(self) -> bytes:
        self.check()
        return (
            self.digest
            + _U16.pack(len(self.fragments))
            + b"".join(_U32.pack(p) for p in self.fragments)
        )

    @classmethod
    def parse(cls, body: Buffer) -> StateRequest:
        _require(len(body) >= DIGEST_BYTES + _U16.size, "STATE_REQ length")
        (count,) = _U16.unpack_from(body, DIGEST_BYTES)
        start = DIGEST_BYTES + _U16.size
        _require(len(body) == start + count * _U32.size, "STATE_REQ length")
        frags = tuple(_U32.unpack_from(body, start + i * _U32.size)[0] for i in range(count))
        msg = cls(bytes(body[:DIGEST_BYTES]), frags)
        msg.check()
        return msg


@dataclass(frozen=True, slots=True)
class StateEntry:
    """One fragment in a state header: its version, length and sha256 of params+momentum."""

    fragment: int
    version: int
    numel: int
    sha256: bytes


@dataclass(frozen=True, slots=True)
class StateHeader:
    """What a donor is about to send: global step and one entry per fragment, in order."""

    digest: bytes
    global_step: int
    entries: tuple[StateEntry, ...] = field(default_factory=tuple)

    def check(self) -> None:
        _require(len(self.digest) == DIGEST_BYTES, "run digest length")
        _require(0 <= self.global_step < 2**63, "global step range")
        _require(len(self.entries) < 2**16, "too many fragments")
        _require(len({e.fragment for e in self.entries}) == len(self.entries), "duplicates")
        for e in self.entries:
            _require(0 <= e.fragment < 2**32 and 0 <= e.version < 2**63, "entry range")
            _require(0 <= e.numel < 2**40 and len(e.sha256) == SHA256_BYTES, "entry size")

    def serialize(self) -> bytes:
        self.check()
        head = _STATE_HDR_HEAD.pack(self.digest, self.global_step, len(self.entries))
        return head + b"".join(
            _STATE_ENTRY.pack(e.fragment, e.version, e.numel, e.sha256) for e in self.entries
        )

    @classmethod
    def parse(cls, body: Buffer) -> StateHeader:
        _require(len(body) >= _STATE_HDR_HEAD.size, "STATE_HDR length")
        digest, step, count = _STATE_HDR_HEAD.unpack_from(body)
        _require(len(body) == _STATE_HDR_HEAD.size + count * _STATE_ENTRY.size, "STATE_HDR size")
        entries = tuple(
            StateEntry(
                *_STATE_ENTRY.unpack_from(body, _STATE_HDR_HEAD.size + i * _STATE_ENTRY.size)
            )
            for i in range(count)
        )
        msg = cls(digest, step, entries)
        msg.check()
        return msg


async def write_frame(
    writer: asyncio.StreamWriter, kind: Kind, *pieces: bytes, counter: ByteCounter | None = None
) -> None:
    """Write one frame whose body is the concatenation of ``pieces``, in bounded chunks."""
    body_len = sum(len(p) for p in pieces)
    writer.write(FRAME_HEADER.pack(MAGIC, PROTOCOL_VERSION, kind, body_len))
    for piece in pieces:
        view = memoryview(piece)
        for offset in range(0, len(view), CHUNK_BYTES):
            writer.write(view[offset : offset + CHUNK_BYTES])
            await writer.drain()
    await writer.drain()
    if counter is not None:
        counter.sent += FRAME_HEADER.size + body_len


async def read_frame_header(
    reader: asyncio.StreamReader, counter: ByteCounter | None = None
) -> Frame:
    """Read and check one frame header (not the body).

    Raises:
        ProtocolError: for a bad magic, version or kind.
        asyncio.IncompleteReadError: when the peer closed the stream.
    """
    raw = await reader.readexactly(FRAME_HEADER.size)
    if counter is not None:
        counter.received += FRAME_HEADER.size
    magic, version, kind, body_len = FRAME_HEADER.unpack(raw)
    _require(magic == MAGIC, "bad frame magic")
    _require(
        version == PROTOCOL_VERSION, f"protocol version {version}, expected {PROTOCOL_VERSION}"
    )
    _require(kind in Kind._value2member_map_, f"unknown frame kind {kind}")
    return Frame(Kind(kind), body_len)


async def read_body(
    reader: asyncio.StreamReader, size: int, counter: ByteCounter | None = None
) -> bytearray:
    """Read exactly ``size`` body bytes in bounded chunks (the caller checked ``size``)."""
    buffer = bytearray(size)
    view = memoryview(buffer)
    offset = 0
    while offset < size:
        chunk = await reader.readexactly(min(CHUNK_BYTES, size - offset))
        view[offset : offset + len(chunk)] = chunk
        offset += len(chunk)
        if counter is not None:
            counter.received += len(chunk)
    return buffer


async def read_frame(
    reader: asyncio.StreamReader,
    expected: Sequence[Kind],
    max_body: int = MAX_SMALL_BODY,
    counter: ByteCounter | None = None,
) -> tuple[Kind, bytearray]:
    """Read one whole frame of one of the ``expected`` kinds (REJECT is always allowed).

    Raises:
        ProtocolError: for an unexpected kind or a body over ``max_body`` bytes.
        asyncio.IncompleteReadError: when the peer closed the stream.
    """
    frame = await read_frame_header(reader, counter)
    _require(frame.kind in expected or frame.kind == Kind.REJECT, f"unexpected {frame.kind.name}")
    limit = MAX_SMALL_BODY if frame.kind == Kind.REJECT else max_body
    _require(frame.body_len <= limit, f"{frame.kind.name} of {frame.body_len} bytes > {limit}")
    return frame.kind, await read_body(reader, frame.body_len, counter)


def _require(condition: bool, what: str) -> None:
    if not condition:
        raise ProtocolError(what)
