"""One member at the weight cap, sending anything, never reverses the honest mean
(docs/design.md "Aggregation bounds"), through ``InProcessReducer`` (the combine step of
every transport).

The expected bounds are worked out here by hand: with ``m - 1`` honest members sending
the same delta ``x`` at equal weights, a liar clipped to ``|x|`` and capped to their
weight leaves at least ``((m - 1) - 1) / m = (m - 2) / m`` of ``x`` along ``x``.
"""

from __future__ import annotations

import pytest
import torch

from diloco.codecs import get_codec
from diloco.protocol.core.reducer import Contribution, InProcessReducer, RoundKey

KEY = RoundKey(0, 3)
NUMEL = 4_096  # one chunk per part
CAP = 2.0
ROUNDING = 1e-6
"""Float slack of a projection that cancels exactly in real numbers (a pair)."""


def _honest(seed: int) -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(seed))


def _liar(direction: str, x: torch.Tensor) -> torch.Tensor:
    """What the liar sends, given the honest delta ``x``."""
    other = _honest(99)
    if direction == "reverse":
        return -50.0 * x
    if direction == "orthogonal":
        return 50.0 * (other - (other @ x) / (x @ x) * x)
    if direction == "random":
        return 50.0 * other
    if direction == "half-reverse":
        return -50.0 * x + 20.0 * other
    assert direction == "tiny"
    return -1e-3 * x


def _projection(result: torch.Tensor, honest_mean: torch.Tensor) -> float:
    """The result along the honest-only mean, as a fraction of it (FP64)."""
    h = honest_mean.double()
    return float(result.double() @ h / (h @ h))


def _reduce(inputs: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
    reducer = InProcessReducer(get_codec("none"), max_weight=CAP)
    contributions = [
        Contribution(str(i), d, w) for i, (d, w) in enumerate(zip(inputs, weights, strict=True))
    ]
    return reducer.reduce(KEY, contributions).result().delta


@pytest.mark.parametrize("direction", ["reverse", "orthogonal", "random", "half-reverse", "tiny"])
@pytest.mark.parametrize("m", range(2, 9))
def test_liar_at_the_cap_keeps_at_least_m_minus_2_over_m_of_agreeing_honest_members(
    m: int, direction: str
) -> None:
    x = _honest(m)
    inputs = [x.clone() for _ in range(m - 1)] + [_liar(direction, x)]
    weights = [1.0] * (m - 1) + [1e30]  # the liar claims any weight: the cap (2) counts
    projection = _projection(_reduce(inputs, weights), x)
    worst = (m - 2) / m
    assert projection >= worst - ROUNDING, (m, direction, projection)
    if m >= 3:
        assert projection > 0
    if direction == "reverse":  # the worst case is reached
        assert projection == pytest.approx(worst, abs=ROUNDING)


@pytest.mark.parametrize("m", range(3, 9))
def test_liar_at_the_cap_does_not_reverse_honest_members_of_unequal_weights(m: int) -> None:
    # Honest weights 1 .. m-1 (under the cap of 2 only the first), the liar at the cap.
    # Weights are capped at their lower median mu, which at least two members reach and
    # one of them is honest: the honest weight is at least mu plus another member's.
    x = _honest(m)
    weights = [min(float(k), CAP) for k in range(1, m)] + [CAP]
    inputs = [x.clone() for _ in range(m - 1)] + [-50.0 * x]
    mu = sorted(weights)[(m - 1) // 2]
    capped = [min(w, mu) for w in weights]
    worst = (sum(capped[:-1]) - capped[-1]) / sum(capped)  # by hand, > 0
    assert worst > 0
    projection = _projection(_reduce(inputs, weights), x)
    assert projection == pytest.approx(worst, abs=ROUNDING)


@pytest.mark.parametrize("m", range(2, 9))
def test_liar_at_the_cap_does_not_reverse_honest_members_that_disagree(m: int) -> None:
    # Honest deltas share a direction and differ by noise of half its size per value; the
    # liar sends -50 times their mean at the cap.
    base = _honest(m)
    honest = [base + 0.5 * _honest(100 + i) for i in range(m - 1)]
    honest_mean = sum(honest) / (m - 1)
    inputs = [*honest, -50.0 * honest_mean]
    projection = _projection(_reduce(inputs, [1.0] * (m - 1) + [CAP]), honest_mean)
    assert projection > 0 if m >= 3 else projection >= -ROUNDING, (m, projection)
