"""Framing and message validation: round trips, and every malformed input refused."""

from __future__ import annotations

import dataclasses
import struct

import pytest

from diloco.errors import ProtocolError
from diloco.protocol.wire import frames as wire
from diloco.protocol.wire.frames import (
    FRAME_HEADER,
    Frame,
    Group,
    Join,
    Kind,
    Reject,
    RejectCode,
    RoundTag,
)
from diloco.protocol.wire.part import Averaged, PartHead, Report

TAG = RoundTag(bytes(range(16)), 3, 9)
GID = b"g" * 16


def test_join_round_trip() -> None:
    msg = Join(TAG, 1_000, 4, 4, 2.5)
    assert Join.parse(msg.serialize()) == msg


@pytest.mark.parametrize("weight", [0.0, -1.0, float("nan"), float("inf")])
def test_join_bad_weight_rejected(weight: float) -> None:
    body = struct.pack("!16sIIQBBdB", TAG.digest, 3, 9, 10, 0, 0, weight, 0)
    with pytest.raises(ProtocolError, match="weight"):
        Join.parse(body)


def test_group_round_trip_and_truncation() -> None:
    msg = Group(TAG, GID, 10, 0, 0, (b"peer-a", b"peer-b"), (1.0, 3.0))
    body = msg.serialize()
    assert Group.parse(body) == msg
    with pytest.raises(ProtocolError):
        Group.parse(body[:-1])
    with pytest.raises(ProtocolError, match="mask length"):
        Group.parse(body + b"x")


def test_join_client_flag_round_trip_and_bad_flag_rejected() -> None:
    msg = Join(TAG, 1_000, 4, 4, 2.5, client=True)
    body = msg.serialize()
    assert body[-1:] == b"\x01" and Join.parse(body) == msg
    with pytest.raises(ProtocolError, match="client flag"):
        Join.parse(body[:-1] + b"\x02")


def test_group_clients_mask_round_trip() -> None:
    msg = Group(TAG, GID, 10, 0, 0, (b"a", b"b", b"c"), (1.0, 1.0, 1.0), (False, True, False))
    body = msg.serialize()
    assert body[-1:] == bytes([0b010])  # bit i is member i (pack_mask)
    assert Group.parse(body) == msg
    plain = Group(TAG, GID, 10, 0, 0, (b"a", b"b"), (1.0, 1.0))
    assert plain.clients == (False, False) and plain.serialize()[-1:] == b"\x00"


def test_group_without_a_reducer_rejected() -> None:
    with pytest.raises(ProtocolError, match="without a reducer"):
        Group(TAG, GID, 10, 0, 0, (b"a", b"b"), (1.0, 1.0), (True, True)).serialize()


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


def test_mask_round_trip() -> None:
    bits = tuple(i % 3 == 0 for i in range(19))
    assert wire.unpack_mask(wire.pack_mask(bits), 19) == bits


def _averaged(mask: tuple[bool, ...], part: int = 0, payload: bytes = b"") -> Averaged:
    norms = tuple(0.5 * i if bit else 0.0 for i, bit in enumerate(mask))
    return Averaged(PartHead(TAG, GID, part, 5), mask, norms, (0.25, 3.0), payload)


def test_averaged_round_trip_keeps_every_field() -> None:
    msg = _averaged((False, True, True), part=2, payload=b"\x04payload")
    body = msg.serialize()
    assert len(body) == Averaged.body_size(3, 2, len(b"\x04payload"))
    # head | count 3 | mask 0b110 | 3 norms f64 | 2 blocks | 2 block norms f32
    prefix = PartHead(TAG, GID, 2, 5).serialize() + struct.pack(
        "!HB3dI2f", 3, 0b110, 0.0, 0.5, 1.0, 2, 0.25, 3.0
    )
    assert body == prefix + b"\x04payload" and msg.prefix() == prefix
    parsed = Averaged.parse(body)
    assert (parsed.head, parsed.mask, parsed.norms) == (msg.head, msg.mask, msg.norms)
    assert parsed.block_norms == msg.block_norms and bytes(parsed.payload) == msg.payload


def test_averaged_mask_counting_nobody_rejected() -> None:
    # a substitute's re-reduced part need not count the part's own reducer (``reduction.
    # AveragedPart`` checks the one who averaged it is counted)
    assert Averaged.parse(_averaged((False, True)).serialize()).mask == (False, True)
    with pytest.raises(ProtocolError, match="counts nobody"):
        dataclasses.replace(_averaged((False, False)), norms=(0.0, 0.0)).serialize()
    body = bytearray(_averaged((True, False)).serialize())
    body[PartHead.SIZE + 2] = 0b00  # member 0, the only one counted, no longer counted
    with pytest.raises(ProtocolError, match="counts nobody"):
        Averaged.parse(bytes(body))


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"norms": (1.0,)}, "one norm per member"),
        ({"norms": (1.0, float("nan"))}, "norm nan"),
        ({"norms": (1.0, -1.0)}, "norm -1.0"),
        ({"block_norms": (float("inf"),)}, "block norms"),
        ({"block_norms": (1.0, -0.5)}, "block norms"),
        ({"block_norms": (float("nan"), 1.0)}, "block norms"),
    ],
)
def test_averaged_bad_norms_rejected(change: dict[str, object], match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        dataclasses.replace(_averaged((True, True)), **change).serialize()


def test_averaged_uncounted_member_with_a_norm_rejected() -> None:
    msg = dataclasses.replace(_averaged((True, False)), norms=(1.0, 2.0))
    with pytest.raises(ProtocolError, match=r"norm 2\.0"):
        msg.serialize()


def test_averaged_truncated_mask_or_block_norms_rejected() -> None:
    body = PartHead(TAG, GID, 0).serialize() + struct.pack("!H", 9)  # 9 members, no mask
    with pytest.raises(ProtocolError, match="truncated"):
        Averaged.parse(body)
    whole = _averaged((True, True)).serialize()
    with pytest.raises(ProtocolError, match="block norms truncated"):
        Averaged.parse(whole[: len(whole) - 1])


def test_frame_header_round_trip() -> None:
    raw = Frame(Kind.AVERAGED, 123).serialize()
    assert raw == b"DL\x01\x05" + (123).to_bytes(8, "big")
    assert Frame.parse(raw) == Frame(Kind.AVERAGED, 123)


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        (FRAME_HEADER.pack(b"XX", 1, 1, 0), "magic"),
        (FRAME_HEADER.pack(b"DL", 9, 1, 0), "version"),
        (FRAME_HEADER.pack(b"DL", 1, 99, 0), "kind"),
        (FRAME_HEADER.pack(b"DL", 1, 1, 0)[:-1], "length"),
    ],
)
def test_frame_header_malformed_rejected(raw: bytes, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        Frame.parse(raw)
