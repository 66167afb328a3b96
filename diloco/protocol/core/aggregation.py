"""How members' contributions combine into a round's mean: weight caps and norm clipping.

Pure arithmetic shared by every transport: ``PartReducer.average`` (the swarm's reducers)
and ``InProcessReducer`` (``diloco-node local``) call ``robust_mean`` on the same chunks
(``round.chunk_spans``), so both give the same bits. Three rules bound what one member can
do to the mean (docs/design.md "Aggregation bounds": the bound and its proof):

* **Run cap.** A member's weight (tokens since its last sync of the fragment, plus the
  weight carried from failed rounds) counts at most ``max_weight`` tokens, a value of the
  run configuration. Every honest node clamps its own weight (``cap_weight``);
  matchmaking refuses a JOIN or GROUP over the cap, and reducers clamp again
  (``cap_weights``) whatever they are given.
* **Median weight cap.** Within one chunk's mean, no counted weight exceeds the lower
  median of the counted weights (``median_capped``): at least two counted members weigh
  the median, so one member never outweighs all the others together.
* **Norm clipping** (per chunk, against the median; "Secure Distributed Training at
  Scale", Gorbunov et al. 2022): contribution ``i`` is scaled by
  ``min(1, C * ref / norm_i)``, where ``ref`` is the *lower* median of the counted
  members' chunk norms (``sorted(norms)[(m - 1) // 2]``: with two members the smaller
  norm, so one member alone never sets the reference above the other's) and ``C`` is
  ``clip_factor``. Scaled contributions keep their weight in the denominator, so clipping
  only ever shrinks a contribution.

``clip_factor`` 0 turns both median rules off (the plain weighted mean of capped weights:
the data-parallel mean inside one replica, and tests of the arithmetic).

**Bound** (C = 1). One member at the cap, sending anything, with ``m - 1`` honest members
whose deltas agree: the mean projected on the honest-only mean keeps at least
``(m - 2) / m`` of it with equal weights, is > 0 for ``m >= 3`` and >= 0 for ``m = 2``:
it may cancel, never reverse, the honest update.

**Cost on honest runs.** Honest members' chunks above the median norm are scaled down to
it (about half of them), and weights above the median (members whose delta spans failed
rounds) count as the median; measured in benchmarks (docs/design.md "Aggregation
bounds").
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from diloco.protocol.core.norms import chunk_norm

CLIP_FACTOR = 1.0
"""Default C: the largest for which one member cannot reverse the honest mean of a group
of three (docs/design.md "Aggregation bounds"; C = 3, the previous default, let a member
at the cap sending -50 times its delta reverse it: -0.23 of the honest mean with three
members, -0.73 with two)."""


def cap_weight(weight: float, max_weight: float) -> float:
    """``weight`` clamped to the run's cap (``max_weight`` tokens; ``inf``: no cap)."""
    return min(float(weight), max_weight)


def cap_weights(weights: Sequence[float], max_weight: float) -> tuple[float, ...]:
    """Every weight clamped to the cap; weights within it are returned unchanged."""
    return tuple(cap_weight(w, max_weight) for w in weights)


def lower_median(values: Sequence[float]) -> float:
    """``sorted(values)[(m - 1) // 2]``: with two values the smaller, so one of two never
    sets it above the other's; with ``m >= 3`` one value alone cannot move it past a
    value of the others."""
    return sorted(values)[(len(values) - 1) // 2]


def median_capped(weights: Sequence[float]) -> tuple[float, ...]:
    """Every weight clamped to the lower median of ``weights`` (the median weight cap):
    at least two members then weigh the cap, so no single member outweighs the rest."""
    if not weights:
        return ()
    cap = lower_median(weights)
    return tuple(min(float(w), cap) for w in weights)


def check_clip_factor(clip_factor: float) -> None:
    """Raise ValueError unless ``clip_factor`` is 0 (off) or a finite C >= 1.

    C < 1 would clip the median member itself, shrinking every honest round.
    """
    if not (clip_factor == 0 or (math.isfinite(clip_factor) and clip_factor >= 1)):
        raise ValueError(f"clip_factor must be 0 (off) or >= 1, got {clip_factor!r}")


def clip_scales(norms: Sequence[float], clip_factor: float) -> tuple[float, ...]:
    """``min(1, C * ref / norm_i)`` per member, ``ref`` the lower median of ``norms``.

    Exactly 1.0 where nothing is clipped, and everywhere when ``clip_factor`` is 0 or
    ``ref`` is 0.
    """
    if clip_factor == 0 or not norms:
        return (1.0,) * len(norms)
    ref = lower_median(norms)
    bound = clip_factor * ref
    if bound <= 0:
        return (1.0,) * len(norms)
    return tuple(bound / norm if norm > bound else 1.0 for norm in norms)


def weighted_mean(
    parts: Sequence[torch.Tensor],
    weights: Sequence[float],
    scales: Sequence[float] | None = None,
) -> torch.Tensor:
    """FP32 weighted mean, accumulated in the given (group) order.

    Each contribution is scaled by its normalised weight (times its clip scale, 1.0 when
    not clipped: an exact multiplication) before it is added, so a single member gets its
    own values back exactly, and every reducer of every transport performs the same float
    operations in the same order. The product and the sum are two separate operations,
    each rounded once on every CPU: ``add_(x, alpha=w)`` fuses them into one FMA where the
    CPU has it (AVX2) and not elsewhere, and members that recompute a reducer's blocks
    (``verification``) must get its bits on any machine, value by value.
    """
    total = float(sum(weights))
    if not parts or total <= 0:
        raise ValueError("weighted_mean needs at least one part with positive total weight")
    scales = scales if scales is not None else (1.0,) * len(parts)
    acc = torch.zeros_like(parts[0], dtype=torch.float32)
    for part, weight, scale in zip(parts, weights, scales, strict=True):
        acc.add_(part.to(torch.float32) * (float(weight) / total * scale))
    return acc


@dataclass(frozen=True, slots=True)
class Combined:
    """One chunk's mean and how it was taken (the norms, weights and scales a checker
    needs)."""

    mean: torch.Tensor
    norms: tuple[float, ...]
    weights: tuple[float, ...]
    """The weights the mean was taken with (median-capped unless clipping is off)."""
    scales: tuple[float, ...]

    @property
    def clipped(self) -> list[int]:
        """Positions (in the order given) of the contributions that were scaled down."""
        return [i for i, scale in enumerate(self.scales) if scale < 1.0]


def robust_mean(
    parts: Sequence[torch.Tensor],
    weights: Sequence[float],
    clip_factor: float,
    norms: Sequence[float] | None = None,
) -> Combined:
    """The combine step of one chunk: weights capped at their lower median and norms
    clipped against the lower median (unless ``clip_factor`` is 0), then the FP32
    weighted mean in the given order (module docstring: rules, bound, cost).

    ``norms`` are the parts' chunk norms (``norms.chunk_norm``; computed when None).
    Reducers combine whole chunks; members that check them (``verification``) combine a
    few blocks of ``parts`` with the reducer's signed norms of the whole chunks, and get
    the same bits: every operation here is elementwise and rounded once on every CPU, and
    all that depends on more than one value (the clip scales, the median weight cap)
    depends on the chunk only through ``norms`` and ``weights``.
    """
    if norms is None:
        norms = tuple(chunk_norm(part) for part in parts)
    counted = tuple(map(float, weights)) if clip_factor == 0 else median_capped(weights)
    scales = clip_scales(norms, clip_factor)
    return Combined(weighted_mean(parts, counted, scales), tuple(norms), counted, scales)
