"""Weight caps, norm clipping and the weighted mean, on numbers worked by hand."""

from __future__ import annotations

import math

import pytest
import torch

from diloco.protocol.core.aggregation import (
    cap_weight,
    cap_weights,
    check_clip_factor,
    chunk_norm,
    clip_scales,
    median_capped,
    robust_mean,
    weighted_mean,
)


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


def test_cap_weights_clamps_only_weights_over_the_cap() -> None:
    assert cap_weights([1.0, 7.5, 1e30], 5.0) == (1.0, 5.0, 5.0)
    assert cap_weight(3.0, math.inf) == 3.0


@pytest.mark.parametrize("factor", [0.5, -1.0, math.inf, math.nan])
def test_check_clip_factor_refuses_factors_that_clip_the_median(factor: float) -> None:
    with pytest.raises(ValueError, match="clip_factor"):
        check_clip_factor(factor)


def test_check_clip_factor_allows_off_and_at_least_one() -> None:
    for factor in (0.0, 1.0, 2.0):
        check_clip_factor(factor)


def test_chunk_norm_overflowing_fp32_falls_back_to_fp64() -> None:
    assert chunk_norm(torch.tensor([3.0, 4.0])) == 5.0
    assert chunk_norm(torch.tensor([3e30, 4e30])) == pytest.approx(5e30, rel=1e-6)


def test_clip_scales_lower_median_of_four() -> None:
    # sorted 1, 2, 3, 100: lower median (index 1) is 2, bound 2 x 2 = 4
    assert clip_scales([3.0, 100.0, 1.0, 2.0], 2.0) == (1.0, 0.04, 1.0, 1.0)


def test_clip_scales_two_members_reference_is_the_smaller_norm() -> None:
    assert clip_scales([1.0, 8.0], 2.0) == (1.0, 0.25)
    assert clip_scales([8.0, 1.0], 4.0) == (0.5, 1.0)


def test_clip_scales_at_the_bound_is_not_clipped() -> None:
    assert clip_scales([1.0, 3.0, 6.0], 2.0) == (1.0, 1.0, 1.0)  # bound 2 x 3 = 6


def test_clip_scales_off_zero_reference_or_alone_clip_nothing() -> None:
    assert clip_scales([1.0, 1e9], 0.0) == (1.0, 1.0)
    assert clip_scales([0.0, 0.0, 5.0], 2.0) == (1.0, 1.0, 1.0)
    assert clip_scales([7.0], 1.0) == (1.0,)


def test_robust_mean_clips_the_outlier_to_c_times_the_median() -> None:
    parts = [torch.tensor([3.0, 4.0]), torch.tensor([0.0, 10.0]), torch.tensor([-300.0, 400.0])]
    # norms 5, 10, 500; lower median 10, bound 20: the third scaled by 1/25 to [-12, 16];
    # weights 1, 1, 2: lower median 1, so the third counts 1
    combined = robust_mean(parts, [1.0, 1.0, 2.0], 2.0)
    assert combined.norms == (5.0, 10.0, 500.0)
    assert combined.scales == (1.0, 1.0, 0.04)
    assert combined.weights == (1.0, 1.0, 1.0)
    assert combined.clipped == [2]
    # 1/3 [3, 4] + 1/3 [0, 10] + 1/3 [-12, 16] = [-3, 10]
    assert combined.mean.tolist() == pytest.approx([-3.0, 10.0], rel=1e-6)


def test_robust_mean_without_outliers_is_the_plain_mean_bit_for_bit() -> None:
    generator = torch.Generator().manual_seed(3)
    parts = [torch.randn(4097, generator=generator) * s for s in (1.0, 1.5, 0.7, 1.9)]
    weights = [1.0, 1.0, 1.0, 0.25]  # none over the lower median (1)
    combined = robust_mean(parts, weights, 3.0)
    assert combined.clipped == []
    plain = torch.zeros(4097)
    total = sum(weights)
    for part, weight in zip(parts, weights, strict=True):  # the mean spelled out (no FMA)
        plain.add_(part * (weight / total))
    assert torch.equal(combined.mean, plain)


def test_median_capped_weights_clamp_to_the_lower_median() -> None:
    assert median_capped([1.0, 5.0]) == (1.0, 1.0)  # a pair: the smaller
    assert median_capped([3.0, 1.0, 2.0]) == (2.0, 1.0, 2.0)
    assert median_capped([4.0, 1.0, 3.0, 2.0]) == (2.0, 1.0, 2.0, 2.0)
    assert median_capped([]) == ()
