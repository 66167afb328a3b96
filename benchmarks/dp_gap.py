"""How the gap between Streaming DiLoCo and data-parallel closes with training.

Reads the JSON files that ``local_methods.py`` wrote for ``dp`` and ``streaming`` runs
(2 replicas, one run length each), prints a markdown table of the eval losses and the gap
``streaming / dp - 1`` against tokens, and plots the gap against tokens.

    for n in 300 1200 4800; do for m in dp streaming; do
      nice -n 10 python benchmarks/local_methods.py --methods $m --replicas 2 --steps $n \
        --seeds 0 --inner-lr 1e-3 --warmup 30 --outer-lr 0.7 --outer-momentum 0.9 \
        --eval-batches 32 --out benchmarks/results/gap_${m}_${n}.json
    done; done
    python benchmarks/dp_gap.py benchmarks/results/gap_*.json \
        --figure benchmarks/figures/dp_gap.png
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from diloco.sim.plots import require_matplotlib


def gaps(paths: list[Path]) -> list[dict[str, Any]]:
    """One row per (replicas, steps, seed) that has both a dp and a streaming run."""
    runs: dict[tuple[int, int, int], dict[str, dict[str, Any]]] = defaultdict(dict)
    for path in paths:
        data = json.loads(path.read_text())
        for r in data["results"]:
            method = r["label"].split()[0]
            runs[(int(r["replicas"]), int(r["steps"]), int(r["seed"]))][method] = r
    rows = []
    for (replicas, steps, seed), by in sorted(runs.items()):
        if "dp" in by and "streaming" in by:
            dp, st = by["dp"]["eval_loss"], by["streaming"]["eval_loss"]
            rows.append(
                {
                    "replicas": replicas,
                    "steps": steps,
                    "seed": seed,
                    "tokens": by["streaming"]["tokens"],
                    "dp": dp,
                    "streaming": st,
                    "gap_pct": 100 * (st / dp - 1),
                    "rounds_pending": by["streaming"].get("rounds_pending"),
                }
            )
    return rows


def plot(rows: list[dict[str, Any]], figure: Path) -> None:
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_steps: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        by_steps[r["steps"]].append(r)
    points = sorted(
        (runs[0]["tokens"], sum(r["gap_pct"] for r in runs) / len(runs), steps)
        for steps, runs in by_steps.items()
    )
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    ax.plot([r["tokens"] for r in rows], [r["gap_pct"] for r in rows], "x", color="grey")
    ax.plot([p[0] for p in points], [p[1] for p in points], "o-", label="mean over seeds")
    for tokens, gap, steps in points:
        ax.annotate(f"{steps} steps", (tokens, gap), fontsize=8,
                    textcoords="offset points", xytext=(4, 4))  # fmt: skip
    ax.legend(fontsize=8)
    ax.set_xscale("log")
    ax.axhline(0, color="grey", linewidth=0.8)
    ax.set_xlabel("tokens (both replicas)")
    ax.set_ylabel("eval loss gap to data-parallel (%)")
    ax.set_title("Streaming DiLoCo vs data-parallel, 2 replicas, tiny")
    fig.tight_layout()
    figure.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(figure, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("paths", type=Path, nargs="+")
    parser.add_argument("--figure", type=Path, default=None)
    parser.add_argument("--replicas", type=int, default=2)
    args = parser.parse_args()
    rows = [r for r in gaps(args.paths) if r["replicas"] == args.replicas]
    print("| M | steps | tokens | seed | dp | streaming | gap |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['replicas']} | {r['steps']} | {r['tokens'] / 1e6:.2f}M | {r['seed']} "
            f"| {r['dp']:.4f} "
            f"| {r['streaming']:.4f} | {r['gap_pct']:+.1f}% |"
        )
    if args.figure:
        plot(rows, args.figure)


if __name__ == "__main__":
    main()
