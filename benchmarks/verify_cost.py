"""What signatures and sampled verification of the reducers cost an all-reduce round.

Runs ``diloco-node bench allreduce`` (real peer processes; with ``--bandwidth-mbit`` each in
its own network namespace behind a ``tc tbf`` link, root only) alternately with
verification on (the default: SEALs signed and checked, every member checks 16 blocks of
every part it did not reduce) and off (``--no-verify``), ``--pairs`` times, and prints each
run's median all-reduce seconds per round (the checks included) and with matchmaking,
then the median and range of the run medians of each variant and the cost.

    python benchmarks/verify_cost.py --pairs 3 --bandwidth-mbit 100 \\
        --json benchmarks/results/verify_cost.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from diloco.bench.provenance import provenance

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = {"verify": [], "no-verify": ["--no-verify"]}


def run(variant: str, args: list[str], out: Path) -> dict[str, object]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "diloco", "bench", "allreduce", *args, "--json", str(out)]
    subprocess.run(command + VARIANTS[variant], check=True, env=env, stdout=subprocess.DEVNULL)
    result = json.loads(out.read_text())
    assert isinstance(result, dict)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--numel", type=int, default=10_000_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--bandwidth-mbit", type=float, default=None)
    parser.add_argument("--json", type=Path, default=None)
    opts = parser.parse_args()
    args = ["--peers", str(opts.peers), "--numel", str(opts.numel), "--codec", "e3m0"]
    args += ["--rounds", str(opts.rounds)]
    if opts.bandwidth_mbit is not None:
        args += ["--bandwidth-mbit", str(opts.bandwidth_mbit)]
    runs: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for pair in range(opts.pairs):
            order = ("verify", "no-verify") if pair % 2 == 0 else ("no-verify", "verify")
            for variant in order:
                result = run(variant, args, Path(tmp, "r.json"))
                seconds = result["seconds_per_round"]
                with_mm = result["round_seconds_with_matchmaking"]
                assert isinstance(seconds, list) and isinstance(with_mm, list)
                row = {
                    "pair": pair,
                    "variant": variant,
                    "median_s": statistics.median(seconds),
                    "median_with_matchmaking_s": statistics.median(with_mm),
                    "seconds_per_round": seconds,
                    "bytes_sent_per_peer": result["bytes_sent_per_peer"],
                    "identical": len({str(h) for h in result["result_sha256"]}) == 1,
                }
                runs.append(row)
                print(
                    f"pair {pair} {variant:>9}: median {row['median_s']:.3f} s "
                    f"(with matchmaking {row['median_with_matchmaking_s']:.3f} s), "
                    f"rounds {', '.join(f'{s:.3f}' for s in seconds)}",
                    flush=True,
                )
    summary = {}
    for variant in VARIANTS:
        medians = sorted(float(str(r["median_s"])) for r in runs if r["variant"] == variant)
        summary[variant] = statistics.median(medians)
        print(
            f"{variant:>9}: median of run medians {summary[variant]:.3f} s "
            f"(runs {medians[0]:.3f}-{medians[-1]:.3f} s)"
        )
    cost = summary["verify"] - summary["no-verify"]
    print(f"cost {cost:.3f} s = {100 * cost / summary['verify']:.1f}% of the verified round")
    if opts.json:
        config = vars(opts) | {"json": None}
        opts.json.write_text(
            json.dumps({"config": config, "runs": runs, "provenance": provenance(ROOT)}, indent=1)
        )


if __name__ == "__main__":
    main()
