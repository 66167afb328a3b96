"""Random drop with rescaling: layout, exact kept values, unbiasedness, malformed payloads."""

from __future__ import annotations

import struct

import pytest
import torch

from diloco.codecs import CodecError, codec_for_payload, get_codec
from diloco.codecs.drop import DEFAULT_DROP_KEEP, DropCodec


def _vector(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def test_drop_encoded_size_is_prefix_plus_kept_fp32() -> None:
    codec = DropCodec(keep=0.25)
    for n, k in ((1, 1), (3, 1), (4, 1), (10, 2), (1000, 250)):
        assert codec.kept(n) == k
        assert codec.encoded_size(n) == 5 + 12 + 4 * k
    assert codec.encoded_size(0) == 5


def test_drop_default_keep_matches_e3m0_bit_budget() -> None:
    n = 2**20
    bits = 8 * get_codec("drop").encoded_size(n) / n
    e3m0_bits = 8 * get_codec("e3m0").encoded_size(n) / n
    assert DEFAULT_DROP_KEEP == 4.25 / 32
    assert bits == pytest.approx(e3m0_bits, rel=1e-3)


def test_drop_layout_seed_count_and_rescaled_values() -> None:
    codec = DropCodec(keep=0.1)
    x = _vector(200)
    payload = codec.encode(x, generator=torch.Generator().manual_seed(7))
    seed, n = struct.unpack_from("<QI", payload, 5)
    assert payload[0] == 5 and n == 200
    k = 20
    positions = torch.randperm(200, generator=torch.Generator().manual_seed(seed))[:k].sort()
    values = torch.frombuffer(bytearray(payload[17:]), dtype=torch.float32)
    assert torch.equal(values, x[positions.values] * 10.0)
    decoded = codec.decode(payload)
    expected = torch.zeros(200)
    expected[positions.values] = x[positions.values] * 10.0
    assert torch.equal(decoded, expected)
    assert int((decoded != 0).sum()) == k


def test_drop_is_unbiased_over_seeds() -> None:
    codec = DropCodec(keep=0.25)
    x = _vector(64)
    generator = torch.Generator().manual_seed(0)
    trials = 4000
    mean = sum(codec.decode(codec.encode(x, generator)) for _ in range(trials)) / trials
    # Each value is x * 4 with probability 1/4: std of the mean is |x| * sqrt(3) / sqrt(trials).
    assert torch.allclose(mean, x, atol=5 * 3**0.5 / trials**0.5 * float(x.abs().max()))


def test_drop_without_generator_is_a_pure_function_of_the_input() -> None:
    codec = DropCodec()
    x = _vector(500)
    assert codec.encode(x) == codec.encode(x.clone())
    other = x.clone()
    other[0] += 1.0
    assert codec.encode(other)[5:13] != codec.encode(x)[5:13]  # another seed


def test_drop_decoder_with_another_keep_raises() -> None:
    payload = DropCodec(keep=0.5).encode(_vector(100))
    with pytest.raises(CodecError, match="must be"):
        DropCodec(keep=0.25).decode(payload)


def test_drop_body_count_differing_from_header_raises() -> None:
    payload = bytearray(DropCodec(keep=0.5).encode(_vector(100)))
    payload[13:17] = struct.pack("<I", 99)
    with pytest.raises(CodecError, match="body is for 99 values"):
        DropCodec(keep=0.5).decode(bytes(payload))


def test_drop_seed_out_of_range_raises() -> None:
    payload = bytearray(DropCodec(keep=0.5).encode(_vector(100)))
    payload[5:13] = struct.pack("<Q", 2**64 - 1)
    with pytest.raises(CodecError, match="seed"):
        DropCodec(keep=0.5).decode(bytes(payload))


@pytest.mark.parametrize("keep", [0.0, -0.1, 1.5, float("nan")])
def test_drop_keep_out_of_range_raises(keep: float) -> None:
    with pytest.raises(CodecError, match="keep fraction must be in"):
        get_codec("drop", keep=keep)


def test_drop_rescaled_overflow_raises() -> None:
    x = torch.full((10,), 3e38)
    with pytest.raises(CodecError, match="overflows"):
        DropCodec(keep=0.1).encode(x)


def test_drop_keep_one_is_exact() -> None:
    x = _vector(300)
    codec = DropCodec(keep=1.0)
    assert torch.equal(codec.decode(codec.encode(x)), x)


def test_drop_payload_found_by_id() -> None:
    payload = get_codec("drop").encode(_vector(1000))
    assert isinstance(codec_for_payload(payload), DropCodec)
