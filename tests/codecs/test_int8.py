"""Blockwise absmax int8: layout, golden bytes, error bound, malformed scales, part-wise."""

from __future__ import annotations

import struct

import pytest
import torch

from diloco.codecs import CodecError, get_codec

CODEC = get_codec("int8")


def _blocky(num_blocks: int, seed: int = 0) -> torch.Tensor:
    """Normal values whose scale changes per 64-value block over 60 binades."""
    g = torch.Generator().manual_seed(seed)
    block_scale = torch.exp2(torch.empty(num_blocks).uniform_(-30, 30, generator=g))
    return (torch.randn(num_blocks, 64, generator=g) * block_scale[:, None]).view(-1)


def _scales(payload: bytes, n: int) -> torch.Tensor:
    nb = -(-n // 64)
    return torch.tensor(struct.unpack_from(f"<{nb}f", payload, 5))


def test_int8_encoded_size() -> None:
    for n, size in [(0, 5), (1, 10), (64, 73), (65, 78), (1000, 5 + 4 * 16 + 1000)]:
        assert CODEC.encoded_size(n) == size


def test_int8_golden_bytes() -> None:
    # Block 0: absmax 127, scale 1.0; ties round to even (-63.5 -> -64, 0.5 -> 0, -2.5 -> -2).
    # Block 1: all zero, scale 0. Block 2 (6 values): absmax 254, scale 2.0.
    block0 = [127.0, -63.5, 0.4, 1.5, -2.5, 100.2, 0.5, -0.6] + [0.0] * 56
    block2 = [254.0, -1.0, 3.0, 0.0, -254.0, 5.0]
    payload = CODEC.encode(torch.tensor(block0 + [0.0] * 64 + block2))
    expected = (
        bytes.fromhex("03 86000000")  # id 3, 134 values
        + bytes.fromhex("0000803f 00000000 00000040")  # scales 1.0, 0.0, 2.0
        + bytes.fromhex("7f c0 00 02 fe 64 00 ff")
        + bytes(56 + 64)
        + bytes.fromhex("7f 00 02 00 81 02")
    )
    assert payload == expected
    decoded = CODEC.decode(payload)
    assert decoded[:8].tolist() == [127.0, -64.0, 0.0, 2.0, -2.0, 100.0, 0.0, -1.0]
    assert decoded[128:].tolist() == [254.0, 0.0, 4.0, 0.0, -254.0, 4.0]


def test_int8_scales_are_absmax_over_127() -> None:
    x = _blocky(20)
    scales = _scales(CODEC.encode(x), x.numel())
    assert torch.equal(scales, x.view(20, 64).abs().amax(dim=1) / 127)


def test_int8_round_trip_error_bound() -> None:
    """|err| <= scale * (1/2 + 2**-15) per value: half a step plus FP32 rounding."""
    x = _blocky(300)
    payload = CODEC.encode(x)
    scales = _scales(payload, x.numel()).double()
    err = (CODEC.decode(payload).double() - x.double()).abs().view(300, 64)
    ratio = err / scales[:, None]
    assert float(ratio.max()) <= 0.5 + 2**-15
    assert float(ratio.max()) > 0.49  # the half-step bound is reached, not loose


def test_int8_partial_last_block_has_no_padding_bytes() -> None:
    x = torch.arange(1.0, 71.0)
    payload = CODEC.encode(x)
    assert len(payload) == 5 + 8 + 70
    assert torch.equal(_scales(payload, 70), torch.tensor([64 / 127, 70 / 127]))
    assert float((CODEC.decode(payload) - x).abs().max()) <= 70 / 127 / 2


def test_int8_encode_never_writes_minus_128() -> None:
    x = torch.tensor([-1.0, 1.0 - 2**-23, -(1.0 - 2**-23)])
    assert set(CODEC.encode(x)[5 + 4 :]) == {0x81, 0x7F}


@pytest.mark.parametrize(
    ("scale", "message"),
    [
        (float("nan"), "non-finite or negative scale"),
        (float("inf"), "non-finite or negative scale"),
        (-1.0, "non-finite or negative scale"),
        (-0.0, "non-finite or negative scale"),
    ],
)
def test_int8_decode_bad_scale_raises(scale: float, message: str) -> None:
    payload = bytearray(CODEC.encode(torch.ones(100)))
    struct.pack_into("<f", payload, 5 + 4, scale)  # second block's scale
    with pytest.raises(CodecError, match=message):
        CODEC.decode(bytes(payload))


def test_int8_decode_minus_128_raises() -> None:
    payload = bytearray(CODEC.encode(torch.ones(10)))
    payload[-1] = 0x80
    with pytest.raises(CodecError, match="-128"):
        CODEC.decode(bytes(payload))


def test_int8_part_encodes_to_matching_scales_and_values() -> None:
    n = 256 * 6 + 100
    x = _blocky(-(-n // 64))[:n]
    whole = CODEC.encode(x)
    nb = -(-n // 64)
    for lo, hi in [(0, 256), (256, 1024), (1024, 1536), (1536, n), (512, n)]:
        part = CODEC.encode(x[lo:hi])
        part_nb = -(-(hi - lo) // 64)
        assert part[5 : 5 + 4 * part_nb] == whole[5 + 4 * (lo // 64) : 5 + 4 * (lo // 64 + part_nb)]
        assert part[5 + 4 * part_nb :] == whole[5 + 4 * nb + lo : 5 + 4 * nb + hi]
