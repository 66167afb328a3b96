"""``diloco-node demo``: a small swarm on this machine, as separate processes on loopback.

One node is started, the others join with the address it prints, exactly as volunteers
would type it; their progress lines are shown with a prefix, and at the end the summaries
are compared: eval loss, compute utilisation, bytes against data-parallel, and whether all
nodes hold bit-identical outer states.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

ADDRESS_TIMEOUT = 120.0


@dataclass
class DemoNode:
    name: str
    process: subprocess.Popen[str]
    metrics: Path
    lines: list[str] = field(default_factory=list)
    address: threading.Event = field(default_factory=threading.Event)

    def summary(self) -> dict[str, Any] | None:
        if not self.metrics.exists():
            return None
        records = [json.loads(line) for line in self.metrics.read_text().splitlines() if line]
        return next((r for r in reversed(records) if r.get("event") == "summary"), None)


SHOWN_LOG_LINES = ("waiting for peers", "a group formed")
"""Log lines the demo shows: what the first node does while alone (rounds of one,
docs/design.md "Algorithm and schedule") and when it stops being alone."""


def _pump(node: DemoNode, stream: IO[str], echo: Callable[[str], None]) -> None:
    for line in stream:
        line = line.rstrip()
        node.lines.append(line)
        if line.startswith("/ip4/") or line.startswith("/ip6/"):
            node.address.set()
        if line.startswith("step") or line.startswith("done") or line.startswith("joined"):
            echo(f"[{node.name}] {line}")
        elif any(news in line for news in SHOWN_LOG_LINES):  # the message, not its header
            echo(f"[{node.name}] {line.split(': ', 1)[-1]}")


def _listen(index: int) -> list[str]:
    """Each node on its own loopback address: libp2p limits connections per source IP."""
    return ["--listen", f"/ip4/127.0.0.{index + 2}/tcp/0"]


def _spawn(name: str, args: list[str], folder: Path, echo: Callable[[str], None]) -> DemoNode:
    metrics = folder / f"{name}.jsonl"
    process = subprocess.Popen(
        [sys.executable, "-m", "diloco", *args, "--metrics-out", str(metrics)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    node = DemoNode(name, process, metrics)
    assert process.stdout is not None
    threading.Thread(target=_pump, args=(node, process.stdout, echo), daemon=True).start()
    return node


def run_demo(
    nodes: int = 3,
    steps: int = 600,
    extra: list[str] | None = None,
    echo: Callable[[str], None] = print,
    folder: str | None = None,
) -> dict[str, Any]:
    """Run the swarm to the end; returns the per-node summaries and the comparison."""
    work = Path(folder or tempfile.mkdtemp(prefix="diloco-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    common = ["--steps", str(steps), "--log-every", "50", "--threads", "1", *(extra or [])]
    started: list[DemoNode] = []
    try:
        first = _spawn("node0", ["start", "--name", "demo", *common, *_listen(0)], work, echo)
        started.append(first)
        if not first.address.wait(ADDRESS_TIMEOUT) or first.process.poll() is not None:
            raise RuntimeError("the first node did not start:\n" + "\n".join(first.lines))
        address = next(line for line in first.lines if line.startswith("/ip"))
        echo(
            f"node0 listens at {address}; starting {nodes - 1} more with "
            f"`diloco-node join --initial-peers {address}`"
        )
        for i in range(1, nodes):
            join = [
                "join",
                "--initial-peers",
                address,
                "--log-every",
                "50",
                "--threads",
                "1",
                *_listen(i),
            ]
            started.append(_spawn(f"node{i}", join, work, echo))
        for node in started:
            node.process.wait()
        summaries = {n.name: n.summary() for n in started}
        return {"folder": str(work), "summaries": summaries, **compare(summaries)}
    finally:
        for node in started:
            if node.process.poll() is None:
                os.killpg(node.process.pid, signal.SIGINT)
                try:
                    node.process.wait(15)
                except subprocess.TimeoutExpired:
                    os.killpg(node.process.pid, signal.SIGKILL)


def compare(summaries: dict[str, dict[str, Any] | None]) -> dict[str, Any]:
    """Whether every node ended with the same outer state, and the totals."""
    done = {k: v for k, v in summaries.items() if v is not None}
    hashes = {json.dumps(v["outer_sha256"]) for v in done.values()}
    return {
        "nodes_finished": len(done),
        "identical_outer_states": len(done) == len(summaries) and len(hashes) == 1,
        "eval_loss": [v["eval_loss"] for v in done.values()],
        "cu": [v["cu"] for v in done.values()],
        "bytes_sent": [v["bytes_sent"] for v in done.values()],
        "dp_bytes_estimate": [v["dp_bytes_estimate"] for v in done.values()],
    }
