"""Pace: adaptive rows: 3 nodes on loopback, node c 3x slower per step.

``start`` + 2 ``join``, tiny preset, 8 sequences of 128 tokens per step (on one CPU thread
a step's compute scales with its rows: about 0.07 / 0.11 / 0.21 s at 1 / 2 / 8 rows here),
node c with ``--slow-down 3`` (each inner step sleeps twice its compute: a device 3x slower,
whatever the machine's load). Each repeat runs ``--pace adaptive`` (c trains fewer rows so
it keeps the swarm's pace) and ``--pace fixed`` (every node its full batch: today's
behaviour, the swarm at c's pace). Per node: CU over the whole run and after all three are
present (steps after the node's first round with three members, before the last H steps,
from its step records: compute / wall), rows per step, tokens trained and tokens counted in
its applied rounds, rounds with three members, where a round's time went (matchmaking,
blocked), and node a's outer eval loss at equal wall time (the shorter run's).

The blocked share of the fast nodes a and b once all three are present (1 - their CU
there: wall time not spent in an inner step) is the pace's speed target, a figure and not
a test (docs/design.md "Pace"): lock-step (``fixed``) blocks them about 2/3 of their time;
``adaptive`` should keep it under half (``BLOCKED_BOUND``), and each run says whether it did.

    flock /tmp/diloco-heavy.lock python benchmarks/pace.py --repeats 2 \\
        --out benchmarks/results/pace_rows.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SEQ_LEN, BATCH, H = 128, 8, 30
COMMON = [
    "--seq-len", str(SEQ_LEN), "--batch-size", str(BATCH), "--threads", "1",
    "--log-every", "50", "--eval-every", "25",
]  # fmt: skip
SLOW_DOWN = "3"
BLOCKED_BOUND = 0.5
"""The fast nodes' blocked share ``adaptive`` should stay under (lock-step: about 2/3)."""


def records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def wait_address(log: Path, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in log.read_text().splitlines() if log.exists() else []:
            if line.startswith("/ip4/127."):
                return line.strip()
        time.sleep(0.5)
    raise RuntimeError(f"no address in {log}")


def run_swarm(
    folder: Path, steps: int, pace: str, tau: int, timeout: float
) -> list[list[dict[str, Any]]]:
    """One swarm of three nodes of this tree; each node's metrics records."""
    here = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(here), "PYTHONUNBUFFERED": "1"}
    procs: list[subprocess.Popen[bytes]] = []
    address = ""
    try:
        for i, name in enumerate("abc"):
            role = (
                ["start", "--name", "pace", "--steps", str(steps), "--H", str(H), "--tau", str(tau)]
                if i == 0
                else ["join", "--initial-peers", address]
            )
            args = [
                *role, *COMMON, "--pace", pace, "--data-seed", str(i),
                "--listen", f"/ip4/127.0.0.{i + 2}/tcp/0",
                "--metrics-out", str(folder / f"{name}.jsonl"),
            ]  # fmt: skip
            if name == "c":
                args += ["--slow-down", SLOW_DOWN]
            with (folder / f"{name}.log").open("w") as log:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "diloco", *args],
                        cwd=here,
                        env=env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
            if i == 0:
                address = wait_address(folder / "a.log", timeout=300)
        deadline = time.monotonic() + timeout
        for proc in procs:
            proc.wait(max(1.0, deadline - time.monotonic()))
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
    return [records(folder / f"{name}.jsonl") for name in "abc"]


def together(recs: list[dict[str, Any]], steps: int) -> list[dict[str, Any]]:
    """Step records after this node's first round with three members, before the run's last
    H steps (the first node trains alone until the joiners start; nodes end apart)."""
    first = next((r["step"] for r in recs if r["event"] == "round" and r["members"] == 3), None)
    if first is None:
        return []
    return [r for r in recs if r["event"] == "step" and first < r["step"] <= steps - H]


def node_figures(recs: list[dict[str, Any]], steps: int) -> dict[str, Any]:
    summary = next(r for r in recs if r["event"] == "summary")
    step_recs = [r for r in recs if r["event"] == "step"]
    rounds = [r for r in recs if r["event"] == "round"]
    num_fragments = next(r for r in recs if r["event"] == "config")["num_fragments"]
    both = together(recs, steps)
    wall = sum(r["wall_seconds"] for r in both)
    first3 = both[0]["step"] if both else None
    late = [r for r in rounds if first3 is not None and first3 <= r["step"] <= steps - H]
    return {
        "cu": summary["cu"],
        "cu_together": sum(r["step_seconds"] for r in both) / wall if wall else None,
        "blocked_share_together": 1 - sum(r["step_seconds"] for r in both) / wall if wall else None,
        "rows_median_together": median([r["rows"] for r in both]),
        "tokens_trained": summary["tokens_trained"],
        # Each fragment's rounds count every token once: per fragment.
        "tokens_in_applied_rounds": sum(r["weight"] for r in rounds) / num_fragments,
        "rounds_applied": len(rounds),
        "rounds_with_3": sum(r["members"] == 3 for r in rounds),
        "failed_rounds": summary["failed_rounds"],
        "blocked_s_together": sum(r["blocked_seconds"] for r in late),
        "matchmaking_median_together": median([r["matchmaking_seconds"] for r in late]),
        "round_seconds_median_together": median([r["seconds"] for r in late]),
        "step_s_median": median([r["step_seconds"] for r in step_recs]),
        "step_wall_s": sum(r["wall_seconds"] for r in step_recs),
        "eval_loss": summary["eval_loss"],
        "evals": eval_curve(recs),
    }


def below(nodes: list[dict[str, Any]]) -> bool:
    """Whether both fast nodes (a, b) were blocked for under ``BLOCKED_BOUND`` of their wall
    time once all three were present."""
    shares = [n["blocked_share_together"] for n in nodes[:2]]
    return all(s is not None and s < BLOCKED_BOUND for s in shares)


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def eval_curve(recs: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """(step wall seconds since the node's first step, outer eval loss) per evaluation."""
    elapsed, curve = 0.0, []
    for r in recs:
        if r["event"] == "step":
            elapsed += r["wall_seconds"]
        elif r["event"] == "eval":
            curve.append((elapsed, r["loss_outer"]))
    return curve


def loss_at(curve: list[tuple[float, float]], wall: float) -> float | None:
    """The last evaluation done by ``wall`` seconds."""
    before = [loss for t, loss in curve if t <= wall]
    return before[-1] if before else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--modes", default="adaptive,fixed")
    parser.add_argument("--tau", type=int, default=1, help="the run's tau (every node's)")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--reanalyse", action="store_true", help="recompute --out's tables")
    args = parser.parse_args()
    if args.reanalyse:
        rows = json.loads(args.out.read_text())
        for row in rows:
            found = [records(Path(row["folder"]) / f"{n}.jsonl") for n in "abc"]
            row["nodes"] = [node_figures(r, args.steps) for r in found]
            row["fast_blocked_below_bound"] = below(row["nodes"])
    else:
        rows = []
        for repeat in range(args.repeats):
            for mode in args.modes.split(","):
                folder = Path(tempfile.mkdtemp(prefix=f"diloco-pace-{mode}-{repeat}-"))
                found = run_swarm(folder, args.steps, mode, args.tau, args.timeout)
                nodes = [node_figures(r, args.steps) for r in found]
                row = {"mode": mode, "tau": args.tau, "repeat": repeat, "folder": str(folder)}
                rows.append(row | {"nodes": nodes, "fast_blocked_below_bound": below(nodes)})
                print(mode, repeat, table(rows[-1:]), flush=True)
    for row in rows:  # node a's eval loss at the end of the same repeat's shortest run
        wall = min(r["nodes"][0]["step_wall_s"] for r in rows if r["repeat"] == row["repeat"])
        row["equal_wall_s"] = wall
        row["eval_loss_at_equal_wall"] = loss_at(row["nodes"][0]["evals"], wall)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=1))
    print(table(rows))


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| pace | rep | CU a / b / c whole run | CU a / b / c all 3 present | c rows (median) "
        "| c tokens in rounds / trained | rounds with 3 (a) | failed a/b/c | matchmaking a / b "
        "/ c, round a (s, median) | eval a at equal wall | final eval a (wall s) "
        f"| blocked a / b all 3 present (< {BLOCKED_BOUND:g}?) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        a, b, c = r["nodes"]
        lines.append(
            f"| {r['mode']} (tau {r.get('tau', 1)}) | {r['repeat']} | "
            f"{a['cu']:.0%} / {b['cu']:.0%} / {c['cu']:.0%} | "
            f"{_pct(a['cu_together'])} / {_pct(b['cu_together'])} / {_pct(c['cu_together'])} | "
            f"{_num(c['rows_median_together'], '.0f')} | "
            f"{c['tokens_in_applied_rounds']:.0f} / {c['tokens_trained']} | "
            f"{a['rounds_with_3']}/{a['rounds_applied']} | "
            f"{a['failed_rounds']}/{b['failed_rounds']}/{c['failed_rounds']} | "
            f"{_num(a['matchmaking_median_together'], '.2f')} / "
            f"{_num(b['matchmaking_median_together'], '.2f')} / "
            f"{_num(c['matchmaking_median_together'], '.2f')}, "
            f"{_num(a['round_seconds_median_together'], '.2f')} | "
            f"{_num(r.get('eval_loss_at_equal_wall'), '.4f')} (at "
            f"{r.get('equal_wall_s', 0):.0f} s) | {a['eval_loss']:.4f} ({a['step_wall_s']:.0f}) | "
            f"{_num(a.get('blocked_share_together'), '.2f')} / "
            f"{_num(b.get('blocked_share_together'), '.2f')} "
            f"({'yes' if r.get('fast_blocked_below_bound') else 'no'}) |"
        )
    return "\n".join(lines)


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0%}"


def _num(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


if __name__ == "__main__":
    main()
