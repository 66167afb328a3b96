"""Figures of the simulator: CU against bandwidth, and a Gantt chart of a few steps.

The one module of ``diloco.sim`` that writes files: PNG through matplotlib's ``Agg`` canvas
on a bare ``Figure``, so it needs no display and leaves pyplot's global state alone.
matplotlib is the optional extra ``plots`` and is imported only when a figure is drawn, so
the simulator itself runs without it. Each function returns the figure it saved, for
callers (and tests) that want to read what was drawn.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import NDArray

from diloco.sim.dag import Interval, NodeKind

if TYPE_CHECKING:
    from matplotlib.figure import Figure

PLOTS_EXTRA = "pip install 'diloco-node[plots]'"


class PlotsUnavailable(ImportError):
    """matplotlib is not installed; the message names the extra that brings it."""


def require_matplotlib() -> None:
    """Raise ``PlotsUnavailable`` unless matplotlib can be imported."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as error:
        raise PlotsUnavailable(f"figures need matplotlib: {PLOTS_EXTRA}") from error


def _new_figure(width: float, height: float) -> Figure:
    """A bare figure on an Agg canvas, 120 dpi."""
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=120)
    FigureCanvasAgg(fig)
    return fig


KIND_STYLE: dict[NodeKind, tuple[str, str]] = {
    "forward": ("tab:blue", "forward"),
    "backward_activation": ("tab:orange", "backward (activations)"),
    "backward_weight": ("tab:green", "backward (weights)"),
    "reduction": ("tab:red", "reduction (link)"),
}


def plot_cu_curves(
    path: str | Path,
    bandwidths_gbps: NDArray[np.float64],
    curves: Mapping[str, NDArray[np.float64]],
    *,
    title: str,
    targets: Sequence[float] = (),
) -> Figure:
    """CU against bandwidth (log x), one curve per method; dotted lines at the CU targets."""
    fig = _new_figure(8, 5)
    ax = fig.subplots()
    for name, cu in curves.items():
        ax.plot(bandwidths_gbps, cu, label=name, linewidth=2)
    for target in targets:
        ax.axhline(target, color="grey", linestyle=":", linewidth=1)
    ax.set_xscale("log")
    # Show where something happens: from the first CU of 1% to the last below 99.9%.
    stacked = np.stack(list(curves.values()))  # (methods, B)
    busy = np.nonzero(np.any((stacked >= 0.01) & (stacked < 0.999), axis=0))[0]
    if busy.size:
        ax.set_xlim(bandwidths_gbps[busy[0]] / 2, bandwidths_gbps[busy[-1]] * 2)
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("bandwidth between replicas (Gbit/s)")
    ax.set_ylabel("compute utilisation")
    ax.set_title(title)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    return fig


def plot_timeline(
    path: str | Path, timelines: Mapping[str, Sequence[Interval]], *, title: str
) -> Figure:
    """Gantt chart, one panel per method: a row per layer (layer 0 at the top); compute on
    the upper part of a row, the layer's reduction on the lower part; dashed lines where a
    step's first forward starts."""
    if not timelines or not all(timelines.values()):
        raise ValueError("nothing to draw: every timeline needs intervals")
    fig = _new_figure(11, 1.2 + 2.4 * len(timelines))
    from matplotlib.patches import Patch

    axes = fig.subplots(len(timelines), 1, squeeze=False)
    for ax, (name, intervals) in zip(axes[:, 0], timelines.items(), strict=True):
        num_layers = 1 + max(interval.layer for interval in intervals)
        for kind, (color, _label) in KIND_STYLE.items():
            offset, height = (0.5, 0.4) if kind == "reduction" else (0.05, 0.45)
            for layer in range(num_layers):
                spans = [
                    (i.start, i.end - i.start)
                    for i in intervals
                    if i.kind == kind and i.layer == layer
                ]
                if spans:
                    ax.broken_barh(spans, (layer + offset, height), facecolors=color)
        for step in sorted({i.step for i in intervals}):
            start = min(i.start for i in intervals if i.step == step and i.kind == "forward")
            ax.axvline(start, color="black", linewidth=0.6, linestyle="--")
            ax.text(start, -0.05, f" step {step}", fontsize=8, va="bottom")
        ax.set_yticks([layer + 0.45 for layer in range(num_layers)], list(range(num_layers)))
        ax.set_ylim(num_layers + 0.05, -0.5)
        ax.set_ylabel("layer")
        ax.set_title(name, fontsize=10, loc="left")
    axes[-1, 0].set_xlabel("time (s)")
    handles = [Patch(color=color, label=label) for color, label in KIND_STYLE.values()]
    fig.legend(handles=handles, loc="upper right", ncols=4, fontsize=8)
    fig.suptitle(title, x=0.02, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path)
    return fig
