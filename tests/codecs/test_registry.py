"""Lookup by name and by id byte, and the stable id table."""

from __future__ import annotations

import pytest
import torch

from diloco.codecs import CODEC_NAMES, CodecError, codec_for_payload, get_codec
from diloco.codecs.e3m0 import E3M0Codec

STABLE_IDS = {"none": 0, "bf16": 1, "fp16": 2, "int8": 3, "e3m0": 4, "drop": 5, "topk": 6}


def test_codec_names_in_id_order() -> None:
    assert CODEC_NAMES == ("none", "bf16", "fp16", "int8", "e3m0", "drop", "topk")


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_get_codec_name_and_id_are_stable(name: str) -> None:
    codec = get_codec(name)
    assert codec.name == name
    assert codec.codec_id == STABLE_IDS[name]


def test_get_codec_block_sizes() -> None:
    assert {name: get_codec(name).block_size for name in CODEC_NAMES} == {
        "none": 1,
        "bf16": 1,
        "fp16": 1,
        "int8": 64,
        "e3m0": 32,
        "drop": 1,
        "topk": 1,
    }


def test_get_codec_unknown_name_raises_listing_names() -> None:
    with pytest.raises(CodecError, match="unknown codec 'fp8'; valid names: none, bf16, fp16"):
        get_codec("fp8")


def test_get_codec_e3m0_rounding_option() -> None:
    assert isinstance(get_codec("e3m0"), E3M0Codec)
    assert get_codec("e3m0").rounding == "nearest"  # type: ignore[attr-defined]
    assert get_codec("e3m0", rounding="stochastic").rounding == "stochastic"  # type: ignore[attr-defined]


def test_get_codec_bad_rounding_raises() -> None:
    with pytest.raises(CodecError, match="unknown e3m0 rounding 'up'"):
        get_codec("e3m0", rounding="up")


def test_get_codec_option_not_taken_raises_chained() -> None:
    with pytest.raises(CodecError, match="does not take options") as info:
        get_codec("int8", rounding="stochastic")
    assert isinstance(info.value.__cause__, TypeError)


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_codec_for_payload_finds_the_encoder(name: str) -> None:
    payload = get_codec(name).encode(torch.ones(10))
    codec = codec_for_payload(payload)
    assert codec.name == name
    # drop and topk lose values by design; every other codec represents 1.0 exactly.
    lossless = name not in ("drop", "topk")
    expected = torch.ones(10) if lossless else get_codec(name).decode(payload)
    assert torch.equal(codec.decode(payload), expected)


def test_codec_for_payload_stochastic_e3m0_gives_nearest_options() -> None:
    payload = get_codec("e3m0", rounding="stochastic").encode(torch.ones(10))
    assert codec_for_payload(payload).rounding == "nearest"  # type: ignore[attr-defined]


@pytest.mark.parametrize("data", [b"", b"\x04\x00\x00\x00", bytes([9, 0, 0, 0, 0])])
def test_codec_for_payload_short_or_unknown_raises(data: bytes) -> None:
    with pytest.raises(CodecError):
        codec_for_payload(data)
