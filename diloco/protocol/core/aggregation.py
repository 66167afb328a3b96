"""How members' contributions combine into a round's mean: weight caps and norm clipping.

Pure arithmetic shared by every transport: ``PartReducer.average`` (the swarm's reducers)
and ``InProcessReducer`` (``diloco-node local``) call ``robust_mean`` on the same chunks
(``reduction.chunk_spans``), so both give the same bits. Two rules bound what one member
can do to the mean (issue 11, attack 3 "own the mean by weight"):

* **Weight cap.** A member's weight (tokens since its last sync of the fragment, plus the
  weight carried from failed rounds, SPEC 2.4) counts at most ``max_weight`` tokens, a
  value of the run configuration. Every honest node clamps its own weight
  (``cap_weight``); matchmaking refuses a JOIN or GROUP over the cap, and reducers clamp
  again (``cap_weights``) whatever they are given.
* **Norm clipping** (per chunk, against the median; "Secure Distributed Training at
  Scale", Gorbunov et al. 2022, clip the outliers rather than average them): contribution
  ``i`` is scaled by ``min(1, C * ref / norm_i)``, where ``ref`` is the *lower* median of
  the counted members' chunk norms (``sorted(norms)[(m - 1) // 2]``: with two members the
  smaller norm, so one member alone never sets the reference above the other's) and ``C``
  is ``clip_factor`` (0 disables clipping). Scaled contributions keep their weight in the
  denominator, so clipping only ever shrinks a contribution.

**Bound.** With counted weights ``w_i`` (each at most ``max_weight``) and ``W = sum(w_i)``,
a member ``a`` enters every chunk of the mean as ``(w_a / W) * s_a * x_a`` with
``||s_a * x_a|| <= C * ref``: at most ``max_weight / (max_weight + W_others)`` of the weight
and a norm of at most ``C * ref`` per chunk, whatever weight or values it sends. With
``M >= 3`` members ``ref`` is the norm of an honest member's chunk or lies between two
honest ones; with two members a liar can shrink ``ref`` (and so the other's contribution)
but never enlarge its own. A zero ``ref`` (half the members sent zeros) clips nothing, as
a zero own norm bounds nothing in ``reduction.check_values``: the weight cap and the
reducer's ``max_norm_ratio`` check remain.

**Cost on honest runs.** When no chunk norm exceeds ``C * ref`` every scale is exactly 1.0
and the float operations are those of the plain weighted mean, bit for bit. Honest
members' deltas over the same H steps have similar norms; what can exceed ``C`` times the
median is a member whose delta spans several failed rounds (its weight carries them too).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from diloco.protocol.core.norms import chunk_norm

CLIP_FACTOR = 3.0
"""Default C. Measured on honest ``diloco-node local`` runs (benchmarks/RESULTS.md, "Trust";
2 and 4 replicas, 2 seeds, 300 steps): a member's chunk norm reached at most 2.65 times the
lower median, so C = 3 never clipped (results bit-identical to the plain mean) while C = 2
clipped 4 of 2,944 contributions. A member whose delta spans a failed round has about
twice the others' norm, which C = 3 also leaves alone."""


def cap_weight(weight: float, max_weight: float) -> float:
    """``weight`` clamped to the run's cap (``max_weight`` tokens; ``inf``: no cap)."""
    return min(float(weight), max_weight)


def cap_weights(weights: Sequence[float], max_weight: float) -> tuple[float, ...]:
    """Every weight clamped to the cap; weights within it are returned unchanged."""
    return tuple(cap_weight(w, max_weight) for w in weights)


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
    ref = sorted(norms)[(len(norms) - 1) // 2]
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
    """One chunk's mean and how it was taken (the norms and scales a checker needs)."""

    mean: torch.Tensor
    norms: tuple[float, ...]
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
    """The combine step of one chunk: norm clipping against the lower median, then the
    FP32 weighted mean in the given order (module docstring: rules, bound, cost).

    ``norms`` are the parts' chunk norms (``norms.chunk_norm``; computed when None).
    Reducers combine whole chunks; members that check them (``verification``) combine a
    few blocks of ``parts`` with the reducer's signed norms of the whole chunks, and get
    the same bits: every operation here is elementwise and rounded once on every CPU, and
    all that depends on more than one value (the clip scales) depends on the chunk only
    through ``norms``.
    """
    if norms is None:
        norms = tuple(chunk_norm(part) for part in parts)
    scales = clip_scales(norms, clip_factor)
    return Combined(weighted_mean(parts, weights, scales), tuple(norms), scales)
