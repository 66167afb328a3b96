"""Chaos run: 6 real nodes, SIGKILLed and frozen at random (``diloco.bench.chaos``).

One run per call, so that each takes the shared lock on its own; each appends its tally to
``--out`` (JSON lines). ``--baseline`` runs the same swarm without faults (the reference for
the final eval loss). ``--markdown`` prints the table of the runs in ``--out``.

e.g. ``flock /tmp/diloco-heavy.lock python benchmarks/chaos.py --seed 0``, then
``... --baseline``, then ``python benchmarks/chaos.py --markdown``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from diloco.bench.chaos import ChaosConfig, run_chaos
from diloco.bench.provenance import provenance

HERE = Path(__file__).parent


def row(r: dict[str, Any], reference: float | None) -> str:
    c = r["config"]
    kind = f"chaos seed {c['seed']}" if c["faults"] else "fault-free"
    loss = r["eval_loss_mean"]
    delta = f"{100 * (loss / reference - 1):+.2f}%" if reference and loss else "-"
    mid = r["kills_mid_round"]
    ended = sum(n["reached_end"] for n in r["nodes"].values())
    return (
        f"| {kind} | {c['nodes']} | {c['steps']} | {r['kills']} ({mid} mid-round) "
        f"| {r['freezes']} | {r['rounds_attempted']} | {r['rounds_applied']} "
        f"| {r['rounds_failed']} | {r['heals']} | {len(r['crashed'])} | {len(r['hung'])} "
        f"| {len(r['orphans'])} | {len(r['non_finite'])} | {r['shared_rounds']} "
        f"| {len(r['mismatched_rounds'])} | {r['final_split_fragments'] or '-'} "
        f"| {ended}/{c['nodes']} | {loss:.4f} | {delta} | {r['seconds']:.0f} |"
    )


def markdown(runs: list[dict[str, Any]]) -> str:
    baselines = [r["eval_loss_mean"] for r in runs if not r["config"]["faults"]]
    reference = statistics.fmean(baselines) if baselines else None
    lines = [
        "| run | nodes | steps | kills | freezes | rounds attempted | applied | failed | heals "
        "| crashed | hung | orphans | NaN | shared rounds | mismatched | split at end "
        "| reached end | eval loss (mean of nodes) | vs fault-free | seconds |",
        "| --- " * 20 + "|",
    ]
    lines += [row(r, reference) for r in runs]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--baseline", action="store_true", help="no faults")
    parser.add_argument("--nodes", type=int, default=6)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--cycles", type=int, default=3)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "chaos.jsonl")
    parser.add_argument("--workdir", type=Path, default=None, help="logs, metrics, checkpoints")
    parser.add_argument("--markdown", action="store_true", help="print the table; run nothing")
    args = parser.parse_args()
    if not args.markdown:
        config = ChaosConfig(
            nodes=args.nodes,
            steps=args.steps,
            cycles=args.cycles,
            seed=args.seed,
            faults=not args.baseline,
        )
        folder = args.workdir or Path(tempfile.mkdtemp(prefix="chaos-"))
        print(f"logs, metrics and checkpoints in {folder}", flush=True)
        result = run_chaos(config, folder)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with args.out.open("a") as out:
            out.write(json.dumps(result | {"provenance": provenance()}) + "\n")
        brief = {k: v for k, v in result.items() if k not in ("config", "nodes")}
        print(json.dumps(brief, indent=1))
    runs = [json.loads(line) for line in args.out.read_text().splitlines() if line.strip()]
    print(markdown(runs))


if __name__ == "__main__":
    main()
