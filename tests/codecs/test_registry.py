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


# What each codec's decoder must give back for the vector it encoded, written by hand:
# 1.0 and 2.0 are exact in every lossy format; int8 scales a block by absmax / 127, so
# 1.0 comes back exactly only in a block of ones; top-k (k = ceil(10 * 4.25 / 64) = 1)
# keeps the one largest magnitude.
ONES = [1.0] * 10
ONE_TWO = [1.0, 1.0, 1.0, 2.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
DECODED_BY_HAND = {
    "none": (ONE_TWO, ONE_TWO),
    "bf16": (ONE_TWO, ONE_TWO),
    "fp16": (ONE_TWO, ONE_TWO),
    "int8": (ONES, ONES),
    "e3m0": (ONE_TWO, ONE_TWO),
    "topk": (ONE_TWO, [0.0, 0.0, 0.0, 2.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]),
}


@pytest.mark.parametrize("name", sorted(DECODED_BY_HAND))
def test_codec_for_payload_finds_the_encoder(name: str) -> None:
    values, expected = DECODED_BY_HAND[name]
    payload = get_codec(name).encode(torch.tensor(values))
    codec = codec_for_payload(payload)
    assert codec.name == name
    assert codec.decode(payload).tolist() == expected


def test_codec_for_payload_finds_the_drop_encoder() -> None:
    # Default keep 4.25 / 32: k = max(1, round(10 * 0.1328)) = 1 value kept, rescaled by n / k.
    payload = get_codec("drop").encode(torch.ones(10))
    codec = codec_for_payload(payload)
    assert codec.name == "drop"
    decoded = codec.decode(payload).tolist()
    assert sorted(decoded) == [0.0] * 9 + [10.0]


def test_decoded_by_hand_covers_every_codec() -> None:
    assert {*DECODED_BY_HAND, "drop"} == set(CODEC_NAMES)


def test_codec_for_payload_stochastic_e3m0_gives_nearest_options() -> None:
    payload = get_codec("e3m0", rounding="stochastic").encode(torch.ones(10))
    assert codec_for_payload(payload).rounding == "nearest"  # type: ignore[attr-defined]


@pytest.mark.parametrize("data", [b"", b"\x04\x00\x00\x00", bytes([9, 0, 0, 0, 0])])
def test_codec_for_payload_short_or_unknown_raises(data: bytes) -> None:
    with pytest.raises(CodecError):
        codec_for_payload(data)
