"""The run's end in a real swarm (docs/design.md "The run's end"): three CLI nodes that start
together; node c's training process is stopped (SIGSTOP; its DHT process and p2pd go on)
before the run's last sends, and continued ``THAW_AFTER`` seconds after the two others were
done with the run's last round, when they would have left. They formed the last rounds
without it (or failed them for all); they stay for it (lingering while its record is
behind, or waiting while it is not done), it heals, and all three end the run at one
outer state.

Before, a and b left at once and c ended the run with its own state of the fragments whose
last rounds it missed (its exported model another model): a CI run of the chaos test ended
so. Runs beside the nodes' lane (scripts/test.sh): its nodes mostly wait."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from diloco.bench.procs import NodeProcess

pytestmark = pytest.mark.swarm

STEPS, H = 80, 20
"""Two fragments (the embedding with the first two blocks, the last two): fragment 0 sends
at 20, 40, 60, 80, fragment 1 at 30, 50, 70."""
STOP_FROM = 62
"""c is stopped at its first step from here on, between two rounds (fragment 0's round of
step 60 is applied at 61, with tau 1): it misses the run's last rounds of both fragments
(at 70 and 80), which a and b form without it. Stopped at 55 it also missed fragment 0's
round at 60, which took a and b 6.8-8.8 s more: 13-15 s in all, and c's record, stored at
its last round, must outlive their wait (30 s). Stopped in the middle of a round (at 50),
it cost them that round's timeouts too (9 s)."""
THAW_AFTER = 5.0
"""Seconds: a node that does not stay leaves 2-3 s after its last round (its record marked
left, two evaluations). c's record, stored at its last round, must outlive the others' wait
for it (30 s): 4-12 s of their last rounds, then this."""
LAST_ROUND = (0, 4)
COMMON = [
    "--preset", "micro", "--fragment-size", "2", "--embedding-fragment", "first",
    "--seq-len", "32", "--batch-size", "4", "--threads", "1", "--tau", "1",
    "--matchmaking-window", "0.5", "--round-timeout", "2", "--log-every", "20",
    "--wait-for-peers", "2",
]  # fmt: skip


def listen(host: int) -> list[str]:
    return ["--listen", f"/ip4/127.0.0.{host}/tcp/0"]


def wait(holds: Callable[[], bool], timeout: float, what: str, poll: float = 0.01) -> None:
    deadline = time.monotonic() + timeout
    while not holds():
        assert time.monotonic() < deadline, f"timed out: {what}"
        time.sleep(poll)


def ended(node: NodeProcess) -> bool:
    """Whether ``node`` is done with the run's last round (fragment 0's at step 80)."""
    return any(
        r["event"] in ("round", "round_failed") and (r["fragment"], r["round"]) == LAST_ROUND
        for r in node.records()
    )


def test_peers_stay_for_a_node_that_missed_the_last_rounds_and_all_end_at_one_state(
    tmp_path: Path,
) -> None:
    run = ["--name", "end", "--steps", str(STEPS), "--H", str(H)]
    a = NodeProcess("a", ["start", *run, *COMMON, *listen(41)], tmp_path)
    nodes = [a]
    try:
        join = ["join", "--initial-peers", a.address(), *COMMON]
        b = NodeProcess("b", [*join, *listen(42)], tmp_path)
        c = NodeProcess("c", [*join, *listen(43)], tmp_path)
        nodes += [b, c]
        wait(lambda: c.step() >= STOP_FROM, 300, f"c's step {STOP_FROM}")
        os.kill(c.pid, signal.SIGSTOP)
        try:
            stopped_at = c.step()
            assert stopped_at < STEPS, "c ran to the end before it could be stopped"
            wait(lambda: ended(a) and ended(b), 120, "a's and b's last rounds", 0.1)
            time.sleep(THAW_AFTER)
        finally:
            os.kill(c.pid, signal.SIGCONT)
        for node in nodes:
            assert node.process.wait(120) == 0, node.output()[-3000:]
    finally:
        for node in nodes:
            node.kill_group()

    events = {n.name: n.records() for n in nodes}
    summaries = {
        name: next(r for r in rs if r["event"] == "summary") for name, rs in events.items()
    }
    # a and b formed the run's last round without c (the premise) ...
    last = [r for r in events["a"] if r["event"] == "round" and r["round"] == LAST_ROUND[1]]
    assert [(r["fragment"], r["members"]) for r in last] == [(0, 2)], last
    # ... stayed until c, continued, had taken their state of it
    healed = [r for r in events["c"] if r["event"] == "healed" and r["step"] >= stopped_at]
    assert any(0 in r["fragments"] for r in healed), [
        r for r in events["c"] if r["event"] != "step"
    ][-10:]
    hashes = {name: s["outer_sha256"] for name, s in summaries.items()}
    assert hashes["a"] == hashes["b"] == hashes["c"], hashes
    assert all(s["step"] == STEPS and not s["interrupted"] for s in summaries.values())
