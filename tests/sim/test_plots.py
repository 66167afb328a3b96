"""The figures show the data they are given: artists checked against hand-written values,
and the saved PNG checked for the right colour at the right pixel."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from matplotlib.axes import Axes
from matplotlib.colors import to_hex, to_rgb
from matplotlib.image import imread

from diloco.sim.commands import SimulateRequest, simulate_report
from diloco.sim.dag import Interval
from diloco.sim.plots import PlotsUnavailable, plot_cu_curves, plot_timeline

GRID = np.array([0.01, 0.1, 1.0, 10.0, 100.0, 1000.0])
# "a" does something only at 1 Gbit/s (0.9995 counts as done); "b" from 0.1 to 10 Gbit/s.
CURVES = {
    "a": np.array([0.0, 0.005, 0.5, 0.9995, 1.0, 1.0]),
    "b": np.array([0.0, 0.02, 0.7, 0.99, 1.0, 1.0]),
}

# Two layers, two steps (times in seconds): F0 F1 Ba1 Bw1 Bw0, reductions R1 then R0.
TIMELINE = [
    Interval("forward", 0, 1, 0.0, 1.0),
    Interval("forward", 1, 1, 1.0, 2.0),
    Interval("backward_activation", 1, 1, 2.0, 3.0),
    Interval("backward_weight", 1, 1, 3.0, 4.0),
    Interval("backward_weight", 0, 1, 4.0, 5.0),
    Interval("reduction", 1, 1, 4.0, 6.0),
    Interval("reduction", 0, 1, 6.0, 8.0),
    Interval("forward", 0, 2, 8.0, 9.0),
]
BLUE, ORANGE, GREEN, RED = "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728"  # tab: colours


def pixel_has_colour(png: Path, ax: Axes, x: float, y: float, colour: str) -> bool:
    """Whether the saved image has ``colour`` within 2 pixels of data point ``(x, y)``."""
    image = imread(png)[:, :, :3]  # (H, W, RGB) in [0, 1]
    px, py = ax.transData.transform((x, y))
    row, col = image.shape[0] - round(float(py)), round(float(px))
    window = image[row - 2 : row + 3, col - 2 : col + 3].reshape(-1, 3)
    return bool((np.abs(window - np.array(to_rgb(colour))).max(axis=1) < 0.02).any())


def test_plot_cu_curves_draws_each_curve_targets_and_busy_range(tmp_path: Path) -> None:
    path = tmp_path / "cu.png"
    fig = plot_cu_curves(path, GRID, CURVES, title="the title", targets=(0.5, 0.9))
    (ax,) = fig.axes
    curves = {line.get_label(): line for line in ax.lines if line.get_label() in CURVES}
    assert list(curves) == ["a", "b"]
    for name, line in curves.items():
        assert np.array_equal(line.get_xdata(), GRID)
        assert np.array_equal(line.get_ydata(), CURVES[name])
    assert to_hex(curves["a"].get_color()) == BLUE
    assert to_hex(curves["b"].get_color()) == ORANGE
    flat = sorted({float(line.get_ydata()[0]) for line in ax.lines if line not in curves.values()})
    assert flat == [0.5, 0.9]
    assert ax.get_xscale() == "log"
    # The busy points are 0.1 .. 10 Gbit/s (b's 0.02 .. 0.99): half the first, twice the last.
    assert ax.get_xlim() == pytest.approx((0.05, 20.0))
    assert ax.get_xlabel() == "bandwidth between replicas (Gbit/s)"
    assert ax.get_ylabel() == "compute utilisation"
    assert ax.get_title() == "the title"
    legend = ax.get_legend()
    assert legend is not None and [t.get_text() for t in legend.get_texts()] == ["a", "b"]
    # The PNG: a's line passes through (1 Gbit/s, 0.5), b's through (1 Gbit/s, 0.7).
    assert pixel_has_colour(path, ax, 1.0, 0.5, BLUE)
    assert pixel_has_colour(path, ax, 1.0, 0.7, ORANGE)
    assert not pixel_has_colour(path, ax, 1.0, 0.3, BLUE)


def _bars(ax: Axes) -> set[tuple[str, float, float, float, float]]:
    """Every bar as (colour, start, end, bottom, top) in data coordinates."""
    bars = set()
    for collection in ax.collections:
        colour = to_hex(collection.get_facecolor()[0])
        for path in collection.get_paths():
            (x0, y0), (x1, y1) = path.vertices.min(axis=0), path.vertices.max(axis=0)
            bars.add((colour, float(x0), float(x1), round(float(y0), 6), round(float(y1), 6)))
    return bars


def test_plot_timeline_draws_every_interval_in_its_row(tmp_path: Path) -> None:
    path = tmp_path / "timeline.png"
    fig = plot_timeline(path, {"first": TIMELINE, "second": TIMELINE[:5]}, title="gantt")
    first, second = fig.axes
    # Compute on the upper part of a layer's row (layer + 0.05 .. + 0.5), reduction below.
    assert _bars(first) == {
        (BLUE, 0.0, 1.0, 0.05, 0.5),
        (BLUE, 1.0, 2.0, 1.05, 1.5),
        (BLUE, 8.0, 9.0, 0.05, 0.5),
        (ORANGE, 2.0, 3.0, 1.05, 1.5),
        (GREEN, 3.0, 4.0, 1.05, 1.5),
        (GREEN, 4.0, 5.0, 0.05, 0.5),
        (RED, 4.0, 6.0, 1.5, 1.9),
        (RED, 6.0, 8.0, 0.5, 0.9),
    }
    assert len(_bars(second)) == 5
    assert [line.get_xdata()[0] for line in first.lines] == [0.0, 8.0]  # each step's start
    assert [text.get_text() for text in first.texts] == [" step 1", " step 2"]
    assert [first.get_title(loc="left"), second.get_title(loc="left")] == ["first", "second"]
    assert [label.get_text() for label in first.get_yticklabels()] == ["0", "1"]
    assert second.get_xlabel() == "time (s)"
    (legend,) = fig.legends
    assert [t.get_text() for t in legend.get_texts()] == [
        "forward",
        "backward (activations)",
        "backward (weights)",
        "reduction (link)",
    ]
    # The PNG: the middle of R0 is red, of step 2's F0 blue; nothing is drawn at 6.5 s row 0.
    assert pixel_has_colour(path, first, 7.0, 0.7, RED)
    assert pixel_has_colour(path, first, 8.5, 0.3, BLUE)
    assert not pixel_has_colour(path, first, 7.0, 0.3, BLUE)


def test_plot_timeline_empty_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="nothing to draw"):
        plot_timeline(tmp_path / "t.png", {"a": []}, title="t")


def test_plots_without_matplotlib_name_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now fails
    with pytest.raises(PlotsUnavailable, match=r"pip install 'diloco-node\[plots\]'"):
        plot_cu_curves(tmp_path / "cu.png", GRID, CURVES, title="t")
    request = SimulateRequest(model="1B", plot_path=str(tmp_path / "cu.png"))
    with pytest.raises(ValueError, match=r"--plot and --timeline: .*diloco-node\[plots\]"):
        simulate_report(request)
    assert not (tmp_path / "cu.png").exists()


def test_simulator_and_its_commands_import_without_matplotlib() -> None:
    code = (
        "import sys; import diloco.sim.commands, diloco.sim.plots; "
        "assert 'matplotlib' not in sys.modules, 'matplotlib imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
