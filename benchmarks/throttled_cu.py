"""Compute utilisation of a 3-node swarm on throttled links, streaming vs DiLoCo.

Runs ``examples/throttled_swarm.sh`` (three nodes in network namespaces behind ``tc tbf``
links; root) for each rate, method and repeat, keeps each run's metrics under
``--metrics-dir``, and writes a JSON file with, per node, the CU measured over the whole run
and in steady state (``diloco.sim.round_costs.measured_cu``) next to the CU the simulator
predicts from the same node's metrics (``diloco.sim.round_costs.predict_cu``).

    sudo .venv/bin/python benchmarks/throttled_cu.py --steps 300 --repeats 2 \
        --metrics-dir /tmp/throttled_cu \
        --out benchmarks/results/throttled_cu_predicted.json

The per-node metrics and logs are raw run output and stay out of the repository: keep them in
a folder of your own (``--metrics-dir``, required) to rerun ``--analyse`` on them.

``--analyse`` skips the runs and reads the metrics already under ``--metrics-dir``; without it,
runs whose metrics are already kept there are not run again (add repeats to a table).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
from pathlib import Path
from typing import Any

from diloco.bench.provenance import provenance
from diloco.sim.dag import compute_utilisation
from diloco.sim.metrics import measured_schedule, parse_metrics
from diloco.sim.round_costs import measured_cu, predict_cu, read_windows, round_costs

METHODS = {
    "streaming": [],
    "diloco": [
        "--fragment-size",
        "99",
        "--embedding-fragment",
        "first",
        "--tau",
        "0",
        "--codec",
        "none",
    ],
}
"""Streaming: the ``start`` defaults (5 fragments, tau 1, E3M0). DiLoCo: 1 fragment, tau 0,
FP32."""
ROOT = Path(__file__).resolve().parent.parent


def run_swarm(folder: Path, rate: str, steps: int, flags: list[str]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    env = {
        "OUT": str(folder),
        "PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
        "PYTHONPATH": str(ROOT),  # this tree's diloco, whatever the venv points at
    }
    subprocess.run(
        ["bash", str(ROOT / "examples" / "throttled_swarm.sh"), rate, str(steps), *flags],
        env=env,
        check=True,
        timeout=1800,
    )


def analyse(folder: Path) -> dict[str, Any]:
    """Per node: summary CU, measured and predicted CU (whole run, steady state)."""
    nodes = []
    for path in sorted(folder.glob("node*.jsonl")):
        lines = path.read_text().splitlines()
        summary = [json.loads(x) for x in lines if '"summary"' in x]
        measured, predicted = measured_cu(lines), predict_cu(lines)
        run = parse_metrics(lines)  # the old prediction: transfers only, at the observed rate
        compute, plan = measured_schedule(run)
        transfers_only = float(compute_utilisation(compute, plan, [run.observed_gbps])[0])
        nodes.append(
            {
                "node": path.stem,
                "path": str(path),
                "summary_cu": summary[-1]["cu"] if summary else None,
                "failed_rounds": summary[-1]["failed_rounds"] if summary else None,
                "measured": measured.as_dict(),
                "predicted": predicted.as_dict(),
                "transfers_only": transfers_only,
            }
        )
    return {"folder": str(folder), "nodes": nodes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rates", nargs="+", default=["100mbit", "20mbit"])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--metrics-dir", type=Path, required=True)
    parser.add_argument("--analyse", action="store_true", help="read kept metrics, run nothing")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    rows = []
    for rate in args.rates:
        for method in args.methods:
            runs = []
            for repeat in range(args.repeats):
                folder = args.metrics_dir / f"{rate}-{method}-{repeat}"
                if not args.analyse and not list(folder.glob("node*.jsonl")):
                    run_swarm(folder, rate, args.steps, METHODS[method])
                if list(folder.glob("node*.jsonl")):  # --analyse: the runs made so far
                    runs.append(analyse(folder))
            if runs:
                rows.append({"rate": rate, "method": method, "runs": runs})
                print(table_row(rows[-1]), flush=True)
    for row in rows:
        print(cross_line(rows, row), flush=True)
    args.out.write_text(
        json.dumps({"steps": args.steps, "rows": rows, "provenance": provenance()}, indent=1) + "\n"
    )
    os.chmod(args.out, 0o644)


def _rate_mbit(rate: str) -> float:
    units = {"gbit": 1000.0, "mbit": 1.0, "kbit": 1e-3}
    unit = next(u for u in units if rate.endswith(u))
    return float(rate.removesuffix(unit)) * units[unit]


def cross_line(rows: list[dict[str, Any]], row: dict[str, Any]) -> str:
    """Out of sample: each run's CU predicted from the fastest link's run of the same method
    and repeat, node for node, with the fitted rate scaled to the slower link (the link keeps
    its share of the nominal rate; matchmaking, fixed costs, failures as measured there)."""
    fastest = max(
        (r for r in rows if r["method"] == row["method"]), key=lambda r: _rate_mbit(r["rate"])
    )
    scale = _rate_mbit(row["rate"]) / _rate_mbit(fastest["rate"])
    cells = []
    for window in ("whole", "steady"):
        predicted, measured = [], []
        for run, source in zip(row["runs"], fastest["runs"], strict=False):
            for node, other in zip(run["nodes"], source["nodes"], strict=False):
                lines = Path(other["path"]).read_text().splitlines()
                whole, steady, _ = read_windows(lines)
                fitted = round_costs(steady or whole, 1).rate_gbps
                cu = predict_cu(lines, fitted * scale).as_dict()[window]
                predicted.append(float(cu) if cu is not None else math.nan)
                measured.append(float(node["measured"][window]))
        p, m = statistics.fmean(predicted), statistics.fmean(measured)
        cells.append(f"{window}: {100 * p:.1f}% vs {100 * m:.1f}% ({100 * (p - m):+.1f})")
    return f"{row['rate']} {row['method']} from {fastest['rate']}: " + ", ".join(cells)


def _mean_over_nodes(run: dict[str, Any], kind: str, window: str) -> float:
    return statistics.fmean(n[kind][window] for n in run["nodes"])


def table_row(row: dict[str, Any]) -> str:
    """One markdown row: per window, predicted and measured CU (mean over runs of the mean
    over nodes), their difference in points, the measured range over runs and over nodes."""
    cells = [row["rate"], row["method"], str(len(row["runs"]))]
    for window in ("whole", "steady"):
        measured = [_mean_over_nodes(r, "measured", window) for r in row["runs"]]
        predicted = [_mean_over_nodes(r, "predicted", window) for r in row["runs"]]
        nodes = [n["measured"][window] for r in row["runs"] for n in r["nodes"]]
        m, p = statistics.fmean(measured), statistics.fmean(predicted)
        cells += [
            f"{100 * p:.1f}%",
            f"{100 * m:.1f}%",
            f"{100 * (p - m):+.1f}",
            f"{100 * min(measured):.1f}-{100 * max(measured):.1f}",
            f"{100 * min(nodes):.1f}-{100 * max(nodes):.1f}",
        ]
    old = statistics.fmean(
        statistics.fmean(n["transfers_only"] for n in r["nodes"]) for r in row["runs"]
    )
    cells.append(f"{100 * old:.1f}%")
    return "| " + " | ".join(cells) + " |"


if __name__ == "__main__":
    main()
