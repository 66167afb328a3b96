"""Required bandwidths: the grid search and the paper's headline table shape (docs/design.md "The
simulator")."""

from __future__ import annotations

import numpy as np
import pytest

from diloco.sim.methods import METHODS, PRESETS, SyncSettings
from diloco.sim.sweep import DEFAULT_TARGETS, bandwidth_grid, cu_curves, required_bandwidth


def test_bandwidth_grid_is_log_spaced_with_both_ends() -> None:
    grid = bandwidth_grid(1e-2, 1e3, points_per_decade=10)
    assert grid.shape == (51,)
    assert grid[0] == pytest.approx(1e-2)
    assert grid[-1] == pytest.approx(1e3)
    np.testing.assert_allclose(grid[1:] / grid[:-1], 10**0.1)


def test_required_bandwidth_takes_first_grid_point_reaching_target() -> None:
    grid = np.array([1.0, 2.0, 4.0, 8.0])
    cu = np.array([0.2, 0.5, 0.9, 0.95])
    assert required_bandwidth(grid, cu, [0.1, 0.5, 0.6, 0.95, 0.99]) == [1.0, 2.0, 4.0, 8.0, None]


def test_required_bandwidth_bad_target_is_refused() -> None:
    with pytest.raises(ValueError, match="targets"):
        required_bandwidth(np.array([1.0]), np.array([0.5]), [1.5])


@pytest.fixture(scope="module")
def paper_table() -> dict[str, dict[str, list[float | None]]]:
    grid = bandwidth_grid(1e-3, 1e4, points_per_decade=20)
    table = {}
    for name, model in PRESETS.items():
        curves = cu_curves(model, METHODS, SyncSettings(), grid)
        table[name] = {m: required_bandwidth(grid, cu, DEFAULT_TARGETS) for m, cu in curves.items()}
    return table


def test_paper_table_data_parallel_needs_hundreds_of_gbits(
    paper_table: dict[str, dict[str, list[float | None]]],
) -> None:
    for name, rows in paper_table.items():
        at_95, at_99 = rows["dp"][3], rows["dp"][4]
        assert at_95 is not None and at_99 is not None
        # hundreds of Gbit/s (the paper: on the order of 100-600)
        assert 100 <= at_95 <= at_99 <= 1000, name


def test_paper_table_streaming_overlap_fp4_needs_a_few_gbits(
    paper_table: dict[str, dict[str, list[float | None]]],
) -> None:
    for name, rows in paper_table.items():
        at_95, at_99 = rows["streaming-overlap-fp4"][3], rows["streaming-overlap-fp4"][4]
        assert at_95 is not None and at_99 is not None
        assert 0.5 <= at_95 <= at_99 <= 5, name
        # about two orders of magnitude below data-parallel
        dp_95 = rows["dp"][3]
        assert dp_95 is not None
        assert 50 <= dp_95 / at_95 <= 500, name


def test_paper_table_rows_rise_with_target(
    paper_table: dict[str, dict[str, list[float | None]]],
) -> None:
    for rows in paper_table.values():
        for method, values in rows.items():
            assert None not in values, method
            assert values == sorted(values), method  # type: ignore[type-var]
