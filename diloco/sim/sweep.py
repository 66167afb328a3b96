"""CU against bandwidth, and the lowest bandwidth that reaches a CU target (docs/design.md "The
simulator").

The paper's table of required bandwidths (Douillard et al., 2025, arXiv:2501.18512) reads each
method's CU curve at 50/80/90/95/99% CU; here the curve is evaluated on a log grid in one
vectorised pass (``diloco.sim.dag``) and the answer is the first grid point at or above the
target, so it is exact up to the grid's resolution (``10 ** (1 / points_per_decade)``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
from numpy.typing import NDArray

from diloco.sim.dag import compute_utilisation
from diloco.sim.methods import Method, ModelSpec, SyncSettings, step_compute, sync_plan

DEFAULT_TARGETS = (0.5, 0.8, 0.9, 0.95, 0.99)


def bandwidth_grid(
    low_gbps: float = 1e-2, high_gbps: float = 1e4, points_per_decade: int = 40
) -> NDArray[np.float64]:
    """Log-spaced bandwidths in Gbit/s, both ends included."""
    if not 0 < low_gbps < high_gbps or points_per_decade < 1:
        raise ValueError("need 0 < low < high and points_per_decade >= 1")
    decades = np.log10(high_gbps / low_gbps)
    num = round(decades * points_per_decade) + 1
    return np.logspace(np.log10(low_gbps), np.log10(high_gbps), num)


def cu_curves(
    model: ModelSpec,
    methods: Iterable[Method],
    settings: SyncSettings,
    bandwidths_gbps: Sequence[float] | NDArray[np.float64],
) -> dict[Method, NDArray[np.float64]]:
    """CU of each method at each bandwidth, ``(B,)`` per method."""
    compute = step_compute(model)
    return {
        method: compute_utilisation(compute, sync_plan(model, method, settings), bandwidths_gbps)
        for method in methods
    }


def required_bandwidth(
    bandwidths_gbps: NDArray[np.float64], cu: NDArray[np.float64], targets: Sequence[float]
) -> list[float | None]:
    """For each target CU, the lowest grid bandwidth whose CU reaches it (``None``: none does).

    CU rises with bandwidth (a tested invariant), so the first grid point that reaches the
    target is the answer.
    """
    if any(not 0 < target <= 1 for target in targets):
        raise ValueError(f"CU targets must be in (0, 1], got {list(targets)}")
    found: list[float | None] = []
    for target in targets:
        reached = np.nonzero(cu >= target)[0]
        found.append(float(bandwidths_gbps[reached[0]]) if reached.size else None)
    return found
