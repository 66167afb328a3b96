"""Raw FP32 and the 16-bit casts: sizes, golden bytes, error bounds, overflow."""

from __future__ import annotations

import struct

import pytest
import torch

from diloco.codecs import CodecError, get_codec


def _wide_range(n: int, low_exp: float, high_exp: float, seed: int = 0) -> torch.Tensor:
    """Values whose magnitudes spread log-uniformly over ``2**low_exp .. 2**high_exp``."""
    g = torch.Generator().manual_seed(seed)
    exponents = torch.empty(n, dtype=torch.float64).uniform_(low_exp, high_exp, generator=g)
    signs = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    return (signs * torch.exp2(exponents)).float()


@pytest.mark.parametrize(("name", "bytes_per_value"), [("none", 4), ("bf16", 2), ("fp16", 2)])
def test_cast_encoded_size(name: str, bytes_per_value: int) -> None:
    for n in (0, 1, 7, 1000):
        assert get_codec(name).encoded_size(n) == 5 + bytes_per_value * n


def test_none_golden_bytes() -> None:
    payload = get_codec("none").encode(torch.tensor([1.0, -2.5, 0.0]))
    assert payload == bytes.fromhex("00 03000000 0000803f 000020c0 00000000")


def test_bf16_golden_bytes() -> None:
    # 1.0 = 0x3f80; -2.5 = 0xc020; 1 + 2**-8 is a tie between 1 and 1 + 2**-7: even, 0x3f80.
    payload = get_codec("bf16").encode(torch.tensor([1.0, -2.5, 1.0 + 2**-8]))
    assert payload == bytes.fromhex("01 03000000 803f 20c0 803f")


def test_fp16_golden_bytes() -> None:
    # 1.0 = 0x3c00; -2.5 = 0xc100; 65504 (largest finite) = 0x7bff; 2**-24 (subnormal) = 0x0001.
    payload = get_codec("fp16").encode(torch.tensor([1.0, -2.5, 65504.0, 2.0**-24]))
    assert payload == bytes.fromhex("02 04000000 003c 00c1 ff7b 0100")


def test_none_round_trip_is_bit_exact() -> None:
    x = torch.cat([_wide_range(10_000, -149, 127.9), torch.tensor([0.0, -0.0])])
    out = get_codec("none").decode(get_codec("none").encode(x))
    assert torch.equal(out.view(torch.int32), x.view(torch.int32))


def test_bf16_round_trip_error_bound() -> None:
    """|err| <= 2**-8 |x| for |x| >= 2**-126, <= 2**-134 below (bf16 subnormals)."""
    x = _wide_range(20_000, -145, 127.9)
    out = get_codec("bf16").decode(get_codec("bf16").encode(x))
    err = (out.double() - x.double()).abs()
    bound = torch.maximum(x.double().abs() * 2**-8, torch.full_like(err, 2.0**-134))
    assert bool((err <= bound).all())
    assert float((err / bound).max()) > 0.9  # the bound is tight, not loose by a mile


def test_fp16_round_trip_error_bound() -> None:
    """|err| <= 2**-11 |x| for |x| >= 2**-14, <= 2**-25 below (fp16 subnormals)."""
    x = _wide_range(20_000, -30, 15.99)
    out = get_codec("fp16").decode(get_codec("fp16").encode(x))
    err = (out.double() - x.double()).abs()
    bound = torch.maximum(x.double().abs() * 2**-11, torch.full_like(err, 2.0**-25))
    assert bool((err <= bound).all())
    assert float((err / bound).max()) > 0.9


@pytest.mark.parametrize("value", [65520.0, -65520.0, 1e5, 3e38])
def test_fp16_overflow_raises(value: float) -> None:
    with pytest.raises(CodecError, match="overflows fp16"):
        get_codec("fp16").encode(torch.tensor([1.0, value]))


def test_fp16_largest_values_below_overflow_encode() -> None:
    x = torch.tensor([65504.0, -65519.99])  # both round to the largest finite binary16
    expected = torch.tensor([65504.0, -65504.0])
    assert torch.equal(get_codec("fp16").decode(get_codec("fp16").encode(x)), expected)


def test_bf16_overflow_raises() -> None:
    largest = struct.unpack("<f", bytes.fromhex("ffff7f7f"))[0]  # FP32 max rounds to inf
    with pytest.raises(CodecError, match="overflows bf16"):
        get_codec("bf16").encode(torch.tensor([largest]))


@pytest.mark.parametrize("name", ["none", "bf16", "fp16"])
def test_cast_part_encodes_to_slice_of_whole(name: str) -> None:
    codec = get_codec(name)
    x = _wide_range(1000, -10, 10)
    width = (codec.encoded_size(1000) - 5) // 1000
    whole = codec.encode(x)
    for lo, hi in [(0, 256), (256, 768), (768, 1000)]:
        assert codec.encode(x[lo:hi])[5:] == whole[5 + width * lo : 5 + width * hi]
