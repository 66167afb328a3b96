"""The paper's required-bandwidth table, CU figures, the simulator's speed.

For the 1B / 10B / 100B presets, sweeps every method over a log grid of bandwidths, prints a
markdown table of the lowest Gbit/s that reaches each CU target next to the paper's value
(arXiv:2501.18512v1, Table 4; ``diloco.sim.paper``) with the range of ours / paper per row,
the ratios between rows against the paper's, writes one CU-against-bandwidth PNG per preset
and a schedule Gantt chart, and times the sweeps. Bit widths default to the simulator's
(dp 16, outer 16, fp4 4).

    python benchmarks/sim_paper_table.py --figures benchmarks/figures
    python benchmarks/sim_paper_table.py --outer-bits 32     # the earlier FP32 rows
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from diloco.node.observe.traffic import DP_BITS
from diloco.sim.commands import timeline
from diloco.sim.methods import (
    FP4_BITS,
    METHODS,
    OUTER_BITS,
    PRESETS,
    Method,
    ModelSpec,
    SyncSettings,
    step_compute,
    sync_plan,
)
from diloco.sim.paper import PAPER_TABLE4, PAPER_TARGETS
from diloco.sim.plots import plot_cu_curves, plot_timeline
from diloco.sim.sweep import bandwidth_grid, cu_curves, required_bandwidth

TABLE_GRID = bandwidth_grid(1e-4, 1e5, points_per_decade=100)
"""Log grid of the tables: 2.3% steps, so a value is at most 2.3% above the exact threshold."""
PAIRS: tuple[tuple[Method, Method], ...] = (
    ("dp", "diloco"),
    ("diloco", "streaming"),
    ("streaming", "streaming-overlap"),
    ("streaming-overlap", "streaming-overlap-fp4"),
    ("dp", "streaming-overlap-fp4"),
)
SHORT = {
    "dp": "dp",
    "diloco": "diloco",
    "streaming": "str",
    "streaming-overlap": "ovl",
    "streaming-overlap-fp4": "fp4",
}


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a / b


def table(settings: SyncSettings, figures: Path | None) -> list[str]:
    """Markdown rows of required Gbit/s (ours / the paper's) for every preset and method, then
    the ratios between rows, ours against the paper's."""
    targets = PAPER_TARGETS
    header = "| model | method | " + " | ".join(f"{t:.0%} CU" for t in targets)
    rows = [
        header + " | ours / paper |",
        "| --- | --- |" + " --- |" * (len(targets) + 1),
    ]
    ratio_rows = [
        "| model | rows | " + " | ".join(f"{t:.0%}" for t in targets) + " |",
        "| --- | --- |" + " --- |" * len(targets),
    ]
    for name, model in PRESETS.items():
        curves = cu_curves(model, METHODS, settings, TABLE_GRID)
        needed = {m: required_bandwidth(TABLE_GRID, cu, targets) for m, cu in curves.items()}
        paper = PAPER_TABLE4[name]
        for method, values in needed.items():
            cells = [f"{_cell(v)} / {p:g}" for v, p in zip(values, paper[method], strict=True)]
            ratios = [r for v, p in zip(values, paper[method], strict=True) if (r := _ratio(v, p))]
            spread = f"{min(ratios):.2f}-{max(ratios):.2f}" if ratios else "-"
            rows.append(f"| {name} | {method} | " + " | ".join(cells) + f" | {spread} |")
        for upper, lower in PAIRS:
            cells = [
                f"{_cell(_ratio(a, b))} / {pa / pb:.3g}"
                for a, b, pa, pb in zip(
                    needed[upper], needed[lower], paper[upper], paper[lower], strict=True
                )
            ]
            label = f"{SHORT[upper]} / {SHORT[lower]}"
            ratio_rows.append(f"| {name} | {label} | " + " | ".join(cells) + " |")
        if figures is not None:
            plot_cu_curves(
                figures / f"sim_cu_{name}.png",
                TABLE_GRID,
                curves,
                title=f"{name} ({model.num_layers} layers, {model.step_seconds:g} s/step), "
                f"H={settings.sync_every}, tau={settings.tau}, M={settings.num_replicas}, "
                f"bits dp/outer/fp4 {settings.dp_bits:g}/{settings.outer_bits:g}/"
                f"{settings.fp4_bits:g}",
                targets=targets,
            )
    return [*rows, "", "Ratios between rows, ours / the paper's:", "", *ratio_rows]


def sweep_seconds(model: ModelSpec, settings: SyncSettings, repeats: int = 5) -> float:
    """Median seconds to get CU of all five methods at every grid bandwidth."""
    grid = bandwidth_grid(1e-4, 1e5)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        cu_curves(model, METHODS, settings, grid)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--figures", type=Path, default=None, help="Folder for the PNG files.")
    parser.add_argument("--tau", type=int, default=1)
    parser.add_argument("--dp-bits", type=float, default=DP_BITS, help="Data-parallel bits.")
    parser.add_argument("--outer-bits", type=float, default=OUTER_BITS, help="Unquantised bits.")
    parser.add_argument("--fp4-bits", type=float, default=FP4_BITS, help="Quantised bits.")
    args = parser.parse_args()
    settings = SyncSettings(
        tau=args.tau, dp_bits=args.dp_bits, outer_bits=args.outer_bits, fp4_bits=args.fp4_bits
    )
    print("\n".join(table(settings, args.figures)))

    if args.figures is not None:
        small = ModelSpec(name="6-layer example", num_layers=6, num_params=6e8, step_seconds=1.0)
        small_settings = SyncSettings(sync_every=8, fragment_size=2, tau=1)
        plot_timeline(
            args.figures / "sim_timeline.png",
            {
                m: timeline(step_compute(small), sync_plan(small, m, small_settings), 2.0)
                for m in METHODS
            },
            title="6 layers, 1 s/step, 1e8 parameters per layer, H=8, fragments of 2 "
            "(strided), tau=1, 2 Gbit/s",
        )

    num_points = len(bandwidth_grid(1e-4, 1e5))
    for name in ("100B",):
        seconds = sweep_seconds(PRESETS[name], settings)
        print(f"\nsweep {name}, 5 methods x {num_points} bandwidths: {seconds:.3f} s (median of 5)")


if __name__ == "__main__":
    main()
