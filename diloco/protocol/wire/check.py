"""Message bodies of the verification phase (``verification``); framed as in ``wire``.

Body layouts (``tag`` is digest | fragment u32 | round u32 and ``gid`` the 16-byte group id,
as in ``wire``; integers and norms big-endian)::

    SEAL          tag | gid | part u16 | chunk count u32 | signature (64)
                  (after the last PART chunk, and the last AVERAGED chunk, of a part)
    CHECK_REQ     tag | gid | count u16 | count x (part u16 | blocks u16 | blocks x block u32)
    CHECK_RES     tag | gid | count u16 | count x (part u16 | blocks u16 | blocks x block u32
                  | chunks u32 | chunks x norm f64) | length u32 | codec payload
                  | signature (64)
    EVIDENCE_REQ  tag | gid | part u16 | count u16 | count x (member u16 | chunk u32)
    EVIDENCE      member u16 | chunk u32 | seal signature (64) | count u32
                  | count x chunk sha256 (32) | codec payload
                  (one frame per item asked, in the order asked)

A SEAL signs a whole part once (``signatures``): a sender's, the sha256 of each of its
chunks; a reducer's, its part's digest (what REPORTs compare). A block is ``PART_ALIGN``
values of a part counted from the part's start. A CHECK_REQ asks
about parts in ascending order; a CHECK_RES entry repeats the blocks asked, so that the
signed answer says what it answers, with the answering member's norm over every chunk of
the part; its payload (of the run's codec, or of ``none``) decodes to exactly its values at
all those blocks, one after the other, as their reducers decoded them. The signature is
Ed25519 by the answering member over ``signing_input("diloco-check/1", sha256(body before
the signature))``; EVIDENCE carries the SEAL of the chunk's sender and the hashes it sealed,
so that the chunk can be checked alone.
"""

from __future__ import annotations

import hashlib
import math
import struct
from dataclasses import dataclass

from diloco.errors import ProtocolError
from diloco.protocol.wire.frames import (
    GROUP_ID_BYTES,
    MAX_GROUP_SIZE,
    SIGNATURE_BYTES,
    Buffer,
    RoundTag,
    require,
)
from diloco.protocol.wire.part import PartHead
from diloco.protocol.wire.run_id import DIGEST_BYTES

MAX_SAMPLES = 64
"""Blocks a member may ask about in one part: bounds the work one CHECK_REQ causes."""

_HEAD = struct.Struct(f"!{DIGEST_BYTES}sII{GROUP_ID_BYTES}sH")
_PART_BLOCKS = struct.Struct("!HH")
_U32 = struct.Struct("!I")
_EVIDENCE_REQ_HEAD = struct.Struct(f"!{DIGEST_BYTES}sII{GROUP_ID_BYTES}sHH")
_ITEM = struct.Struct("!HI")


@dataclass(frozen=True, slots=True)
class Seal:
    """A signature of a whole part, sent after its last chunk; ``head.chunk`` is the part's
    number of chunks."""

    head: PartHead
    signature: bytes

    SIZE = PartHead.SIZE + SIGNATURE_BYTES

    def serialize(self) -> bytes:
        require(len(self.signature) == SIGNATURE_BYTES, "signature length")
        return self.head.serialize() + self.signature

    @classmethod
    def parse(cls, body: Buffer) -> Seal:
        require(len(body) == cls.SIZE, "SEAL length")
        return cls(PartHead.parse(body[: PartHead.SIZE]), bytes(body[PartHead.SIZE :]))


@dataclass(frozen=True, slots=True)
class CheckRequest:
    """Ask a member for its contribution at ``blocks`` of each ``part`` (and its norms)."""

    tag: RoundTag
    group_id: bytes
    parts: tuple[tuple[int, tuple[int, ...]], ...]
    """(part, sorted distinct blocks) pairs, parts distinct."""

    def check(self) -> None:
        self.tag.check()
        require(len(self.group_id) == GROUP_ID_BYTES, "group id length")
        require(0 < len(self.parts) <= MAX_GROUP_SIZE, "part count")
        parts = [part for part, _ in self.parts]
        require(parts == sorted(set(parts)), "parts not sorted and distinct")
        for part, blocks in self.parts:
            require(0 <= part < MAX_GROUP_SIZE, f"part {part}")
            require(0 < len(blocks) <= MAX_SAMPLES, f"{len(blocks)} blocks")
            require(list(blocks) == sorted(set(blocks)), "blocks not sorted and distinct")
            require(0 <= blocks[0] and blocks[-1] < 2**32, "block index range")

    @staticmethod
    def max_size(num_members: int) -> int:
        """The largest CHECK_REQ body a group of ``num_members`` can need."""
        return _HEAD.size + num_members * (_PART_BLOCKS.size + 4 * MAX_SAMPLES)

    def serialize(self) -> bytes:
        self.check()
        t = self.tag
        out = [_HEAD.pack(t.digest, t.fragment, t.round, self.group_id, len(self.parts))]
        for part, blocks in self.parts:
            out += [_PART_BLOCKS.pack(part, len(blocks)), _u32s(blocks)]
        return b"".join(out)

    @classmethod
    def parse(cls, body: Buffer) -> CheckRequest:
        try:
            digest, frag, rnd, gid, count = _HEAD.unpack_from(body)
            offset, parts = _HEAD.size, []
            for _ in range(count):
                part, num = _PART_BLOCKS.unpack_from(body, offset)
                blocks = struct.unpack_from(f"!{num}I", body, offset + _PART_BLOCKS.size)
                parts.append((part, blocks))
                offset += _PART_BLOCKS.size + 4 * num
        except struct.error as exc:
            raise ProtocolError("CHECK_REQ truncated") from exc
        require(offset == len(body), "CHECK_REQ trailing bytes")
        msg = cls(RoundTag(digest, frag, rnd), gid, tuple(parts))
        msg.check()
        return msg


@dataclass(frozen=True, slots=True)
class CheckEntry:
    """A member's answer for one part: the blocks asked and its norm of every chunk."""

    part: int
    blocks: tuple[int, ...]
    norms: tuple[float, ...]

    def check(self) -> None:
        require(0 <= self.part < MAX_GROUP_SIZE, f"part {self.part}")
        require(0 < len(self.blocks) <= MAX_SAMPLES, f"{len(self.blocks)} blocks")
        require(len(self.norms) < 2**32, "norm count")
        require(all(math.isfinite(n) and n >= 0 for n in self.norms), "norms")

    @staticmethod
    def size(num_blocks: int, num_chunks: int) -> int:
        return _PART_BLOCKS.size + 4 * num_blocks + 4 + 8 * num_chunks


@dataclass(frozen=True, slots=True)
class CheckResponse:
    """A member's signed answer to a CHECK_REQ: one entry per part asked, and the values
    at all their blocks in one codec payload."""

    tag: RoundTag
    group_id: bytes
    entries: tuple[CheckEntry, ...]
    payload: bytes
    signature: bytes

    @staticmethod
    def size(entry_sizes: list[int], payload_bytes: int) -> int:
        """Body length for entries of these ``CheckEntry.size``s and a payload of at most
        ``payload_bytes``: a bound known before reading."""
        return _HEAD.size + sum(entry_sizes) + _U32.size + payload_bytes + SIGNATURE_BYTES

    def unsigned(self) -> bytes:
        """The body before the signature."""
        self.tag.check()
        require(len(self.group_id) == GROUP_ID_BYTES, "group id length")
        require(0 < len(self.entries) <= MAX_GROUP_SIZE, "entry count")
        t = self.tag
        out = [_HEAD.pack(t.digest, t.fragment, t.round, self.group_id, len(self.entries))]
        for entry in self.entries:
            entry.check()
            out += [
                _PART_BLOCKS.pack(entry.part, len(entry.blocks)),
                _u32s(entry.blocks),
                _U32.pack(len(entry.norms)),
                struct.pack(f"!{len(entry.norms)}d", *entry.norms),
            ]
        require(len(self.payload) < 2**32, "payload length")
        return b"".join([*out, _U32.pack(len(self.payload)), self.payload])

    def digest(self) -> bytes:
        """sha256 of the body before the signature (what the member signs)."""
        return hashlib.sha256(self.unsigned()).digest()

    def serialize(self) -> bytes:
        require(len(self.signature) == SIGNATURE_BYTES, "signature length")
        return self.unsigned() + self.signature

    @classmethod
    def parse(cls, body: Buffer) -> CheckResponse:
        require(len(body) >= _HEAD.size + SIGNATURE_BYTES, "CHECK_RES length")
        end = len(body) - SIGNATURE_BYTES
        try:
            digest, frag, rnd, gid, count = _HEAD.unpack_from(body)
            offset, entries = _HEAD.size, []
            for _ in range(count):
                part, num = _PART_BLOCKS.unpack_from(body, offset)
                offset += _PART_BLOCKS.size
                blocks = struct.unpack_from(f"!{num}I", body, offset)
                offset += 4 * num
                (chunks,) = _U32.unpack_from(body, offset)
                norms = struct.unpack_from(f"!{chunks}d", body, offset + 4)
                offset += 4 + 8 * chunks
                entries.append(CheckEntry(part, blocks, norms))
            (length,) = _U32.unpack_from(body, offset)
            offset += 4
        except struct.error as exc:
            raise ProtocolError("CHECK_RES truncated") from exc
        require(offset + length == end, "CHECK_RES payload length")
        payload = bytes(body[offset:end])
        msg = cls(RoundTag(digest, frag, rnd), gid, tuple(entries), payload, bytes(body[end:]))
        msg.unsigned()  # runs every check
        return msg


@dataclass(frozen=True, slots=True)
class EvidenceRequest:
    """Ask the reducer of ``part`` for the signed PART chunks ``(member, chunk)`` it counted."""

    tag: RoundTag
    group_id: bytes
    part: int
    items: tuple[tuple[int, int], ...]

    def check(self) -> None:
        self.tag.check()
        require(len(self.group_id) == GROUP_ID_BYTES, "group id length")
        require(0 <= self.part < MAX_GROUP_SIZE, f"part {self.part}")
        require(0 < len(self.items) < 2**16, "item count")
        require(len(set(self.items)) == len(self.items), "duplicate items")
        for member, chunk in self.items:
            require(0 <= member < MAX_GROUP_SIZE and 0 <= chunk < 2**32, "item range")

    def serialize(self) -> bytes:
        self.check()
        t = self.tag
        head = _EVIDENCE_REQ_HEAD.pack(
            t.digest, t.fragment, t.round, self.group_id, self.part, len(self.items)
        )
        return head + b"".join(_ITEM.pack(member, chunk) for member, chunk in self.items)

    @classmethod
    def parse(cls, body: Buffer) -> EvidenceRequest:
        require(len(body) >= _EVIDENCE_REQ_HEAD.size, "EVIDENCE_REQ length")
        digest, frag, rnd, gid, part, count = _EVIDENCE_REQ_HEAD.unpack_from(body)
        require(len(body) == _EVIDENCE_REQ_HEAD.size + count * _ITEM.size, "EVIDENCE_REQ length")
        items = tuple(
            _ITEM.unpack_from(body, _EVIDENCE_REQ_HEAD.size + i * _ITEM.size) for i in range(count)
        )
        msg = cls(RoundTag(digest, frag, rnd), gid, part, items)
        msg.check()
        return msg


@dataclass(frozen=True, slots=True)
class Evidence:
    """One PART chunk a reducer counted: its sender's index, the chunk, the sender's SEAL
    signature with the chunk hashes it sealed, and the payload."""

    member: int
    chunk: int
    signature: bytes
    hashes: tuple[bytes, ...]
    payload: Buffer

    @staticmethod
    def size(num_chunks: int, payload_bytes: int) -> int:
        """Body length for a part of ``num_chunks`` chunks, known before reading."""
        return _ITEM.size + SIGNATURE_BYTES + _U32.size + 32 * num_chunks + payload_bytes

    def prefix(self) -> bytes:
        require(len(self.signature) == SIGNATURE_BYTES, "signature length")
        require(all(len(h) == 32 for h in self.hashes), "hash length")
        count = _U32.pack(len(self.hashes))
        return _ITEM.pack(self.member, self.chunk) + self.signature + count + b"".join(self.hashes)

    @classmethod
    def parse(cls, body: Buffer) -> Evidence:
        """Parse without copying the payload (a view into ``body``)."""
        start = _ITEM.size + SIGNATURE_BYTES + _U32.size
        require(len(body) >= start, "EVIDENCE length")
        member, chunk = _ITEM.unpack_from(body)
        signature = bytes(body[_ITEM.size : _ITEM.size + SIGNATURE_BYTES])
        (count,) = _U32.unpack_from(body, start - _U32.size)
        require(len(body) >= start + 32 * count, "EVIDENCE hashes truncated")
        hashes = tuple(bytes(body[start + 32 * k : start + 32 * (k + 1)]) for k in range(count))
        return cls(member, chunk, signature, hashes, memoryview(body)[start + 32 * count :])


def _u32s(values: tuple[int, ...]) -> bytes:
    return struct.pack(f"!{len(values)}I", *values)
