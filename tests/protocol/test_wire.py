"""Framing and message validation: round trips, and every malformed input refused."""

from __future__ import annotations

import asyncio
import struct

import pytest

from diloco.errors import ProtocolError
from diloco.protocol import wire
from diloco.protocol.wire import (
    ByteCounter,
    Group,
    Join,
    Kind,
    PartHead,
    Reject,
    RejectCode,
    Report,
    RoundTag,
    StateEntry,
    StateHeader,
    StateRequest,
)

TAG = RoundTag(bytes(range(16)), 3, 9)
GID = b"g" * 16


def test_join_round_trip() -> None:
    msg = Join(TAG, 1_000, 4, 4, 2.5)
    assert Join.parse(msg.serialize()) == msg


@pytest.mark.parametrize("weight", [0.0, -1.0, float("nan"), float("inf")])
def test_join_bad_weight_rejected(weight: float) -> None:
    body = struct.pack("!16sIIQBBd", TAG.digest, 3, 9, 10, 0, 0, weight)
    with pytest.raises(ProtocolError, match="weight"):
        Join.parse(body)


def test_group_round_trip_and_truncation() -> None:
    msg = Group(TAG, GID, 10, 0, 0, (b"peer-a", b"peer-b"), (1.0, 3.0))
    body = msg.serialize()
    assert Group.parse(body) == msg
    with pytest.raises(ProtocolError):
        Group.parse(body[:-1])
    with pytest.raises(ProtocolError, match="trailing"):
        Group.parse(body + b"x")


def test_group_duplicate_members_rejected() -> None:
    with pytest.raises(ProtocolError, match="duplicate"):
        Group(TAG, GID, 10, 0, 0, (b"a", b"a"), (1.0, 1.0)).serialize()


def test_reject_round_trip_and_unknown_code() -> None:
    msg = Reject(RejectCode.NOT_LEADER, b"peer", "ask the other one")
    assert Reject.parse(msg.serialize()) == msg
    with pytest.raises(ProtocolError, match="reject code"):
        Reject.parse(bytes([200, 0, 0]))


def test_part_head_round_trip() -> None:
    head = PartHead(TAG, GID, 7)
    raw = head.serialize()
    assert len(raw) == PartHead.SIZE and PartHead.parse(raw) == head


def test_report_round_trip_and_padding_bits_rejected() -> None:
    msg = Report(TAG, GID, (True, False, True), bytes(32))
    body = msg.serialize()
    assert Report.parse(body) == msg
    tampered = bytearray(body)
    tampered[42] |= 0x80  # a padding bit of the 3-member mask (after tag, group id, count)
    with pytest.raises(ProtocolError, match="padding"):
        Report.parse(bytes(tampered))


def test_state_messages_round_trip() -> None:
    request = StateRequest(TAG.digest, (0, 5))
    assert StateRequest.parse(request.serialize()) == request
    header = StateHeader(TAG.digest, 77, (StateEntry(0, 3, 10, bytes(32)),))
    assert StateHeader.parse(header.serialize()) == header
    with pytest.raises(ProtocolError, match="duplicate"):
        StateRequest(TAG.digest, (1, 1)).serialize()


def test_mask_round_trip() -> None:
    bits = tuple(i % 3 == 0 for i in range(19))
    assert wire.unpack_mask(wire.pack_mask(bits), 19) == bits


class _Sink:
    """An asyncio.StreamWriter stand-in that feeds a StreamReader (same process)."""

    def __init__(self, reader: asyncio.StreamReader) -> None:
        self.reader = reader

    def write(self, data: bytes | memoryview) -> None:
        self.reader.feed_data(bytes(data))

    async def drain(self) -> None:
        return None


def test_frame_round_trip_counts_bytes() -> None:
    async def main() -> None:
        reader = asyncio.StreamReader()
        sent, received = ByteCounter(), ByteCounter()
        body = bytes(range(256)) * 9000  # over one chunk
        await wire.write_frame(_Sink(reader), Kind.PART, body[:10], body[10:], counter=sent)  # type: ignore[arg-type]
        kind, got = await wire.read_frame(reader, (Kind.PART,), len(body), received)
        assert (kind, got) == (Kind.PART, body)
        assert sent.sent == received.received == wire.FRAME_HEADER.size + len(body)

    asyncio.run(main())


@pytest.mark.parametrize(
    ("header", "match"),
    [
        (wire.FRAME_HEADER.pack(b"XX", 1, 1, 0), "magic"),
        (wire.FRAME_HEADER.pack(b"DL", 9, 1, 0), "version"),
        (wire.FRAME_HEADER.pack(b"DL", 1, 99, 0), "kind"),
        (wire.FRAME_HEADER.pack(b"DL", 1, Kind.GROUP, 0), "unexpected"),
        (wire.FRAME_HEADER.pack(b"DL", 1, Kind.JOIN, 1 << 40), "bytes"),
    ],
)
def test_read_frame_bad_header_rejected_before_body(header: bytes, match: str) -> None:
    async def main() -> None:
        reader = asyncio.StreamReader()
        reader.feed_data(header)  # no body: the check must not wait for one
        with pytest.raises(ProtocolError, match=match):
            await wire.read_frame(reader, (Kind.JOIN,))

    asyncio.run(main())
