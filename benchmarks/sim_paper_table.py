"""Issue 5: the paper's required-bandwidth table, CU figures and the simulator's speed.

For the 1B / 10B / 100B presets, sweeps every method over a log grid of bandwidths, prints a
markdown table of the lowest Gbit/s that reaches each CU target (with the DP / FP4 ratio),
writes one CU-against-bandwidth PNG per preset and a schedule Gantt chart, and times the
sweeps.

    python benchmarks/sim_paper_table.py --figures benchmarks/figures
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from diloco.sim.commands import timeline
from diloco.sim.methods import METHODS, PRESETS, ModelSpec, SyncSettings, step_compute, sync_plan
from diloco.sim.plots import plot_cu_curves, plot_timeline
from diloco.sim.sweep import DEFAULT_TARGETS, bandwidth_grid, cu_curves, required_bandwidth


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def table(settings: SyncSettings, figures: Path | None) -> list[str]:
    """Markdown rows of required Gbit/s for every preset and method."""
    grid = bandwidth_grid(1e-4, 1e5)
    rows = [
        "| model | method | " + " | ".join(f"{t:.0%} CU" for t in DEFAULT_TARGETS) + " |",
        "| --- | --- |" + " --- |" * len(DEFAULT_TARGETS),
    ]
    for name, model in PRESETS.items():
        curves = cu_curves(model, METHODS, settings, grid)
        needed = {m: required_bandwidth(grid, cu, DEFAULT_TARGETS) for m, cu in curves.items()}
        for method, values in needed.items():
            rows.append(f"| {name} | {method} | " + " | ".join(map(_cell, values)) + " |")
        ratios = [
            _cell(dp / fp4) if dp is not None and fp4 is not None else "-"
            for dp, fp4 in zip(needed["dp"], needed["streaming-overlap-fp4"], strict=True)
        ]
        rows.append(f"| {name} | **dp / fp4** | " + " | ".join(ratios) + " |")
        if figures is not None:
            plot_cu_curves(
                figures / f"sim_cu_{name}.png",
                grid,
                curves,
                title=f"{name} ({model.num_layers} layers, {model.step_seconds:g} s/step), "
                f"H={settings.sync_every}, tau={settings.tau}, M={settings.num_replicas}",
                targets=DEFAULT_TARGETS,
            )
    return rows


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
    args = parser.parse_args()
    settings = SyncSettings(tau=args.tau)
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
