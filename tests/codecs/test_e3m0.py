"""E3M0 (docs/design.md "Codecs"): layout, golden bytes, scale rule, nearest and stochastic
rounding."""

from __future__ import annotations

import math

import pytest
import torch

from diloco.codecs import CodecError, get_codec
from diloco.codecs.e3m0 import E3M0Codec

NEAREST = E3M0Codec()
STOCHASTIC = E3M0Codec(rounding="stochastic")
LEVELS = torch.tensor([0.0] + [2.0**k for k in range(-6, 1)], dtype=torch.float64)  # x scale


def _scale_bytes(payload: bytes, n: int) -> torch.Tensor:
    nb = -(-n // 32)
    return torch.tensor(list(payload[5 : 5 + nb]), dtype=torch.int64)


def _block_scales(payload: bytes, n: int) -> torch.Tensor:
    """Each value's block scale, 2**(b - 127), in float64: (n,)."""
    scales = torch.exp2(_scale_bytes(payload, n).double() - 127)
    return scales.repeat_interleave(32)[:n]


def _hard_vector(num_blocks: int, seed: int = 0) -> torch.Tensor:
    """Blocks over 200 binades, with exact ties (midpoints) and exact levels mixed in."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp2(torch.randint(-120, 100, (num_blocks, 1), generator=g).double())
    x = torch.randn(num_blocks, 32, generator=g, dtype=torch.float64)
    x = x * torch.exp2(
        torch.empty(num_blocks, 32, dtype=torch.float64).uniform_(-8, 0, generator=g)
    )
    x = x.clamp(-0.85, 0.85)
    # Column 0 fixes the block scale; columns 1-15 hold ties and levels of that scale.
    ties = torch.tensor([2.0**-7] + [1.5 * 2.0**-k for k in range(1, 7)], dtype=torch.float64)
    x[:, 0] = 0.9
    x[:, 1:8] = ties
    x[:, 8:15] = -LEVELS[1:]
    x = x * scale
    return x.view(-1).float()


def test_e3m0_encoded_size() -> None:
    for n in (0, 1, 31, 32, 33, 1000):
        assert NEAREST.encoded_size(n) == 5 + 17 * math.ceil(n / 32)


def test_e3m0_golden_bytes_nearest() -> None:
    # Block 0: absmax 3 -> scale 4 (b = 129 = 0x81); r = x / 4:
    #   3.0 -> r 0.75, tie of 0.5 and 1, away from zero -> e 7; -1.0 -> 0.25 -> e 5, sign: 0xd;
    #   0.03125 -> r 2**-7, tie of 0 and 2**-6 -> e 1; 0.0312 -> below the tie -> 0;
    #   -0.06 -> r 0.015, nearer 2**-6 than 0 -> 0x9; 1.5 -> r 0.375, tie -> 0.5, e 6;
    #   1.4 -> r 0.35 -> 0.25, e 5; -2.9 -> r 0.725 -> 0.5, 0xe; 0.1 -> r 0.025 -> 2**-5, e 2.
    # Block 1: all zero -> b 0, codes 0. Block 2 (6 values): absmax 0.5 = scale (b 126 = 0x7e):
    #   -0.5 -> 0xf; 0.25 -> e 6; 2**-7 -> r 2**-6, e 1; 2**-8 -> tie, e 1; 2**-9 -> 0; 0.3 -> e 6.
    block0 = [3.0, -1.0, 0.0, 0.03125, 0.0312, -0.06, 1.5, 1.4, -2.9, 0.1] + [0.0] * 22
    block2 = [-0.5, 0.25, 2.0**-7, 2.0**-8, 2.0**-9, 0.3]
    payload = NEAREST.encode(torch.tensor(block0 + [0.0] * 32 + block2))
    expected = (
        bytes.fromhex("04 46000000")  # id 4, 70 values
        + bytes.fromhex("81 00 7e")  # scale bytes
        + bytes.fromhex("d7 10 90 56 2e")  # code pairs, first value in the low nibble
        + bytes(11 + 16)
        + bytes.fromhex("6f 11 60")
        + bytes(13)
    )
    assert payload == expected
    decoded = NEAREST.decode(payload).tolist()
    assert decoded[:10] == [4.0, -1.0, 0.0, 2**-4, 0.0, -(2**-4), 2.0, 1.0, -2.0, 2**-3]
    assert decoded[64:] == [-0.5, 0.25, 2**-7, 2**-7, 0.0, 0.25]


def test_e3m0_golden_bytes_stochastic_with_patched_rand(monkeypatch: pytest.MonkeyPatch) -> None:
    # With every draw 0.5 the value goes up iff it lies strictly above its neighbours' midpoint.
    monkeypatch.setattr(
        torch, "rand", lambda *size, generator=None, device=None: torch.full(size[0], 0.5)
    )
    x = torch.tensor([1.0, 0.7, 0.8, -0.3, 0.375, 0.006, 0.01, 0.0])  # scale 1 (b 127)
    # 1.0 -> e 7; 0.7 in [0.5, 1], p 0.4 -> down, e 6; 0.8 p 0.6 -> up, e 7; -0.3, p 0.2 -> down,
    # 0x8 | 5; 0.375, p 0.5 -> down, e 5; 0.006 < 2**-6, p 0.384 -> 0; 0.01, p 0.64 -> e 1.
    payload = STOCHASTIC.encode(x)
    assert payload == bytes.fromhex("04 08000000 7f 67 d7 05 01") + bytes(12)


def test_e3m0_scale_is_smallest_power_of_two_not_below_absmax() -> None:
    x = _hard_vector(200)
    x[32:64] = 0.0  # an all-zero block gets b = 0
    x[64:96] = 2.0**-140  # so does a block below 2**-127
    payload = NEAREST.encode(x)
    b = _scale_bytes(payload, x.numel())
    absmax = x.view(-1, 32).abs().amax(dim=1).double()
    scale = torch.exp2(b.double() - 127)
    assert b[1] == 0 and b[2] == 0
    assert bool((absmax <= scale).all())
    assert bool(((absmax > scale / 2) | (b == 0)).all())


def test_e3m0_scale_exact_powers_of_two_and_limits() -> None:
    x = torch.tensor([2.0**127, 0.0] + [0.0] * 30 + [-1.0] + [0.0] * 31 + [2.0**-127])
    payload = NEAREST.encode(x)
    assert list(payload[5:8]) == [254, 127, 0]
    assert torch.equal(NEAREST.decode(payload), x)


@pytest.mark.parametrize("codec", [NEAREST, STOCHASTIC])
def test_e3m0_value_above_2_pow_127_raises(codec: E3M0Codec) -> None:
    with pytest.raises(CodecError, match=r"cannot encode \|x\| > 2\*\*127"):
        codec.encode(torch.tensor([1.0, 2.0**127 * 1.0000001]))


def test_e3m0_decode_matches_exact_table_for_every_scale_and_code() -> None:
    # One block per scale byte 0..254; its 32 codes are 0..15 twice (pairs (0,1), (2,3), ...).
    scale_bytes = bytes(range(255))
    codes = bytes([0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE] * 2) * 255
    out = NEAREST.decode(
        bytes.fromhex("04") + (255 * 32).to_bytes(4, "little") + scale_bytes + codes
    )
    expected = [
        0.0 if code & 7 == 0 else (-1.0) ** (code >> 3) * math.ldexp(1.0, b - 127 + (code & 7) - 7)
        for b in range(255)
        for code in list(range(16)) * 2
    ]
    assert out.double().tolist() == expected


def test_e3m0_decode_scale_byte_255_raises() -> None:
    payload = bytearray(NEAREST.encode(torch.ones(100)))
    payload[5 + 3] = 255  # last block
    with pytest.raises(CodecError, match="invalid scale byte 255"):
        NEAREST.decode(bytes(payload))


def test_e3m0_decoded_norm_ignores_padding_codes_and_refuses_scale_byte_255() -> None:
    payload = bytearray(NEAREST.encode(torch.full((40,), 0.5)))  # 2 blocks, 24 padding codes
    assert NEAREST.decoded_norm(bytes(payload)) == math.sqrt(40) * 0.5
    payload[-1] = 0x77  # two padding codes at full scale: decode ignores them, and so must it
    assert NEAREST.decoded_norm(bytes(payload)) == math.sqrt(40) * 0.5
    payload[5 + 1] = 255
    with pytest.raises(CodecError, match="invalid scale byte 255"):
        NEAREST.decoded_norm(bytes(payload))


def test_e3m0_nearest_picks_a_nearest_representable_value_ties_away() -> None:
    """Brute force against the 15 values of each block; on a tie, the larger magnitude."""
    x = _hard_vector(300)
    payload = NEAREST.encode(x)
    scale = _block_scales(payload, x.numel())
    out = NEAREST.decode(payload).double()
    x64 = x.double()
    candidates = torch.cat([LEVELS, -LEVELS[1:]])[None, :] * scale[:, None]  # (n, 15)
    distance = (candidates - x64[:, None]).abs()
    best = distance.min(dim=1).values
    assert torch.equal((out - x64).abs(), best)
    tied = (distance == best[:, None]).sum(dim=1) > 1
    assert int(tied.sum()) >= 7 * 300  # the vector really holds ties
    largest_tied = torch.where(distance == best[:, None], candidates.abs(), -1.0).amax(dim=1)
    assert torch.equal(out.abs()[tied], largest_tied[tied])
    assert bool((torch.sign(out) * torch.sign(x64) >= 0).all())


def test_e3m0_nearest_round_trip_error_bound() -> None:
    """|err| <= half the gap to the neighbour: <= scale/128 near zero, <= |x|/3 elsewhere."""
    x = _hard_vector(300)
    payload = NEAREST.encode(x)
    scale = _block_scales(payload, x.numel())
    err = (NEAREST.decode(payload).double() - x.double()).abs()
    bound = torch.maximum(scale / 128, x.double().abs() / 3)
    assert bool((err <= bound).all())
    assert bool((err == bound).any())  # reached at the midpoints 1.5 * 2**-j and 2**-7


def test_e3m0_stochastic_rounds_to_a_neighbour() -> None:
    x = _hard_vector(100)
    g = torch.Generator().manual_seed(1)
    payload = STOCHASTIC.encode(x, generator=g)
    scale = _block_scales(payload, x.numel())
    r = x.double().abs() / scale
    out_r = STOCHASTIC.decode(payload).double().abs() / scale
    below = torch.where(LEVELS[None, :] <= r[:, None], LEVELS[None, :], -1.0).amax(dim=1)
    above = torch.where(LEVELS[None, :] >= r[:, None], LEVELS[None, :], 2.0).amin(dim=1)
    assert bool(((out_r == below) | (out_r == above)).all())


def test_e3m0_stochastic_is_unbiased() -> None:
    """The mean of K encodings is within 5 standard errors of x for every value, and the
    z-scores have variance about 1 (so the up-probabilities are right, not just the mean)."""
    k = 2000
    x = _hard_vector(32, seed=3)
    payload = STOCHASTIC.encode(x.repeat(k), generator=torch.Generator().manual_seed(7))
    samples = STOCHASTIC.decode(payload).double().view(k, -1)
    scale = _block_scales(payload, x.numel())
    r = x.double().abs() / scale
    lo = torch.where(LEVELS[None, :] <= r[:, None], LEVELS[None, :], -1.0).amax(dim=1) * scale
    hi = torch.where(LEVELS[None, :] >= r[:, None], LEVELS[None, :], 2.0).amin(dim=1) * scale
    variance = (hi - x.double().abs()) * (x.double().abs() - lo)
    error = samples.mean(dim=0) - x.double()
    exact = variance == 0
    assert bool((error[exact] == 0).all())
    z = error[~exact] / (variance[~exact] / k).sqrt()
    assert float(z.abs().max()) < 5
    assert 0.7 < float(z.pow(2).mean()) < 1.3


def test_e3m0_stochastic_same_seed_same_bytes() -> None:
    x = _hard_vector(10)
    first = STOCHASTIC.encode(x, generator=torch.Generator().manual_seed(5))
    again = STOCHASTIC.encode(x, generator=torch.Generator().manual_seed(5))
    other = STOCHASTIC.encode(x, generator=torch.Generator().manual_seed(6))
    assert first == again != other


def test_e3m0_nearest_round_trip_is_idempotent() -> None:
    """decode(encode(.)) and encode(decode(.)) are both idempotent, bit for bit."""
    x = _hard_vector(100)
    first = NEAREST.encode(x)
    y = NEAREST.decode(first)
    canonical = NEAREST.encode(y)
    assert torch.equal(NEAREST.decode(canonical), y)
    assert NEAREST.encode(NEAREST.decode(canonical)) == canonical


def test_e3m0_re_encode_changes_bytes_only_when_the_block_max_rounds_down() -> None:
    """With the codec's scale rule a block whose absmax rounds down to scale/2 re-encodes with
    scale/2 (b - 1, fields + 1): same values, other bytes. Other blocks keep their bytes."""
    x = torch.tensor([0.7] + [0.3, -0.05] + [0.0] * 29 + [0.8] + [0.3, -0.05] + [0.0] * 29)
    first = NEAREST.encode(x)  # block 0: 0.7 -> 0.5 (rounds down); block 1: 0.8 -> 1
    again = NEAREST.encode(NEAREST.decode(first))
    assert list(first[5:7]) == [127, 127] and list(again[5:7]) == [126, 127]
    assert first[7 + 16 :] == again[7 + 16 :]
    assert first[7 : 7 + 16] != again[7 : 7 + 16]
    assert torch.equal(NEAREST.decode(again), NEAREST.decode(first))


def test_e3m0_zero_is_code_0_whatever_the_sign() -> None:
    x = torch.tensor([1.0, -0.0, -0.001, 0.001])
    assert NEAREST.encode(x)[5 + 1 : 5 + 3] == bytes([0x07, 0x00])


def test_e3m0_part_encodes_to_matching_scale_and_code_bytes() -> None:
    n = 256 * 6 + 70
    x = _hard_vector(-(-n // 32))[:n]
    whole = get_codec("e3m0").encode(x)
    nb = -(-n // 32)
    for lo, hi in [(0, 256), (256, 1024), (1024, 1536), (1536, n), (512, n)]:
        part = NEAREST.encode(x[lo:hi])
        first, count = lo // 32, -(-(hi - lo) // 32)
        assert part[5 : 5 + count] == whole[5 + first : 5 + first + count]
        codes = whole[5 + nb + 16 * first : 5 + nb + 16 * (first + count)]
        assert part[5 + count :] == codes


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_encode_blocks_are_the_body_of_encode_and_decode_blocks_its_values(rounding) -> None:
    codec = E3M0Codec(rounding)
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0)) * 3.0
    x[:40] = 0.0  # an all-zero block, and a padded last one (1000 = 31 * 32 + 8)
    payload = codec.encode(x, torch.Generator().manual_seed(5))
    scales, packed = codec.encode_blocks(x, torch.Generator().manual_seed(5))
    assert scales.shape == (32,) and packed.shape == (32, 16)
    assert scales.dtype == packed.dtype == torch.uint8
    assert payload[5:] == scales.numpy().tobytes() + packed.numpy().tobytes()
    values = E3M0Codec.decode_blocks(scales, packed, x.numel())
    assert torch.equal(values, codec.decode(payload))
