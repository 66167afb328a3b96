"""The pace attack on real `diloco-node` processes (docs/design.md "Pace").

Honest nodes train their full batch of 8 rows per step; hostile processes
(``hostile_pace.py``, built from the project's classes) claim a full-batch step of 1e-6 s.

- Paper keys: two honest nodes of equal speed; the hostile process stores validly signed
  node records under ``K`` keys of its own. Under the former rule (the lower median of every
  record's claim) both honest nodes drop to 1 row per step within a few steps of reading
  them; with the pace from evidence those keys never worked in a round with them, so their
  claims are ignored (and logged) and every step of both nodes trains 8 rows. Nor do the
  keys' records make a round wait for them: counting every record, a leader waited for
  2 + K declarations and every round it led ran out its window; now it waits for 2 (but
  in the one round of four open to every record's author).
- A working liar paired with one honest node: a real node that trains its full batch and
  joins every round with its true tokens, so its claim passes the token check; under the
  former rule it alone sets the pace (the lower of two) and the honest node drops to 1 row;
  the upper median keeps the honest node's own figure, and its 8 rows.

The two swarms run at once (a module fixture; separate runs, each node on its own loopback
address): each test reads its own. They cannot be one swarm: a third worker would make the
liar's figure the lowest of three, which the former rule's lower median ignores too.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from test_swarm_node import Node, listen

from diloco.bench.launcher import Process, spawn

pytestmark = pytest.mark.swarm

HOSTILE = Path(__file__).with_name("hostile_pace.py")
K = 4
"""Paper keys: two were enough to cut both nodes to one row under the former rule."""
STEPS, H, BATCH = 90, 20, 8
COMMON = [
    "--preset", "micro", "--seq-len", "32", "--batch-size", str(BATCH), "--threads", "1",
    "--log-every", "40", "--matchmaking-window", "1",
]  # fmt: skip
"""The window at 1 s (default 2 s): the paper keys count as live nodes, so every round
waits out its whole window."""


class Hostile:
    """A hostile process; its stdout holds JSON lines (``hostile_pace.py``)."""

    def __init__(self, name: str, args: list[str], folder: Path) -> None:
        self.log = folder / f"{name}.log"
        with self.log.open("w") as log:
            env = {**os.environ, "PYTHONUNBUFFERED": "1"}
            self.process: Process = spawn([sys.executable, str(HOSTILE), *args], log, env)

    def lines(self) -> list[dict[str, Any]]:
        text = self.log.read_text() if self.log.exists() else ""
        return [json.loads(line) for line in text.splitlines() if line.startswith("{")]

    def wait(self, key: str, timeout: float = 120.0) -> dict[str, Any]:
        """The first JSON line holding ``key``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if found := [line for line in self.lines() if key in line]:
                return found[0]
            assert self.process.poll() is None, self.log.read_text()
            time.sleep(0.5)
        raise AssertionError(f"no {key!r} from the hostile process:\n{self.log.read_text()}")

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)


@dataclass
class Runs:
    """Both finished swarms."""

    a: Node
    b: Node
    sybils: list[str]
    """The paper keys of the first swarm."""
    pair: Node
    """The honest node of the second swarm, paired with the working liar."""
    liar_metrics: Path


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runs]:
    folder = tmp_path_factory.mktemp("pace-attack")
    started: list[Node | Hostile] = []
    try:
        # -v: the node logs (once per peer, at info) each claim it ignores
        paper_run = ["--name", "pace-attack", "--steps", str(STEPS), "--H", str(H)]
        a = Node("a", ["-v", "start", *paper_run, *COMMON, *listen(2), "--data-seed", "0"], folder)
        started.append(a)
        pair_run = ["--name", "pace-pair", "--steps", str(STEPS), "--H", str(H)]
        pair = Node(
            "pair", ["-v", "start", *pair_run, *COMMON, *listen(7), "--data-seed", "0"], folder
        )
        started.append(pair)
        where = ["--initial-peers", a.address(), "--listen", "/ip4/127.0.0.5/tcp/0"]
        hostile = Hostile("hostile-pace", ["paper", str(K), *where], folder)
        started.append(hostile)
        metrics = folder / "liar.jsonl"
        join = ["join", "--initial-peers", pair.address(), *COMMON, *listen(6), "--data-seed", "1"]
        liar = Hostile("liar", ["work", *join, "--metrics-out", str(metrics)], folder)
        started.append(liar)
        sybils = hostile.wait("ready")["sybils"]
        hostile.wait("stored")  # the lies are in the DHT before b starts
        join = ["-v", "join", "--initial-peers", a.address(), *COMMON, *listen(3)]
        b = Node("b", [*join, "--data-seed", "1"], folder)
        started.append(b)
        for node in (a, b, pair):
            assert node.process.wait(600) == 0, node.output()
        assert liar.process.wait(120) == 0, liar.log.read_text()
        yield Runs(a, b, sybils, pair, metrics)
    finally:
        for process in started:
            process.stop()


def test_paper_keys_claiming_to_be_fast_change_no_honest_rows(runs: Runs) -> None:
    a, b, sybils = runs.a, runs.b, runs.sybils
    assert len(sybils) == K
    waits: dict[str, list[str]] = {}
    for node in (a, b):
        steps = [r for r in node.records() if r["event"] == "step"]  # b's from its join
        assert steps and steps[-1]["step"] == STEPS, node.name
        # every step at the full batch: the paper keys' 1e-6 s set no pace
        assert [r["rows"] for r in steps] == [BATCH] * len(steps), node.name
        assert node.summary()["rows_trained"] == BATCH * len(steps), node.name
        # ... and not because the lies went unread: each paper key's claim was ignored
        output = node.output()
        for sybil in sybils:
            assert f"ignoring the step time claimed by {sybil}: no round" in output, node.name
        # the two trained together (their rounds had both members)
        rounds = [r for r in node.records() if r["event"] == "round"]
        assert any(r["members"] == 2 for r in rounds), node.name
        # Nor did the keys make a round wait for them: a leader waits for the nodes it saw
        # work (docs/design.md "Evidence"); counting every record, it waited for 2 + K and
        # every round it led ran out its window (now only the rounds open to every record).
        targets = re.findall(r"\d+ of (\d+) live nodes declared", output)
        waits[node.name] = targets
        assert "is silent" not in output, node.name
    assert waits["a"] + waits["b"] and set(waits["a"] + waits["b"]) == {"2"}, waits


def test_a_working_liar_cannot_shrink_its_honest_partners_rows(runs: Runs) -> None:
    a, metrics = runs.pair, runs.liar_metrics
    steps = [r for r in a.records() if r["event"] == "step"]
    assert steps and steps[-1]["step"] == STEPS
    assert [r["rows"] for r in steps] == [BATCH] * len(steps)  # the liar's 1e-6 s set no pace
    # Every step trained but those a skipped: more than 2 steps behind its one partner on a
    # loaded machine, a node catches up to it (once in CI: from step 41 to 43).
    skipped = {
        s
        for r in a.records()
        if r["event"] == "caught_up"
        for s in range(r["from_step"] + 1, r["to_step"] + 1)
    }
    assert {r["step"] for r in steps} | skipped == set(range(1, STEPS + 1))
    # The liar worked: rounds with both, its tokens those of its full batch (H steps of 8
    # rows of 32 tokens, once past its first rounds), so its claim passed the token check.
    assert sum(r["members"] == 2 for r in a.records() if r["event"] == "round") >= 3
    lines = [json.loads(line) for line in metrics.read_text().splitlines() if line.endswith("}")]
    weights = [r["weight"] for r in lines if r["event"] == "round" and r["members"] == 2]
    assert H * BATCH * 32 in weights, weights
