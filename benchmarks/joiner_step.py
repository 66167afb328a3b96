"""When the joiners of a small swarm get in step with its creator: the chaos test's swarm
(3 nodes, 150 steps of about 0.07 s, H 10, 1 s windows), with the test's random faults
(``--faults``) or with one fault placed by hand (``--freeze S``: joiner b's whole session
is frozen for S seconds once both joiners have applied a round with the creator).

Prints one JSON line per run and appends it to ``--out``: per joiner the step of its first
round applied with the creator (the same fragment, round and outer state; a late one kept
the chaos test from placing its faults) and, after a freeze, b's first such round after the
thaw, its failed rounds after it, and the seconds it blocked on rounds it led alone.

e.g. ``python benchmarks/joiner_step.py --freeze 6`` or ``... --faults``
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

from diloco.bench.chaos import ChaosConfig, Swarm, run_chaos
from diloco.bench.provenance import provenance

HERE = Path(__file__).parent
Key = tuple[int, int, str]


def records(folder: Path, name: str) -> list[dict[str, Any]]:
    lines = (folder / f"{name}.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def applied_with_others(node: list[dict[str, Any]]) -> dict[Key, int]:
    """(fragment, round, outer state) -> the step a round with others was applied at."""
    return {
        (r["fragment"], r["round"], r["outer_sha256"]): r["step"]
        for r in node
        if r.get("event") == "round" and r.get("members", 1) >= 2
    }


def config(faults: bool) -> ChaosConfig:
    """The chaos test's configuration (tests/node/test_chaos.py)."""
    return ChaosConfig(
        nodes=3, steps=150, sync_every=10, cycles=1 if faults else 0, seed=1,
        matchmaking_window=1.0, round_timeout=3.0, freeze_margin_s=2.0, checkpoint_every=10,
        downtime_s=(0.5, 1.5), gap_s=(0.5, 1.0), hang_s=60.0, faults_until=0.55,
        faults=faults,
    )  # fmt: skip


def frozen_run(folder: Path, freeze_s: float) -> int:
    """Run the fault-free swarm, freezing b once; returns b's step at the thaw."""
    swarm = Swarm(config(faults=False), folder)
    try:
        swarm.launch()
        swarm.wait_all(swarm.worked_with_creator, timeout=300)
        b = swarm.nodes[1]
        os.killpg(b.pid, signal.SIGSTOP)
        time.sleep(freeze_s)
        os.killpg(b.pid, signal.SIGCONT)
        thawed_at = b.step()
        swarm.finish(timeout=600)
    finally:
        swarm.cleanup()
    return thawed_at


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--faults", action="store_true", help="the chaos test's faults")
    parser.add_argument("--freeze", type=float, default=0.0, help="freeze b this long once")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "joiner_step.jsonl")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="joiner_step_"))
    start = time.monotonic()
    result: dict[str, Any] = {"faults": args.faults, "freeze_s": args.freeze}
    if args.faults:
        tally = run_chaos(config(faults=True), folder, timeout=600)
        result |= {k: tally[k] for k in ("kills", "kills_mid_round", "freezes", "all_reached_end")}
    thawed_at = frozen_run(folder, args.freeze) if args.freeze else None
    creator = applied_with_others(records(folder, "a"))
    for name in ("b", "c"):
        mine = applied_with_others(records(folder, name))
        result[f"{name}_first_with_creator"] = min(
            (step for key, step in mine.items() if key in creator), default=None
        )
    if thawed_at is not None:
        b = records(folder, "b")
        mine = applied_with_others(b)
        after = [s for k, s in mine.items() if k in creator and s > thawed_at]
        failed = [r for r in b if r["event"] == "round_failed" and r["step"] > thawed_at]
        alone = [r["blocked_seconds"] for r in failed if "no group" in r["error"]]
        result |= {
            "b_thawed_at": thawed_at,
            "b_first_after_thaw": min(after, default=None),
            "b_failed_after_thaw": len(failed),
            "b_alone_after_thaw": len(alone),
            "b_alone_blocked_s": round(sum(alone), 1),
        }
    result["seconds"] = round(time.monotonic() - start, 1)
    print(json.dumps(result))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("a") as out:
        out.write(json.dumps(result | {"provenance": provenance()}) + "\n")


if __name__ == "__main__":
    main()
