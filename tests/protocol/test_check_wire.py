"""Bodies of the verification phase: round trips, layouts, malformed input refused."""

from __future__ import annotations

import struct

import pytest

from diloco.errors import ProtocolError
from diloco.protocol.wire.check import (
    MAX_SAMPLES,
    CheckEntry,
    CheckRequest,
    CheckResponse,
    Evidence,
    EvidenceRequest,
    Seal,
)
from diloco.protocol.wire.frames import RoundTag
from diloco.protocol.wire.part import PartHead

TAG = RoundTag(bytes(range(16)), 3, 9)
GID = b"g" * 16
HEAD = TAG.digest + struct.pack("!II", 3, 9) + GID


def test_check_request_layout_and_round_trip() -> None:
    msg = CheckRequest(TAG, GID, ((0, (1, 7)), (2, (4,))))
    body = msg.serialize()
    assert body == HEAD + struct.pack("!HHHIIHHI", 2, 0, 2, 1, 7, 2, 1, 4)
    assert CheckRequest.parse(body) == msg
    assert len(body) <= CheckRequest.max_size(3)


@pytest.mark.parametrize(
    ("parts", "match"),
    [
        ((), "part count"),
        (((0, (1,)), (0, (2,))), "parts not sorted"),
        (((2, (1,)), (0, (2,))), "parts not sorted"),
        (((0, ()),), "0 blocks"),
        (((0, tuple(range(MAX_SAMPLES + 1))),), f"{MAX_SAMPLES + 1} blocks"),
        (((0, (5, 3)),), "not sorted"),
        (((0, (3, 3)),), "not sorted"),
        (((300, (1,)),), "part 300"),
    ],
)
def test_check_request_invalid_refused(parts: tuple, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        CheckRequest(TAG, GID, parts).serialize()


def test_check_request_truncated_or_trailing_refused() -> None:
    body = CheckRequest(TAG, GID, ((0, (1, 7)),)).serialize()
    with pytest.raises(ProtocolError, match="truncated"):
        CheckRequest.parse(body[:-1])
    with pytest.raises(ProtocolError, match="trailing"):
        CheckRequest.parse(body + b"\0")


def _response() -> CheckResponse:
    entries = (CheckEntry(1, (0, 3), (0.5, 2.0)), CheckEntry(2, (9,), (1.0,)))
    return CheckResponse(TAG, GID, entries, b"\x04payload", bytes(range(64)))


def test_check_response_layout_round_trip_and_size() -> None:
    msg = _response()
    body = msg.serialize()
    entries = struct.pack("!HHIII2d", 1, 2, 0, 3, 2, 0.5, 2.0) + struct.pack(
        "!HHII1d", 2, 1, 9, 1, 1.0
    )
    payload = struct.pack("!I", 8) + b"\x04payload"
    assert body == HEAD + struct.pack("!H", 2) + entries + payload + bytes(range(64))
    assert CheckResponse.parse(body) == msg
    sizes = [CheckEntry.size(2, 2), CheckEntry.size(1, 1)]
    assert len(body) == CheckResponse.size(sizes, 8)
    other = CheckResponse(TAG, GID, msg.entries[:1], msg.payload, msg.signature)
    assert msg.digest() != other.digest()


@pytest.mark.parametrize("cut", [1, 64, 70])
def test_check_response_truncated_refused(cut: int) -> None:
    with pytest.raises(ProtocolError):
        CheckResponse.parse(_response().serialize()[:-cut])


def test_check_response_negative_norm_or_wrong_payload_length_refused() -> None:
    entry = CheckEntry(1, (0,), (-1.0,))
    with pytest.raises(ProtocolError, match="norms"):
        CheckResponse(TAG, GID, (entry,), b"", bytes(64)).serialize()
    body = bytearray(_response().serialize())
    body[-64 - 8 - 1] += 1  # the payload length, one too many
    with pytest.raises(ProtocolError, match="payload length"):
        CheckResponse.parse(bytes(body))


def test_evidence_request_layout_round_trip_and_refusals() -> None:
    msg = EvidenceRequest(TAG, GID, 2, ((0, 1), (3, 0)))
    body = msg.serialize()
    assert body == HEAD + struct.pack("!HHHIHI", 2, 2, 0, 1, 3, 0)
    assert EvidenceRequest.parse(body) == msg
    with pytest.raises(ProtocolError, match="length"):
        EvidenceRequest.parse(body[:-1])
    with pytest.raises(ProtocolError, match="duplicate"):
        EvidenceRequest(TAG, GID, 2, ((0, 1), (0, 1))).serialize()


def test_evidence_layout_and_parse_keeps_the_payload_in_place() -> None:
    hashes = (b"a" * 32, b"b" * 32)
    msg = Evidence(3, 1, b"s" * 64, hashes, b"\x04payload")
    body = msg.prefix() + b"\x04payload"
    assert body == struct.pack("!HI", 3, 1) + b"s" * 64 + struct.pack("!I", 2) + b"a" * 32 + (
        b"b" * 32 + b"\x04payload"
    )
    assert len(body) == Evidence.size(2, len(b"\x04payload"))
    parsed = Evidence.parse(bytearray(body))
    assert (parsed.member, parsed.chunk, parsed.signature, parsed.hashes) == (
        3,
        1,
        b"s" * 64,
        hashes,
    )
    assert isinstance(parsed.payload, memoryview) and bytes(parsed.payload) == b"\x04payload"
    with pytest.raises(ProtocolError, match="EVIDENCE length"):
        Evidence.parse(body[:70])
    with pytest.raises(ProtocolError, match="hashes truncated"):
        Evidence.parse(body[:100])


def test_seal_layout_and_round_trip() -> None:
    seal = Seal(PartHead(TAG, GID, 2, 7), bytes(range(64)))
    body = seal.serialize()
    assert body == PartHead(TAG, GID, 2, 7).serialize() + bytes(range(64))
    assert len(body) == Seal.SIZE and Seal.parse(body) == seal
    with pytest.raises(ProtocolError, match="SEAL length"):
        Seal.parse(body[:-1])
