"""The simulator's default bit widths against the paper's own table of required bandwidths.

Expected values are the paper's, not ours: Douillard et al., 2025, "Streaming DiLoCo with
overlapping communication", arXiv:2501.18512v1, appendix Table 4 (Gbit/s to reach a CU of
50/80/90/95/99%; H = 100, fragments of 3 layers, 1B / 10B / 100B with 24 / 48 / 108 layers and
0.1 / 0.8 / 4.9 s per step). Its values sit on a log grid of ratio 1.2068 (390.7, 471.5 and
569.0 are consecutive points), printed with one decimal.
"""

from __future__ import annotations

import itertools

import pytest

from diloco.sim.methods import METHODS, PRESETS, Method, SyncSettings
from diloco.sim.sweep import DEFAULT_TARGETS, bandwidth_grid, cu_curves, required_bandwidth

PAPER_TABLE4: dict[str, dict[Method, tuple[float, ...]]] = {
    "1B": {
        "dp": (86.8, 152.6, 184.2, 222.3, 569.0),
        "diloco": (1.4, 6.2, 13.3, 23.3, 86.8),
        "streaming": (1.4, 5.2, 9.1, 16.0, 28.1),
        "streaming-overlap": (1.4, 4.3, 6.2, 9.1, 11.0),
        "streaming-overlap-fp4": (0.4, 0.9, 1.7, 2.0, 3.0),
    },
    "10B": {
        "dp": (104.8, 222.3, 222.3, 268.3, 471.5),
        "diloco": (1.7, 7.5, 16.0, 33.9, 104.8),
        "streaming": (1.7, 5.2, 9.1, 13.3, 19.3),
        "streaming-overlap": (1.7, 3.6, 5.2, 6.2, 7.5),
        "streaming-overlap-fp4": (0.4, 0.9, 1.4, 1.4, 1.7),
    },
    "100B": {
        "dp": (184.2, 323.8, 390.7, 390.7, 471.5),
        "diloco": (3.0, 11.0, 23.3, 49.4, 184.2),
        "streaming": (2.4, 6.2, 9.1, 11.0, 19.3),
        "streaming-overlap": (1.7, 3.6, 4.3, 5.2, 5.2),
        "streaming-overlap-fp4": (0.5, 0.9, 1.1, 1.1, 1.4),
    },
}
PAPER_GRID_STEP = 1.2068
"""Ratio of consecutive points of the paper's bandwidth grid (471.5 / 390.7)."""
PAPER_ROUNDING = 0.05
"""Half of the last printed digit."""
POINTS_PER_DECADE = 400
GRID = bandwidth_grid(1e-2, 1e4, points_per_decade=POINTS_PER_DECADE)
OUR_GRID_STEP = 10 ** (1 / POINTS_PER_DECADE)
ADJACENT_ROWS: tuple[tuple[Method, Method], ...] = tuple(itertools.pairwise(METHODS))
"""dp/diloco, diloco/streaming, streaming/overlap, overlap/overlap-fp4."""

Table = dict[str, dict[Method, list[float | None]]]


def _table(settings: SyncSettings) -> Table:
    return {
        name: {
            method: required_bandwidth(GRID, cu, DEFAULT_TARGETS)
            for method, cu in cu_curves(model, METHODS, settings, GRID).items()
        }
        for name, model in PRESETS.items()
    }


def _ratio_mismatches(table: Table) -> list[str]:
    """Cells where our ratio between two adjacent rows falls outside what the paper's printed
    values allow: each is the first point of its grid at or above the exact threshold (up to
    one grid step above it), then rounded; ours is the same on a much finer grid."""
    found = []
    for name, rows in table.items():
        for upper, lower in ADJACENT_ROWS:
            for i, target in enumerate(DEFAULT_TARGETS):
                ours_upper, ours_lower = rows[upper][i], rows[lower][i]
                assert ours_upper is not None and ours_lower is not None
                ours = ours_upper / ours_lower
                paper_upper, paper_lower = (
                    PAPER_TABLE4[name][upper][i],
                    PAPER_TABLE4[name][lower][i],
                )
                low = (paper_upper - PAPER_ROUNDING) / (paper_lower + PAPER_ROUNDING)
                high = (paper_upper + PAPER_ROUNDING) / (paper_lower - PAPER_ROUNDING)
                slack = PAPER_GRID_STEP * OUR_GRID_STEP
                if not low / slack < ours < high * slack:
                    found.append(f"{name} {upper}/{lower} at {target:.0%}: ours {ours:.3g}")
    return found


@pytest.fixture(scope="module")
def default_table() -> Table:
    return _table(SyncSettings())


def test_default_widths_are_16_16_4() -> None:
    settings = SyncSettings()
    assert (settings.dp_bits, settings.outer_bits, settings.fp4_bits) == (16, 16, 4)


def test_defaults_give_papers_ratios_between_rows(default_table: Table) -> None:
    # e.g. overlapped FP4 needs about a quarter of overlapped's bandwidth (paper: 3.4-4.8x)
    assert _ratio_mismatches(default_table) == []


def test_fp32_outer_gradients_do_not_give_papers_ratios() -> None:
    # The alternative the paper's rows rule out: FP32 unquantised outer gradients would make
    # DiLoCo cost twice the paper's share of data-parallel and FP4 an eighth of overlapped.
    mismatches = _ratio_mismatches(_table(SyncSettings(outer_bits=32)))
    # every dp/diloco and overlap/fp4 cell: 2 pairs x 5 targets x 3 models
    assert sum("dp/diloco" in m or "overlap/streaming-overlap-fp4" in m for m in mismatches) == 30


def test_defaults_are_within_a_grid_step_of_papers_values(default_table: Table) -> None:
    # Absolute values: within 25% (one step of the paper's grid, 20.7%, plus its rounding).
    for name, rows in default_table.items():
        for method, values in rows.items():
            for ours, paper in zip(values, PAPER_TABLE4[name][method], strict=True):
                assert ours is not None
                assert 1 / 1.25 <= ours / paper <= 1.25, (name, method, ours, paper)
