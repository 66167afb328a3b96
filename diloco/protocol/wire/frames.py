"""Frame and message formats of every stream of the protocol; no I/O (``streams`` does it).

Our streams carry opaque codec bytes, so they use p2pd binary streams with this framing
(not hivemind's protobuf enum of compression types). Every frame::

    magic b"DL" (2) | protocol version (uint8) | kind (uint8) | body length (uint64) | body

All integers are big-endian (``!``). ``Frame.parse`` checks magic, version and kind,
so a reader checks the body length against its limit *before* it reads the body: an
oversize or unexpected frame costs the receiver nothing. Each body kind is a frozen
dataclass with ``parse``/``serialize``/``check`` (websockets' ``frames.py`` shape);
``check`` runs on both paths and raises ``ProtocolError``.

Body layouts (``digest`` is the 16-byte run digest, ``gid`` the 16-byte group id)::

    JOIN      digest | fragment u32 | round u32 | numel u64 | codec u8 | return codec u8
              | weight f64 | client u8 (1: takes no reducer part)
    GROUP     digest | fragment u32 | round u32 | gid | numel u64 | codec u8 | return codec u8
              | count u16 | count x (peer id length u16 | peer id | weight f64)
              | clients mask (members that reduce no part)
    REJECT    code u8 | peer id length u16 | peer id (a redirect, may be empty) | utf-8 reason
    PART      digest | fragment u32 | round u32 | gid | part u16 | chunk u32 | codec payload
    AVERAGED  digest | fragment u32 | round u32 | gid | part u16 | chunk u32 | mask length u16
              | counted mask | mask length x norm f64 | block count u32 | block count x
              block norm f32 | codec payload
              (a part travels as consecutive chunks, each encoded on its own, so that a
              reducer averages and returns chunk c while chunk c + 1 is still arriving)
    REPORT    digest | fragment u32 | round u32 | gid | mask length u16 | parts mask
              | result sha256 (32)
    ACK       (empty)
    AUTH      HMAC-SHA256 proof (32) of a closed swarm's key (``swarm_key``)
    RUN_INFO  msgpack [run id, config JSON, creator signature] (``discovery``)

An AVERAGED chunk's norms are every member's chunk norm as its reducer clipped by it (0: not
counted), its block norms those of the reducer's own contribution over each ``PART_ALIGN``
values (``verification``). After its last PART, and its last AVERAGED, chunk a part is
sealed (SEAL, signed once per part).

The bodies of PART (its prefix), AVERAGED and REPORT are in ``part_wire``; those of STATE_REQ,
STATE_HDR and STATE_DAT in ``state_wire``; those of SEAL,
CHECK_REQ, CHECK_RES, EVIDENCE_REQ and EVIDENCE in ``check_wire``.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum

from diloco.errors import ProtocolError
from diloco.protocol.wire.run_id import DIGEST_BYTES

MAGIC = b"DL"
PROTOCOL_VERSION = 1
FRAME_HEADER = struct.Struct("!2sBBQ")
GROUP_ID_BYTES = 16
SHA256_BYTES = 32
SIGNATURE_BYTES = 64
"""An Ed25519 signature (``identity``)."""
MAX_GROUP_SIZE = 256
MAX_PEER_ID_BYTES = 128
MAX_REASON_BYTES = 1024
MAX_SMALL_BODY = 64 * 1024  # every control message (JOIN, GROUP, REJECT, REPORT...) fits

Buffer = bytes | bytearray | memoryview

_ROUND = struct.Struct(f"!{DIGEST_BYTES}sII")
_JOIN = struct.Struct(f"!{DIGEST_BYTES}sIIQBBdB")
_GROUP_HEAD = struct.Struct(f"!{DIGEST_BYTES}sII{GROUP_ID_BYTES}sQBBH")
_U16 = struct.Struct("!H")
_F64 = struct.Struct("!d")
_REJECT_HEAD = struct.Struct("!BH")


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
    CHECK_REQ = 11
    CHECK_RES = 12
    EVIDENCE_REQ = 13
    EVIDENCE = 14
    SEAL = 15
    AUTH = 20
    RUN_INFO = 21


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
    BANNED = 11
    BUSY = 12
    """Over a server's caps (``limits``): try another peer, or later."""
    LEFT_ROUND = 13
    """This node skipped the round's send step (it caught up with the swarm's step): it is
    not in the round; its followers turn to the next in line."""


@dataclass
class ByteCounter:
    """Bytes this process wrote to and read from protocol streams (frames included)."""

    sent: int = 0
    received: int = 0


@dataclass(frozen=True, slots=True)
class Frame:
    """A frame header; the body travels after it and is read separately."""

    kind: Kind
    body_len: int

    SIZE = FRAME_HEADER.size

    def check(self) -> None:
        require(0 <= self.body_len < 2**64, "body length range")

    def serialize(self) -> bytes:
        self.check()
        return FRAME_HEADER.pack(MAGIC, PROTOCOL_VERSION, self.kind, self.body_len)

    @classmethod
    def parse(cls, raw: Buffer) -> Frame:
        """Check magic, version and kind; the caller checks ``body_len`` against its limit."""
        require(len(raw) == FRAME_HEADER.size, "frame header length")
        magic, version, kind, body_len = FRAME_HEADER.unpack(raw)
        require(magic == MAGIC, "bad frame magic")
        require(
            version == PROTOCOL_VERSION, f"protocol version {version}, expected {PROTOCOL_VERSION}"
        )
        require(kind in Kind._value2member_map_, f"unknown frame kind {kind}")
        msg = cls(Kind(kind), body_len)
        msg.check()
        return msg


@dataclass(frozen=True, slots=True)
class RoundTag:
    """Run digest, fragment and round: the address every round message starts with."""

    digest: bytes
    fragment: int
    round: int

    def check(self) -> None:
        require(len(self.digest) == DIGEST_BYTES, "run digest length")
        require(0 <= self.fragment < 2**32 and 0 <= self.round < 2**32, "fragment/round range")


@dataclass(frozen=True, slots=True)
class Join:
    """A follower asks a leader to admit it to round ``tag``."""

    tag: RoundTag
    numel: int
    codec_id: int
    return_codec_id: int
    weight: float
    client: bool = False
    """The follower reduces no part (it cannot be dialled, or it is demoted)."""

    def check(self) -> None:
        self.tag.check()
        require(0 <= self.numel < 2**63, "numel range")
        require(0 <= self.codec_id < 256 and 0 <= self.return_codec_id < 256, "codec id range")
        require(math.isfinite(self.weight) and self.weight > 0, f"weight {self.weight!r}")
        require(isinstance(self.client, bool), "client flag")

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
            int(self.client),
        )

    @classmethod
    def parse(cls, body: Buffer) -> Join:
        require(len(body) == _JOIN.size, "JOIN length")
        digest, frag, rnd, numel, codec, ret, weight, client = _JOIN.unpack(body)
        require(client in (0, 1), "JOIN client flag")
        msg = cls(RoundTag(digest, frag, rnd), numel, codec, ret, weight, bool(client))
        msg.check()
        return msg


@dataclass(frozen=True, slots=True)
class Group:
    """The leader's final member list for a round, in group order, with weights and the
    members that reduce no part (``clients``; empty: none)."""

    tag: RoundTag
    group_id: bytes
    numel: int
    codec_id: int
    return_codec_id: int
    members: tuple[bytes, ...]
    weights: tuple[float, ...]
    clients: tuple[bool, ...] = ()

    def __post_init__(self) -> None:
        if not self.clients:  # one spelling of "no clients", so parse(serialize(m)) == m
            object.__setattr__(self, "clients", (False,) * len(self.members))

    def check(self) -> None:
        self.tag.check()
        require(len(self.group_id) == GROUP_ID_BYTES, "group id length")
        require(0 <= self.numel < 2**63, "numel range")
        require(0 <= self.codec_id < 256 and 0 <= self.return_codec_id < 256, "codec id range")
        require(0 < len(self.members) <= MAX_GROUP_SIZE, f"group of {len(self.members)}")
        require(len(self.weights) == len(self.members), "one weight per member")
        require(len(set(self.members)) == len(self.members), "duplicate members")
        for peer in self.members:
            require(0 < len(peer) <= MAX_PEER_ID_BYTES, "peer id length")
        for w in self.weights:
            require(math.isfinite(w) and w > 0, f"weight {w!r}")
        require(len(self.clients) == len(self.members), "one client flag per member")
        require(not all(self.clients), "a group without a reducer")

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
        out.append(pack_mask(self.clients))
        return b"".join(out)

    @classmethod
    def parse(cls, body: Buffer) -> Group:
        require(len(body) >= _GROUP_HEAD.size, "GROUP length")
        digest, frag, rnd, gid, numel, codec, ret, count = _GROUP_HEAD.unpack_from(body)
        offset = _GROUP_HEAD.size
        members, weights = [], []
        try:
            for _ in range(count):
                (size,) = _U16.unpack_from(body, offset)
                offset += _U16.size
                require(offset + size <= len(body), "GROUP peer id truncated")
                members.append(bytes(body[offset : offset + size]))
                offset += size
                (weight,) = _F64.unpack_from(body, offset)
                weights.append(weight)
                offset += _F64.size
        except struct.error as exc:
            raise ProtocolError("GROUP truncated") from exc
        clients = unpack_mask(body[offset:], count)
        msg = cls(
            RoundTag(digest, frag, rnd),
            gid,
            numel,
            codec,
            ret,
            tuple(members),
            tuple(weights),
            clients,
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
        require(len(self.redirect) <= MAX_PEER_ID_BYTES, "redirect length")
        require(len(self.reason.encode()) <= MAX_REASON_BYTES, "reason length")

    def serialize(self) -> bytes:
        self.check()
        return (
            _REJECT_HEAD.pack(self.code, len(self.redirect)) + self.redirect + self.reason.encode()
        )

    @classmethod
    def parse(cls, body: Buffer) -> Reject:
        require(len(body) >= _REJECT_HEAD.size, "REJECT length")
        code, size = _REJECT_HEAD.unpack_from(body)
        require(code in RejectCode._value2member_map_, f"reject code {code}")
        start = _REJECT_HEAD.size
        require(start + size <= len(body), "REJECT redirect truncated")
        try:
            reason = bytes(body[start + size :]).decode()
        except UnicodeDecodeError as exc:
            raise ProtocolError("REJECT reason is not utf-8") from exc
        msg = cls(RejectCode(code), bytes(body[start : start + size]), reason)
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
    require(len(data) == mask_bytes(num_members), "mask length")
    bits = tuple(bool(data[i // 8] >> (i % 8) & 1) for i in range(num_members))
    require(pack_mask(bits) == bytes(data), "mask padding bits")
    return bits


def require(condition: bool, what: str) -> None:
    """Raise ``ProtocolError(what)`` unless ``condition``: every body's checks."""
    if not condition:
        raise ProtocolError(what)
