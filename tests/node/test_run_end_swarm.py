"""The run's end in a real swarm (docs/design.md "The run's end"): three CLI nodes that start
together; node c's training process is stopped (SIGSTOP; its DHT process and p2pd go on)
before the run's last sends, and continued 1 s after the two others were done with the
run's last round. They formed the last rounds without it; they stay for it, it heals, and
all three end the run at one outer state.

Before, a and b left at once and c ended the run with its own state of the fragments whose
last rounds it missed (its exported model another model): a CI run of the chaos test ended
so. Runs beside the nodes' lane (scripts/test.sh): its nodes mostly wait."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from diloco.bench.procs import NodeProcess

pytestmark = pytest.mark.swarm

STEPS, H = 80, 20
"""Two fragments (the embedding with the first two blocks, the last two): fragment 0 sends
at 20, 40, 60, 80, fragment 1 at 30, 50, 70."""
STOP_FROM = 52
"""c is stopped at its first step from here on: it misses fragment 0's round at 80, and
fragment 1's at 70 unless it got there first. Mostly between two rounds (fragment 1's
round of step 50 is applied at 51, with tau 1): stopped in the middle of one, c would cost
a and b that round's timeouts too (9 s in a run stopped at 50)."""
LAST_ROUND = (0, 4)
COMMON = [
    "--preset", "micro", "--fragment-size", "2", "--embedding-fragment", "first",
    "--seq-len", "32", "--batch-size", "4", "--threads", "1", "--tau", "1",
    "--matchmaking-window", "0.5", "--round-timeout", "2", "--log-every", "20",
    "--wait-for-peers", "2",
]  # fmt: skip


def listen(host: int) -> list[str]:
    return ["--listen", f"/ip4/127.0.0.{host}/tcp/0"]


def wait(holds: object, timeout: float, what: str, poll: float = 0.01) -> None:
    deadline = time.monotonic() + timeout
    while not holds():  # type: ignore[operator]
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
            time.sleep(1.0)
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
    c_id = next(r["peer_id"] for r in events["c"] if r["event"] == "config")
    # a and b formed a last round without c (the premise) ...
    last = {(r["fragment"], r["round"]) for r in events["a"] if r["event"] == "round"}
    assert LAST_ROUND in last and summaries["a"]["versions"] == [4, 3]
    # ... and waited for it, which then took their state
    for name in "ab":
        lingered = [r for r in events[name] if r["event"] == "lingered"]
        assert lingered and c_id in lingered[0]["peers"], events[name][-5:]
        assert lingered[0]["still_behind"] == []
    healed = [r for r in events["c"] if r["event"] == "healed" and r["step"] >= stopped_at]
    assert healed, [r for r in events["c"] if r["event"] != "step"][-10:]
    hashes = {name: s["outer_sha256"] for name, s in summaries.items()}
    assert hashes["a"] == hashes["b"] == hashes["c"], hashes
    assert all(s["step"] == STEPS and not s["interrupted"] for s in summaries.values())
