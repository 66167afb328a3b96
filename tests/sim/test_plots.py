"""The figures are written as PNG files of the expected size."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from matplotlib.image import imread

from diloco.sim.dag import Interval
from diloco.sim.plots import plot_cu_curves, plot_timeline


def test_plot_cu_curves_writes_png(tmp_path: Path) -> None:
    path = tmp_path / "cu.png"
    grid = np.logspace(-1, 2, 7)
    plot_cu_curves(
        path,
        grid,
        {"dp": grid / (grid + 10), "diloco": grid / (grid + 1)},
        title="t",
        targets=(0.5, 0.9),
    )
    image = imread(path)
    assert image.shape[:2] == (600, 960)  # 8 x 5 inches at 120 dpi


def test_plot_timeline_writes_one_panel_per_method(tmp_path: Path) -> None:
    path = tmp_path / "timeline.png"
    intervals = [
        Interval("forward", 0, 1, 0.0, 1.0),
        Interval("backward_weight", 0, 1, 1.0, 2.0),
        Interval("reduction", 0, 1, 2.0, 3.0),
    ]
    plot_timeline(path, {"a": intervals, "b": intervals}, title="t")
    assert imread(path).shape[:2] == (720, 1320)  # (1.2 + 2.4 * 2) x 11 inches at 120 dpi


def test_plot_timeline_empty_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="nothing to draw"):
        plot_timeline(tmp_path / "t.png", {"a": []}, title="t")
