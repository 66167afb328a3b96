"""Top-k by magnitude: layout, golden bytes, exactly the largest kept, malformed payloads."""

from __future__ import annotations

import struct

import pytest
import torch

from diloco.codecs import CodecError, get_codec
from diloco.codecs.topk import DEFAULT_TOPK_KEEP, TopKCodec


def _vector(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def test_topk_encoded_size_is_count_plus_index_value_pairs() -> None:
    codec = TopKCodec(keep=0.25)
    for n, k in ((1, 1), (4, 1), (5, 2), (8, 2), (1000, 250)):
        assert codec.kept(n) == k
        assert codec.encoded_size(n) == 5 + 4 + 8 * k
    assert codec.encoded_size(0) == 5


def test_topk_default_keep_matches_e3m0_bit_budget() -> None:
    n = 2**20
    bits = 8 * get_codec("topk").encoded_size(n) / n
    e3m0_bits = 8 * get_codec("e3m0").encoded_size(n) / n
    assert DEFAULT_TOPK_KEEP == 4.25 / 64
    assert bits == pytest.approx(e3m0_bits, rel=1e-3)


def test_topk_golden_bytes() -> None:
    x = torch.tensor([0.5, -3.0, 0.25, 2.0, -0.125, 1.0, 0.0, -1.5])
    payload = TopKCodec(keep=0.375).encode(x)  # k = 3: -3.0, 2.0, -1.5
    expected = (
        bytes([6])
        + struct.pack("<I", 8)
        + struct.pack("<I", 8)
        + struct.pack("<3I", 1, 3, 7)
        + struct.pack("<3f", -3.0, 2.0, -1.5)
    )
    assert payload == expected
    assert torch.equal(
        TopKCodec(keep=0.375).decode(payload),
        torch.tensor([0.0, -3.0, 0.0, 2.0, 0.0, 0.0, 0.0, -1.5]),
    )


def test_topk_keeps_exactly_the_largest_magnitudes() -> None:
    x = _vector(1000)
    codec = TopKCodec(keep=0.1)
    decoded = codec.decode(codec.encode(x))
    kept = decoded != 0
    assert int(kept.sum()) == 100
    assert torch.equal(decoded[kept], x[kept])
    assert float(x[~kept].abs().max()) <= float(x[kept].abs().min())


def test_topk_decoder_with_another_keep_raises() -> None:
    payload = TopKCodec(keep=0.5).encode(_vector(100))
    with pytest.raises(CodecError, match="must be"):
        TopKCodec(keep=0.25).decode(payload)


@pytest.mark.parametrize("positions", [(1, 1, 7), (3, 1, 7), (1, 3, 8), (1, 3, 2**32 - 1)], ids=str)
def test_topk_bad_positions_raise(positions: tuple[int, int, int]) -> None:
    payload = bytearray(TopKCodec(keep=0.375).encode(torch.arange(8.0)))
    payload[13:25] = struct.pack("<3I", *positions)
    with pytest.raises(CodecError, match="strictly ascending and below 8"):
        TopKCodec(keep=0.375).decode(bytes(payload))


def test_topk_body_count_differing_from_header_raises() -> None:
    payload = bytearray(TopKCodec(keep=0.375).encode(torch.arange(8.0)))
    payload[5:9] = struct.pack("<I", 9)
    with pytest.raises(CodecError, match="body is for 9 values"):
        TopKCodec(keep=0.375).decode(bytes(payload))


@pytest.mark.parametrize("keep", [0.0, 2.0])
def test_topk_keep_out_of_range_raises(keep: float) -> None:
    with pytest.raises(CodecError, match="topk keep fraction must be in"):
        get_codec("topk", keep=keep)


def test_topk_keep_one_is_exact() -> None:
    x = _vector(300)
    codec = TopKCodec(keep=1.0)
    assert torch.equal(codec.decode(codec.encode(x)), x)
