"""Bodies of the data plane: PART and AVERAGED prefixes, AVERAGED and REPORT; framed as in
``wire``, whose docstring gives their layouts."""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

from diloco.protocol.wire.frames import (
    GROUP_ID_BYTES,
    MAX_GROUP_SIZE,
    SHA256_BYTES,
    Buffer,
    RoundTag,
    mask_bytes,
    pack_mask,
    require,
    unpack_mask,
)
from diloco.protocol.wire.run_id import DIGEST_BYTES

_ROUND_GROUP = struct.Struct(f"!{DIGEST_BYTES}sII{GROUP_ID_BYTES}s")
_U16 = struct.Struct("!H")
_U32 = struct.Struct("!I")
_F64 = struct.Struct("!d")


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
        require(len(self.group_id) == GROUP_ID_BYTES, "group id length")
        require(0 <= self.part < MAX_GROUP_SIZE, f"part index {self.part}")
        require(0 <= self.chunk < 2**32, f"chunk index {self.chunk}")

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
        require(len(body) >= cls.SIZE, "part prefix length")
        digest, frag, rnd, gid = _ROUND_GROUP.unpack_from(body)
        (part,) = _U16.unpack_from(body, _ROUND_GROUP.size)
        (chunk,) = _U32.unpack_from(body, _ROUND_GROUP.size + _U16.size)
        msg = cls(RoundTag(digest, frag, rnd), gid, part, chunk)
        msg.check()
        return msg


@dataclass(frozen=True, slots=True)
class Averaged:
    """A reducer's averaged chunk, the mask of members it counted in its part, and the norms
    it combined them by (see the layout above).

    The reducer sends the same bytes to every member; it always counts itself.
    """

    head: PartHead
    mask: tuple[bool, ...]
    norms: tuple[float, ...]
    """Every member's chunk norm as the reducer computed it; 0 for members not counted."""
    block_norms: tuple[float, ...]
    """Norms of the reducer's own contribution over each ``PART_ALIGN`` values of the chunk."""
    payload: Buffer

    def check(self) -> None:
        self.head.check()
        require(0 < len(self.mask) <= MAX_GROUP_SIZE, "counted mask size")
        require(self.head.part < len(self.mask), f"part {self.head.part} outside the mask")
        require(any(self.mask), "counted mask counts nobody")
        require(len(self.norms) == len(self.mask), "one norm per member")
        for norm, counted in zip(self.norms, self.mask, strict=True):
            ok = math.isfinite(norm) and norm >= 0 and (counted or norm == 0)
            require(ok, f"norm {norm!r}")
        require(len(self.block_norms) < 2**32, "block norm count")
        # A finite sum proves every term finite (NaN and inf propagate); then min is exact.
        blocks = self.block_norms
        require(not blocks or (math.isfinite(sum(blocks)) and min(blocks) >= 0), "block norms")

    @staticmethod
    def body_size(num_members: int, num_blocks: int, payload_bytes: int) -> int:
        """Body length of an AVERAGED frame, known before it is read."""
        fixed = PartHead.SIZE + _U16.size + _U32.size
        return fixed + mask_bytes(num_members) + 8 * num_members + 4 * num_blocks + payload_bytes

    def prefix(self) -> bytes:
        """The body up to the payload (sent ahead of it, so the payload is never copied)."""
        self.check()
        return (
            self.head.serialize()
            + _U16.pack(len(self.mask))
            + pack_mask(self.mask)
            + struct.pack(f"!{len(self.norms)}d", *self.norms)
            + _U32.pack(len(self.block_norms))
            + struct.pack(f"!{len(self.block_norms)}f", *self.block_norms)
        )

    def serialize(self) -> bytes:
        return self.prefix() + bytes(self.payload)

    @classmethod
    def parse(cls, body: Buffer) -> Averaged:
        """Parse without copying the payload (a view into ``body``)."""
        offset = PartHead.SIZE + _U16.size
        require(len(body) >= offset, "AVERAGED length")
        head = PartHead.parse(body[: PartHead.SIZE])
        (count,) = _U16.unpack_from(body, PartHead.SIZE)
        require(0 < count <= MAX_GROUP_SIZE, "counted mask size")
        end = offset + mask_bytes(count) + _F64.size * count + _U32.size
        require(len(body) >= end, "AVERAGED mask truncated")
        mask = unpack_mask(body[offset : offset + mask_bytes(count)], count)
        offset += mask_bytes(count)
        norms = struct.unpack_from(f"!{count}d", body, offset)
        (blocks,) = _U32.unpack_from(body, end - _U32.size)
        payload_at = end + 4 * blocks
        require(len(body) >= payload_at, "AVERAGED block norms truncated")
        block_norms = struct.unpack_from(f"!{blocks}f", body, end)
        msg = cls(head, mask, norms, block_norms, memoryview(body)[payload_at:])
        msg.check()
        return msg


@dataclass(frozen=True, slots=True)
class Report:
    """A member's view after the gather phase: which parts it holds, and their sha256."""

    tag: RoundTag
    group_id: bytes
    parts: tuple[bool, ...]
    digest: bytes

    def check(self) -> None:
        self.tag.check()
        require(len(self.group_id) == GROUP_ID_BYTES, "group id length")
        require(0 < len(self.parts) <= MAX_GROUP_SIZE, "parts mask size")
        require(len(self.digest) == SHA256_BYTES, "result digest length")

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
        require(len(body) >= _ROUND_GROUP.size + _U16.size, "REPORT length")
        digest, frag, rnd, gid = _ROUND_GROUP.unpack_from(body)
        (count,) = _U16.unpack_from(body, _ROUND_GROUP.size)
        start = _ROUND_GROUP.size + _U16.size
        size = mask_bytes(count)
        require(len(body) == start + size + SHA256_BYTES, "REPORT length")
        require(0 < count <= MAX_GROUP_SIZE, "parts mask size")
        parts = unpack_mask(bytes(body[start : start + size]), count)
        msg = cls(RoundTag(digest, frag, rnd), gid, parts, bytes(body[start + size :]))
        msg.check()
        return msg
