"""A/B of the swarm thread's event loop: asyncio's default loop against uvloop.

Runs ``diloco-node bench allreduce`` (real peer processes on loopback) alternately with
each loop, ``--pairs`` times, and prints the per-run medians of the all-reduce seconds per
round (and with matchmaking). The asyncio runs replace ``diloco.protocol.runtime.event_loop
.new_event_loop`` with ``asyncio.new_event_loop`` through a ``sitecustomize`` module on
``PYTHONPATH``, which every spawned peer process imports before anything else; the product
has no switch for it.

    python benchmarks/uvloop_ab.py --pairs 3 --json benchmarks/results/uvloop_ab.json
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
PATCH = """import asyncio
import diloco.protocol.runtime.event_loop as event_loop
event_loop.new_event_loop = asyncio.new_event_loop
"""


def run(variant: str, args: list[str], patch_dir: Path, out: Path) -> dict[str, object]:
    path = [str(ROOT)] + ([str(patch_dir)] if variant == "asyncio" else [])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    command = [sys.executable, "-m", "diloco", "bench", "allreduce", *args, "--json", str(out)]
    subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL)
    result = json.loads(out.read_text())
    assert isinstance(result, dict)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--numel", type=int, default=10_000_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None)
    opts = parser.parse_args()
    args = ["--peers", str(opts.peers), "--numel", str(opts.numel), "--codec", "e3m0"]
    args += ["--rounds", str(opts.rounds)]
    runs: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory() as tmp:
        patch_dir = Path(tmp, "patch")
        patch_dir.mkdir()
        (patch_dir / "sitecustomize.py").write_text(PATCH)
        for pair in range(opts.pairs):
            for variant in ("asyncio", "uvloop"):
                result = run(variant, args, patch_dir, Path(tmp, "r.json"))
                seconds = result["seconds_per_round"]
                with_mm = result["round_seconds_with_matchmaking"]
                assert isinstance(seconds, list) and isinstance(with_mm, list)
                row = {
                    "pair": pair,
                    "loop": variant,
                    "median_s": statistics.median(seconds),
                    "median_with_matchmaking_s": statistics.median(with_mm),
                    "seconds_per_round": seconds,
                    "identical": len(set(str(h) for h in result["result_sha256"])) == 1,
                }
                runs.append(row)
                print(
                    f"pair {pair} {variant:>7}: median {row['median_s']:.3f} s "
                    f"(with matchmaking {row['median_with_matchmaking_s']:.3f} s), "
                    f"rounds {', '.join(f'{s:.3f}' for s in seconds)}",
                    flush=True,
                )
    for variant in ("asyncio", "uvloop"):
        medians = [float(str(r["median_s"])) for r in runs if r["loop"] == variant]
        print(f"{variant:>7}: median of run medians {statistics.median(medians):.3f} s")
    if opts.json:
        opts.json.write_text(
            json.dumps(
                {
                    "config": vars(opts) | {"json": None},
                    "runs": runs,
                    "provenance": provenance(ROOT),
                }
            )
        )


if __name__ == "__main__":
    main()
