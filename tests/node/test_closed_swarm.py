"""Closed swarms and admission against a hostile peer, on real `diloco-node` processes.

The hostile peer (``hostile_closed.py``) stores, under K identities of one process, node
records claiming step 99,999 with 1e-6 s per step, and vouches among its identities for an
all-zero state; before every record carried its author's proof of the swarm key, such an
outsider moved the honest nodes of a closed swarm to step 99,999 (they exited at once) and
cut their rows per step from 4 to 1 (the liars' step seconds became the swarm's pace).
Here:

- outsiders without the key (K = 1 and K = 8 at once) change nothing: no step jump, no
  state adopted, the pace the honest nodes' own; every one of their identities is named
  once as not a member, and their STATE, JOIN and PART requests are refused; a `join`
  without the key, or with another, exits 1 saying why. Without the proof check in
  ``admission.Membership.accepts`` this test fails.
- a holder of a leaked key (K = 8) whom the creator did not admit changes nothing either
  and gets no state, group or part, while an admitted joiner trains with the creator; a
  node with the key but not admitted refuses to join, with one line.

The runs are long (100,000 steps) so that the claimed step lies inside the run; each test
stops its nodes with SIGINT once they trained well past where the attack used to act.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import forked_commands
import pytest
from click.testing import CliRunner
from test_swarm_node import SMALL, Node, listen, nodes  # noqa: F401  (the fixture)

from diloco.bench import launcher
from diloco.cli import main

pytestmark = pytest.mark.swarm

HOSTILE = str(Path(__file__).with_name("hostile_closed.py"))
STEPS = "100000"
UNTIL = 100
"""Steps the honest nodes train with the hostile records present (the jump came at ~65)."""
TIMEOUT = 600.0


class Hostile:
    """A ``hostile_closed.py`` process; its report is the JSON line it prints."""

    def __init__(self, log: Path, address: str, host: int, keys: int, *extra: str) -> None:
        self.log = log
        where = ["--initial-peers", address, "--listen", f"/ip4/127.0.0.{host}/tcp/0"]
        with log.open("w") as out:
            env = {**os.environ, "PYTHONUNBUFFERED": "1"}
            command = [sys.executable, HOSTILE, *where, "--keys", str(keys), *extra]
            self.process = launcher.spawn(command, out, env)

    def report(self, timeout: float = 180.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.log.read_text().splitlines():
                if line.startswith("{"):
                    found: dict[str, Any] = json.loads(line)
                    return found
            assert self.process.poll() is None, self.log.read_text()
            time.sleep(0.5)
        raise AssertionError(f"no report from the hostile peer:\n{self.log.read_text()}")

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)


def diloco_each(*commands: list[str]) -> list[subprocess.CompletedProcess[str]]:
    """Short-lived commands (a join that is refused) at once: each starts a DHT process
    and a daemon, which takes seconds."""

    def run(args: list[str]) -> subprocess.CompletedProcess[str]:
        return forked_commands.run([sys.executable, "-m", "diloco", *args], timeout=120)

    with ThreadPoolExecutor(len(commands)) as pool:
        return list(pool.map(run, commands))


def keygen(*args: str) -> str:
    """``diloco-node keygen`` in this process (a new interpreter takes seconds)."""
    result = CliRunner().invoke(main, ["keygen", *args])
    assert result.exit_code == 0, result.output
    return result.output.strip()


def interrupt(*honest: Node) -> None:
    """Stop the honest nodes with SIGINT; each saves, prints its summary and exits 130
    (128 + SIGINT, as a stopped node does)."""
    for node in honest:
        node.process.send_signal(signal.SIGINT)
    for node in honest:
        assert node.process.wait(120) == 130, node.output()


def assert_unmoved(*honest: Node) -> None:
    """No step jump, no state of the attacker, no pace of the liars; members trained
    together."""
    for node in honest:
        records = node.records()
        steps = [r for r in records if r["event"] == "step"]
        assert steps and max(r["step"] for r in steps) < 1000, node.name
        assert node.summary()["step"] < 1000 and node.summary()["interrupted"]
        jumps = [r for r in records if r["event"] == "caught_up"]
        assert all(r["to_step"] < 1000 for r in jumps), jumps
        joined = [r for r in records if r["event"] == "joined"]
        assert all(r["step"] < 1000 for r in joined), joined
        # the pace (upper median of the members' step seconds) is the honest nodes' own:
        # the liars' 1e-6 s would be it (and rows fall to 1); rows themselves move with the
        # honest nodes' load, so they are not compared
        paces = [r["pace_seconds"] for r in records if r["event"] == "progress"]
        assert any(p is not None for p in paces), node.name
        assert all(p is None or p > 1e-3 for p in paces), (node.name, paces)
        # rounds of one only while alone, before the other joined (docs/design.md
        # "Algorithm and schedule"); from the first group on, both members every round
        members = [r["members"] for r in records if r["event"] == "round"]
        grouped = members[members.index(2) :] if 2 in members else []
        assert grouped and set(grouped) == {2} and set(members) <= {1, 2}, (node.name, members)


def test_outsiders_records_change_nothing_in_a_closed_swarm(nodes, tmp_path) -> None:  # noqa: F811
    key, other = tmp_path / "swarm.key", tmp_path / "other.key"
    keygen("--swarm-key", str(key))
    keygen("--swarm-key", str(other))
    run = ["--steps", STEPS, "--swarm-key", str(key), *SMALL]
    # a waits for b before its first step: the outsiders' records do not count (they carry
    # no proof of the key), so it trains UNTIL steps with them present, not alone first
    a = nodes("a", ["start", "--name", "closed", *run, "--wait-for-peers", "1", *listen(2)])
    address = a.address()
    outsiders = [
        Hostile(tmp_path / "one.log", address, 8, 1),
        Hostile(tmp_path / "eight.log", address, 9, 8),
    ]
    try:
        reports = [outsider.report() for outsider in outsiders]
        b = nodes("b", ["join", "--initial-peers", address, *run, *listen(3)])
        # meanwhile, a joiner without the key, or with another, is refused with a line
        # saying why
        no_key, wrong_key = diloco_each(
            ["join", "--initial-peers", address, *listen(5)],
            ["join", "--initial-peers", address, "--swarm-key", str(other), *listen(6)],
        )
        b.wait_step(UNTIL, TIMEOUT)
        a.wait_step(UNTIL, TIMEOUT)
        interrupt(a, b)
    finally:
        for outsider in outsiders:
            outsider.stop()
    assert no_key.returncode == 1, no_key.stderr
    assert "is a closed swarm" in no_key.stderr and "--swarm-key FILE" in no_key.stderr
    assert wrong_key.returncode == 1 and "is not the key of run" in wrong_key.stderr
    assert "Traceback" not in no_key.stderr + wrong_key.stderr
    assert [len(r["ids"]) for r in reports] == [1, 8]
    assert_unmoved(a, b)
    for report in reports:
        for request in ("state", "join", "part"):
            assert "not a member of this closed swarm" in report[request], report
        for handler in ("STATE", "JOIN", "PART"):
            line = f"refused {handler} from {report['peer_id']}: not a member of this closed swarm"
            assert line in a.output(), handler
    for node in (a, b):
        for peer in (i for r in reports for i in r["ids"]):
            line = f"ignoring the records of {peer}: not a member of this closed swarm"
            assert node.output().count(line) == 1, (node.name, peer)


def test_a_leaked_key_without_admission_changes_nothing(nodes, tmp_path) -> None:  # noqa: F811
    key, admit = tmp_path / "swarm.key", tmp_path / "admitted"
    keygen("--swarm-key", str(key))
    member = keygen("--identity", str(tmp_path / "b.id"))
    keygen("--identity", str(tmp_path / "c.id"))
    admit.write_text(f"# the members of run adm\n{member}\n")
    run = ["--steps", STEPS, "--swarm-key", str(key), *SMALL]
    admitted = ["--admit", str(admit), "--wait-for-peers", "1"]  # the leak's records do not count
    a = nodes("a", ["start", "--name", "adm", *admitted, *run, *listen(2)])
    address = a.address()
    leak = Hostile(tmp_path / "leak.log", address, 9, 8, "--swarm-key", str(key))
    try:
        report = leak.report()
        identity = ["--identity", str(tmp_path / "b.id")]
        b = nodes("b", ["join", "--initial-peers", address, *run, *identity, *listen(3)])
        stranger = ["--identity", str(tmp_path / "c.id"), *listen(5)]
        c = nodes("c", ["join", "--initial-peers", address, *run, *stranger])
        assert c.process.wait(TIMEOUT) == 1, c.output()
        b.wait_step(UNTIL, TIMEOUT)
        a.wait_step(UNTIL, TIMEOUT)
        interrupt(a, b)
    finally:
        leak.stop()
    assert "is not admitted to run adm-" in c.output() and "Traceback" not in c.output()
    assert_unmoved(a, b)
    assert len(report["ids"]) == 8
    for request in ("state", "join", "part"):
        assert "not admitted to this run" in report[request], report
    for handler in ("STATE", "JOIN", "PART"):
        assert f"refused {handler} from {report['peer_id']}: not admitted to this run" in a.output()
    for node in (a, b):
        for peer in report["ids"]:
            line = f"ignoring the records of {peer}: not admitted to this run"
            assert node.output().count(line) == 1, (node.name, peer)
