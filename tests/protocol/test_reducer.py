"""``weighted_mean`` and ``InProcessReducer`` against means and byte counts worked by hand."""

from __future__ import annotations

import pytest
import torch

from diloco.codecs import get_codec
from diloco.protocol.reducer import Contribution, InProcessReducer, RoundKey, weighted_mean

KEY = RoundKey(0, 1)


def test_weighted_mean_by_hand() -> None:
    parts = [torch.tensor([1.0, 2.0, -4.0]), torch.tensor([3.0, 6.0, 0.0])]
    # weights 1 : 3 -> 0.25 a + 0.75 b
    assert weighted_mean(parts, [1.0, 3.0]).tolist() == [2.5, 5.0, -1.0]
    assert weighted_mean(parts, [10.0, 10.0]).tolist() == [2.0, 4.0, -2.0]


def test_weighted_mean_accumulates_in_fp32_in_the_given_order() -> None:
    # Scaled by 1/4, 1/4, 1/2 the parts are 2**24, 1 and -2**24 (exact). In FP32,
    # 2**24 + 1 rounds to 2**24 (half to even), so the given order ends at 0; with the -2**24
    # second it ends at 1, as exact arithmetic (or FP64) would in either order.
    big, one, minus = torch.tensor([2.0**26]), torch.tensor([4.0]), torch.tensor([-(2.0**25)])
    assert weighted_mean([big, one, minus], [1.0, 1.0, 2.0]).tolist() == [0.0]
    assert weighted_mean([big, minus, one], [1.0, 2.0, 1.0]).tolist() == [1.0]
    assert weighted_mean([big, one, minus], [1.0, 1.0, 2.0]).dtype == torch.float32


def test_weighted_mean_single_part_is_returned_bit_for_bit() -> None:
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    assert torch.equal(weighted_mean([x], [7.0]), x)


@pytest.mark.parametrize(
    ("parts", "weights"),
    [([], []), ([torch.ones(2)], [0.0]), ([torch.ones(2), torch.ones(2)], [1.0, -1.0])],
)
def test_weighted_mean_without_positive_weight_raises(
    parts: list[torch.Tensor], weights: list[float]
) -> None:
    with pytest.raises(ValueError, match="positive total weight"):
        weighted_mean(parts, weights)


def test_in_process_reducer_weighted_mean_by_hand() -> None:
    contributions = [
        Contribution("a", torch.tensor([1.0, 2.0]), 1.0),
        Contribution("b", torch.tensor([3.0, 6.0]), 3.0),
    ]
    result = InProcessReducer(get_codec("none")).reduce(KEY, contributions).result()
    assert result.delta.tolist() == [2.5, 5.0]
    assert result.members == ("a", "b")


def test_in_process_reducer_uses_decoded_values_both_ways() -> None:
    # E3M0, scale 1 (levels 2**-6 .. 1): members send 0.3 -> 0.25, 0.5 and 0.25 exactly;
    # the mean [1, 0.25, 0.375] is encoded again and 0.375, a tie, goes away from zero to 0.5.
    contributions = [
        Contribution("a", torch.tensor([1.0, 0.3, 0.5]), 1.0),
        Contribution("b", torch.tensor([1.0, 0.3, 0.25]), 1.0),
    ]
    result = InProcessReducer(get_codec("e3m0")).reduce(KEY, contributions).result()
    assert result.delta.tolist() == [1.0, 0.25, 0.5]


def test_in_process_reducer_single_member_gets_its_own_decoded_delta() -> None:
    # SPEC 2.7: 0.3 -> 0.25 and -0.6 -> -0.5 (nearer than -1); nothing goes on the wire.
    alone = [Contribution("me", torch.tensor([1.0, 0.3, -0.6, 0.0]), 5.0)]
    result = InProcessReducer(get_codec("e3m0")).reduce(KEY, alone).result()
    assert result.delta.tolist() == [1.0, 0.25, -0.5, 0.0]
    assert result.members == ("me",)
    assert (result.bytes_sent, result.bytes_received) == (0, 0)


def _equal(num_members: int, numel: int) -> list[Contribution]:
    return [Contribution(f"m{i}", torch.full((numel,), float(i)), 1.0) for i in range(num_members)]


def test_in_process_reducer_byte_counts_two_members_by_hand() -> None:
    # Parts [0, 256) and [256, 300); raw FP32 payloads are 5 + 4n bytes: 1029 and 181.
    # Each member sends the other's part (scatter) and its averaged part (gather).
    result = InProcessReducer(get_codec("none")).reduce(KEY, _equal(2, 300)).result()
    assert (result.bytes_sent, result.bytes_received) == (181 + 1029, 1029 + 181)
    assert result.delta.tolist() == [0.5] * 300


def test_in_process_reducer_byte_counts_three_members_e3m0_by_hand() -> None:
    # Parts of 256, 256 and 88 values; E3M0 payloads are 5 + 17 * ceil(n / 32): 141 and 56.
    # Member 0 and 1 each send 141 + 56 + 2 * 141 = 479, member 2 sends 2 * 141 + 2 * 56
    # = 394, and receive as much; the result reports the mean per member, 1352 // 3.
    result = InProcessReducer(get_codec("e3m0")).reduce(KEY, _equal(3, 600)).result()
    assert (result.bytes_sent, result.bytes_received) == (450, 450)


def test_in_process_reducer_return_codec_sizes_the_gather_phase() -> None:
    # Scatter in E3M0 (141 bytes a part of 256), gather in raw FP32 (1029 bytes).
    reducer = InProcessReducer(get_codec("e3m0"), return_codec=get_codec("none"))
    result = reducer.reduce(KEY, _equal(2, 512)).result()
    assert (result.bytes_sent, result.bytes_received) == (141 + 1029, 141 + 1029)
