"""Message bodies of state transfer (docs/design.md "Healing and joining"); framed as in ``wire``.

Body layouts (``digest`` is the 16-byte run digest; integers big-endian)::

    STATE_REQ digest | count u16 | count x fragment u32   (count 0: every fragment)
    STATE_HDR digest | global step u64 | count u16 | count x (fragment u32 | version u64
              | numel u64 | sha256 (32))
    STATE_DAT raw little-endian float32 values: params then momentum of one fragment
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

from diloco.protocol.wire.frames import SHA256_BYTES, Buffer, require
from diloco.protocol.wire.run_id import DIGEST_BYTES

_U16 = struct.Struct("!H")
_U32 = struct.Struct("!I")
_STATE_HDR_HEAD = struct.Struct(f"!{DIGEST_BYTES}sQH")
_STATE_ENTRY = struct.Struct(f"!IQQ{SHA256_BYTES}s")


@dataclass(frozen=True, slots=True)
class StateRequest:
    """Ask a donor for the outer state of ``fragments`` (empty: all of them)."""

    digest: bytes
    fragments: tuple[int, ...] = ()

    def check(self) -> None:
        require(len(self.digest) == DIGEST_BYTES, "run digest length")
        require(len(self.fragments) < 2**16, "too many fragments")
        require(len(set(self.fragments)) == len(self.fragments), "duplicate fragments")
        for p in self.fragments:
            require(0 <= p < 2**32, f"fragment {p}")

    def serialize(self) -> bytes:
        self.check()
        return (
            self.digest
            + _U16.pack(len(self.fragments))
            + b"".join(_U32.pack(p) for p in self.fragments)
        )

    @classmethod
    def parse(cls, body: Buffer) -> StateRequest:
        require(len(body) >= DIGEST_BYTES + _U16.size, "STATE_REQ length")
        (count,) = _U16.unpack_from(body, DIGEST_BYTES)
        start = DIGEST_BYTES + _U16.size
        require(len(body) == start + count * _U32.size, "STATE_REQ length")
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
        require(len(self.digest) == DIGEST_BYTES, "run digest length")
        require(0 <= self.global_step < 2**63, "global step range")
        require(len(self.entries) < 2**16, "too many fragments")
        require(len({e.fragment for e in self.entries}) == len(self.entries), "duplicates")
        for e in self.entries:
            require(0 <= e.fragment < 2**32 and 0 <= e.version < 2**63, "entry range")
            require(0 <= e.numel < 2**40 and len(e.sha256) == SHA256_BYTES, "entry size")

    def serialize(self) -> bytes:
        self.check()
        head = _STATE_HDR_HEAD.pack(self.digest, self.global_step, len(self.entries))
        return head + b"".join(
            _STATE_ENTRY.pack(e.fragment, e.version, e.numel, e.sha256) for e in self.entries
        )

    @classmethod
    def parse(cls, body: Buffer) -> StateHeader:
        require(len(body) >= _STATE_HDR_HEAD.size, "STATE_HDR length")
        digest, step, count = _STATE_HDR_HEAD.unpack_from(body)
        require(len(body) == _STATE_HDR_HEAD.size + count * _STATE_ENTRY.size, "STATE_HDR size")
        entries = tuple(
            StateEntry(
                *_STATE_ENTRY.unpack_from(body, _STATE_HDR_HEAD.size + i * _STATE_ENTRY.size)
            )
            for i in range(count)
        )
        msg = cls(digest, step, entries)
        msg.check()
        return msg
