"""The simulator's default bit widths against the paper's own table of required bandwidths.

Expected values are the paper's (``diloco.sim.paper``: arXiv:2501.18512v1, appendix Table 4,
transcribed), not computed by our code.
"""

from __future__ import annotations

import itertools

import pytest

from diloco.sim.methods import METHODS, PRESETS, Method, SyncSettings
from diloco.sim.paper import PAPER_GRID_STEP, PAPER_TABLE4, PAPER_TARGETS
from diloco.sim.sweep import bandwidth_grid, cu_curves, required_bandwidth

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
            method: required_bandwidth(GRID, cu, PAPER_TARGETS)
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
            for i, target in enumerate(PAPER_TARGETS):
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
