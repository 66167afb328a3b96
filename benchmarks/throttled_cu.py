"""Compute utilisation of a 3-node swarm on throttled links (issue 4), streaming vs DiLoCo.

Runs ``examples/throttled_swarm.sh`` (three nodes in network namespaces behind ``tc tbf``
links; root) for each rate and method, reads each node's summary, and writes a JSON file
and a markdown table.

    sudo .venv/bin/python benchmarks/throttled_cu.py --steps 300 \
        --out benchmarks/results/throttled_cu.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

METHODS = {
    "streaming (tau 1, e3m0)": [],
    "diloco (1 fragment, tau 0, none)": [
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


def summaries(folder: Path) -> list[dict]:
    found = []
    for path in sorted(folder.glob("node*.jsonl")):
        records = [json.loads(line) for line in path.read_text().splitlines() if line]
        found += [r for r in records if r.get("event") == "summary"]
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rates", nargs="+", default=["1gbit", "100mbit", "20mbit"])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    script = Path(__file__).resolve().parent.parent / "examples" / "throttled_swarm.sh"
    rows = []
    for rate in args.rates:
        for method, flags in METHODS.items():
            folder = Path(tempfile.mkdtemp(prefix="diloco-cu-"))
            subprocess.run(
                ["bash", str(script), rate, str(args.steps), *flags],
                env={"OUT": str(folder), "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
                check=True,
                timeout=1800,
            )
            found = summaries(folder)
            row = {
                "rate": rate,
                "method": method,
                "nodes": len(found),
                "cu": [s["cu"] for s in found],
                "mean_cu": sum(s["cu"] for s in found) / max(1, len(found)),
                "bytes_sent": [s["bytes_sent"] for s in found],
                "failed_rounds": [s["failed_rounds"] for s in found],
                "eval_loss": [s["eval_loss"] for s in found],
                "identical_outer": len({json.dumps(s["outer_sha256"]) for s in found}) == 1,
            }
            rows.append(row)
            print(
                f"| {rate} | {method} | {100 * row['mean_cu']:.1f}% | "
                f"{', '.join(f'{100 * c:.1f}%' for c in row['cu'])} | "
                f"{sum(row['bytes_sent']) / len(found) / 1e6:.2f} MB | "
                f"{sum(row['failed_rounds'])} | {row['identical_outer']} |",
                flush=True,
            )
    args.out.write_text(json.dumps({"steps": args.steps, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
