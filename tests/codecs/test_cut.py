"""``Codec.cut``: a span cut from a whole payload is byte for byte that span's own encoding."""

from __future__ import annotations

import pytest
import torch

from diloco.codecs import CodecError, get_codec

SLICEABLE = ("none", "bf16", "fp16", "int8", "e3m0")


def _vector(numel: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=generator)
    x[: numel // 3] *= 1e-4  # blocks of very different scales
    x[numel // 2 : numel // 2 + 70] = 0.0  # all-zero blocks
    return x


@pytest.mark.parametrize("name", SLICEABLE)
@pytest.mark.parametrize("numel", [256 * 9, 256 * 9 + 37, 31])
def test_cut_equals_encoding_of_the_span(name: str, numel: int) -> None:
    codec = get_codec(name)
    x = _vector(numel)
    whole = codec.encode(x)
    step = 256
    spans = [(a, min(a + 3 * step, numel)) for a in range(0, numel, step)] + [(0, numel)]
    spans += [(numel - numel % step, numel), (step, step)] if numel > step else []
    for start, stop in spans:
        assert codec.cut(whole, start, stop) == codec.encode(x[start:stop].contiguous()), (
            start,
            stop,
        )


@pytest.mark.parametrize("name", SLICEABLE)
def test_cut_rejects_misaligned_or_out_of_range_spans(name: str) -> None:
    codec = get_codec(name)
    whole = codec.encode(_vector(1000))
    bad = [(-64, 64), (0, 1001), (512, 256)]
    if codec.block_size > 1:
        bad += [(1, 64 * 4), (0, 64 * 4 + 1)]
    for start, stop in bad:
        with pytest.raises(CodecError):
            codec.cut(whole, start, stop)


def test_cut_rejects_a_payload_of_another_codec_or_length() -> None:
    e3m0 = get_codec("e3m0")
    with pytest.raises(CodecError):
        e3m0.cut(get_codec("none").encode(_vector(64)), 0, 32)
    with pytest.raises(CodecError):
        e3m0.cut(e3m0.encode(_vector(64))[:-1], 0, 32)


@pytest.mark.parametrize("name", ["drop", "topk"])
def test_codecs_that_choose_across_blocks_cannot_cut(name: str) -> None:
    codec = get_codec(name)
    assert not codec.sliceable
    with pytest.raises(CodecError, match="cannot be cut"):
        codec.cut(codec.encode(_vector(64)), 0, 32)


def test_stochastic_e3m0_cannot_cut() -> None:
    assert not get_codec("e3m0", rounding="stochastic").sliceable
