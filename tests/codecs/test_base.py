"""Header layout and the checks every codec inherits from ``Codec`` (encode input, decode
framing), run against every registered codec."""

from __future__ import annotations

import math
import struct

import pytest
import torch

from diloco.codecs import CODEC_NAMES, Codec, CodecError, CodecId, Header, get_codec
from diloco.codecs.base import HEADER_BYTES, MAX_NUMEL, check_input

SIZES = [0, 1, 2, 31, 32, 33, 63, 64, 65, 255, 256, 257, 1000]


@pytest.fixture(params=CODEC_NAMES)
def codec(request: pytest.FixtureRequest) -> Codec:
    return get_codec(request.param)


def _vector(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def test_header_serialize_is_id_then_uint32_le_count() -> None:
    assert Header(CodecId.E3M0, 0x01020304).serialize() == bytes([4, 4, 3, 2, 1])
    assert HEADER_BYTES == 5


def test_header_parse_round_trips_and_ignores_the_body() -> None:
    header = Header(CodecId.INT8, MAX_NUMEL)
    assert Header.parse(header.serialize() + b"body") == header


@pytest.mark.parametrize("data", [b"", b"\x00", b"\x00\x01\x00\x00"])
def test_header_parse_short_payload_raises_chained(data: bytes) -> None:
    with pytest.raises(CodecError, match="shorter than the 5-byte header") as info:
        Header.parse(data)
    assert isinstance(info.value.__cause__, struct.error)


def test_header_parse_unknown_id_raises_listing_valid_ids() -> None:
    with pytest.raises(CodecError, match=r"unknown codec id 7; valid ids: 0 \(none\)"):
        Header.parse(bytes([7, 0, 0, 0, 0]))


@pytest.mark.parametrize("numel", [-1, MAX_NUMEL + 1])
def test_header_check_count_out_of_range_raises(numel: int) -> None:
    with pytest.raises(CodecError, match="does not fit in uint32"):
        Header(CodecId.NONE, numel).serialize()


@pytest.mark.parametrize(
    "bad",
    [
        [1.0, 2.0],
        torch.zeros(4, dtype=torch.float64),
        torch.zeros(4, dtype=torch.bfloat16),
        torch.zeros(2, 2),
        torch.zeros(()),
    ],
)
def test_check_input_wrong_type_dtype_or_shape_raises(bad: object) -> None:
    with pytest.raises(CodecError, match="expected"):
        check_input(bad)


def test_encode_size_and_header_match_encoded_size(codec: Codec) -> None:
    for n in SIZES:
        payload = codec.encode(_vector(n))
        assert len(payload) == codec.encoded_size(n)
        assert Header.parse(payload) == Header(codec.codec_id, n)


def test_encode_empty_is_header_only_and_decodes_empty(codec: Codec) -> None:
    payload = codec.encode(torch.empty(0))
    assert payload == bytes([codec.codec_id, 0, 0, 0, 0])
    out = codec.decode(payload)
    assert out.dtype == torch.float32 and out.shape == (0,)


def test_block_size_divides_256(codec: Codec) -> None:
    assert 256 % codec.block_size == 0


def test_encode_strided_or_grad_input_equals_contiguous(codec: Codec) -> None:
    x = _vector(300)
    leaf = x.clone().requires_grad_(True)
    assert codec.encode(x[::3]) == codec.encode(x[::3].clone())
    assert codec.encode(leaf) == codec.encode(x)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("where", [0, 40, 99])
def test_encode_non_finite_raises(codec: Codec, bad: float, where: int) -> None:
    x = _vector(100)
    x[where] = bad
    with pytest.raises(CodecError, match="NaN or Inf"):
        codec.encode(x)


def test_decode_returns_fresh_writable_float32(codec: Codec) -> None:
    payload = codec.encode(_vector(70))
    first, second = codec.decode(payload), codec.decode(payload)
    assert first.dtype == torch.float32 and first.shape == (70,) and first.is_contiguous()
    first.add_(1.0)  # would fail or warn on a read-only view of the payload
    assert torch.equal(second, codec.decode(payload))
    assert not torch.equal(first, second)


def test_decode_accepts_bytearray_and_memoryview(codec: Codec) -> None:
    payload = codec.encode(_vector(70))
    expected = codec.decode(payload)
    assert torch.equal(codec.decode(bytearray(payload)), expected)
    assert torch.equal(codec.decode(memoryview(payload)), expected)


@pytest.mark.parametrize("data", [b"", b"\x00\x00"])
def test_decode_too_short_raises(codec: Codec, data: bytes) -> None:
    with pytest.raises(CodecError, match="shorter than the 5-byte header"):
        codec.decode(data)


@pytest.mark.parametrize("n", [1, 33, 70])
def test_decode_truncated_or_over_long_raises(codec: Codec, n: int) -> None:
    payload = codec.encode(_vector(n))
    for bad in (payload[:-1], payload[:HEADER_BYTES], payload + b"\x00"):
        with pytest.raises(CodecError, match=f"must be {len(payload)} bytes"):
            codec.decode(bad)


def test_decode_count_larger_than_body_raises(codec: Codec) -> None:
    payload = bytearray(codec.encode(_vector(64)))
    payload[1:5] = struct.pack("<I", 65)
    with pytest.raises(CodecError, match="must be"):
        codec.decode(bytes(payload))


def test_decode_payload_of_another_codec_raises(codec: Codec) -> None:
    for other in CODEC_NAMES:
        if other != codec.name:
            with pytest.raises(CodecError, match=f"codec '{other}' handed to the '{codec.name}'"):
                codec.decode(get_codec(other).encode(_vector(64)))


@pytest.mark.parametrize("bad_id", [7, 127, 255])
def test_decode_unknown_id_raises(codec: Codec, bad_id: int) -> None:
    payload = bytes([bad_id]) + codec.encode(_vector(64))[1:]
    with pytest.raises(CodecError, match=f"unknown codec id {bad_id}"):
        codec.decode(payload)


def test_encoded_size_negative_raises(codec: Codec) -> None:
    with pytest.raises(CodecError):
        codec.encoded_size(-1)


@pytest.mark.parametrize("n", [0, 1, 33, 1000, 1 << 16])
def test_decoded_norm_is_the_fp64_norm_of_the_decoded_values(codec: Codec, n: int) -> None:
    data = codec.encode(_vector(n, seed=n) * 1e-3)
    exact = math.sqrt(sum(v * v for v in codec.decode(data).double().tolist()))
    assert codec.decoded_norm(data) == pytest.approx(exact, rel=1e-12, abs=0.0)


def test_decoded_norm_checks_the_payload_like_decode(codec: Codec) -> None:
    data = codec.encode(_vector(40))
    with pytest.raises(CodecError, match="must be"):
        codec.decoded_norm(data[:-1])
    with pytest.raises(CodecError, match="handed to"):
        codec.decoded_norm(bytes([(data[0] + 1) % 5]) + data[1:])
