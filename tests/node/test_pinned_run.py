"""Trust, as a user meets it: real `diloco-node` processes and a hostile peer on loopback.

A joiner follows the run of the peer whose address it was given, never a configuration
that merely shares the run's name, and never a path from the swarm (attack 5). Closed
swarms against outsiders: ``test_closed_swarm.py``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import forked_commands
import pytest
from test_swarm_node import SMALL, Node, listen, nodes  # noqa: F401  (the fixture)

from diloco.bench import launcher
from diloco.bench.launcher import Process

pytestmark = pytest.mark.swarm

HOSTILE = str(Path(__file__).with_name("hostile_peer.py"))
STEPS = 60
"""Two rounds of each fragment (H 30): a waits for b before its first step
(``--wait-for-peers 1``), so the hostile peer and the short commands run first whatever
their start takes, and the two train every step together."""


def diloco(*args: str, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    """One short-lived command (a join that is refused, status, keygen)."""
    return forked_commands.run([sys.executable, "-m", "diloco", *args], timeout=timeout)


def diloco_each(*commands: list[str]) -> list[subprocess.CompletedProcess[str]]:
    """Several short-lived commands at once: each starts a DHT process and a daemon, which
    takes seconds; run one after another, they outlast a short run."""
    with ThreadPoolExecutor(len(commands)) as pool:
        return list(pool.map(lambda args: diloco(*args), commands))


def hostile(log: Path, *args: str) -> Process:
    with log.open("w") as out:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        return launcher.spawn([sys.executable, HOSTILE, *args], out, env)


def report_of(process: Process, log: Path, timeout: float = 120.0) -> dict[str, Any]:
    """The JSON line a hostile peer prints once it has done its work."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in log.read_text().splitlines():
            if line.startswith("{"):
                report: dict[str, Any] = json.loads(line)
                return report
        assert process.poll() is None or process.returncode == 0, log.read_text()
        time.sleep(0.5)
    raise AssertionError(f"no report from the hostile peer:\n{log.read_text()}")


def stop(process: Process) -> None:
    if process.poll() is None:
        os.killpg(process.pid, 9)
        process.wait(10)


def peer_of(node: Node) -> str:
    match = re.search(r"^run \S+, peer (\S+)$", node.output(), re.MULTILINE)
    assert match, node.output()
    return match.group(1)


def test_joiner_follows_the_peer_it_was_given_not_a_same_name_run(nodes, tmp_path) -> None:  # noqa: F811
    tripwire = tmp_path / "victims-data"
    os.mkfifo(tripwire)  # opening it to read would block the reader for good
    run = ["--name", "h", "--steps", str(STEPS), "--wait-for-peers", "1"]
    a = nodes("a", ["start", *run, *SMALL, *listen(2)])
    address = a.address()
    log = tmp_path / "hostile.log"
    attacker = hostile(log, "hijack", address, "/ip4/127.0.0.9/tcp/0", str(tripwire))
    try:
        report = report_of(attacker, log)
        honest_run, own_run = report["honest_run"], report["own_run"]
        hostile_address = next(x for x in log.read_text().split() if x.startswith("/ip4/127.0.0.9"))
        assert report["own_published"] and own_run.startswith("h-") and own_run != honest_run

        # while a waits for a peer before its first step
        status, both, pinned, lured = diloco_each(
            ["status", "--initial-peers", address],
            ["join", "--initial-peers", f"{address} {hostile_address}", *listen(5)],
            ["join", "--initial-peers", hostile_address, "--run-id", honest_run, *listen(7)],
            ["join", "--initial-peers", hostile_address, *listen(6)],
        )
        # `status` shows both runs named h apart, with their creators; no forgery is listed
        assert status.returncode == 0, status.stderr
        assert f"run {honest_run}: creator {peer_of(a)}, " in status.stdout
        assert f"run {own_run}: creator {report['peer_id']}, " in status.stdout
        assert report["forged_run"] not in status.stdout
        # given both addresses, a joiner refuses to choose; --run-id pins; the hostile
        # run itself cannot be joined (its configuration names a path) and nothing is read
        assert both.returncode == 1 and "train different runs" in both.stderr, both.stderr
        assert pinned.returncode == 1, pinned.stderr
        assert f"no initial peer trains run {honest_run}" in pinned.stderr
        assert "the swarm lists these runs named h" in pinned.stderr
        assert lured.returncode == 1 and "unknown keys ['data']" in lured.stderr, lured.stderr

        b = nodes("b", ["join", "--initial-peers", address, *SMALL, *listen(3)])

        for node in (a, b):
            assert node.process.wait(300) == 0, node.output()
    finally:
        stop(attacker)
    assert f"run {honest_run}, peer " in b.output()
    assert b.summary()["run_id"] == a.summary()["run_id"] == honest_run
    assert b.summary()["step"] == STEPS
    assert [r["step"] for r in b.records() if r["event"] == "joined"] == [0]
    assert a.summary()["outer_sha256"] == b.summary()["outer_sha256"]
    assert str(tripwire) not in b.output()
