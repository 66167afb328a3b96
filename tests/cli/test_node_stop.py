"""A real ``diloco-node start`` stopped the way services are stopped: saves and exits.

Each test has its own node in its own session (so its process group is its own), waits
for its first round, then signals it as a terminal, ``kill -TERM -PGID`` or systemd
(every process of the node: its DHT process and p2pd too) would. The three nodes start at
once: a node's start is seconds of a single core's work and of waiting for its first
round, on a machine of two. The node must exit with
the documented status (128 + the signal: 143, 130) and leave a
checkpoint. The waits are generous bounds for a loaded machine, not speed claims.
Whatever a failing test leaves running is SIGKILLed by PID.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from diloco.bench.launcher import spawn

EXIT_BOUND_S = 120.0
"""Generous bound for a stopped node to exit (it takes seconds); a hang fails the test."""
START_BOUND_S = 180.0
"""Generous bound for the node to start and fail its first round (alone in its swarm)."""
ROUNDS_RUN = "waiting for peers: alone in the swarm"
"""What the lone node logs once its rounds run: from then on one is nearly always in
flight, and a stop abandons it, so the node records it and refreshes its records (the
path that once waited for ever on a dead DHT process)."""


def _descendants(pid: int) -> list[int]:
    """Live processes under ``pid`` (children first), read from /proc."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] not in "ZX":
                parents[int(entry.name)] = int(fields[1])
    found, frontier = [], [pid]
    while frontier:
        kids = [child for child, parent in parents.items() if parent in frontier]
        found += kids
        frontier = kids
    return found


class _Node:
    """``diloco-node start`` in a session of its own, its output in a file."""

    def __init__(self, tmp_path: Path) -> None:
        self.checkpoints = tmp_path / "ckpt"
        self.log = tmp_path / "node.log"
        command = [
            *(sys.executable, "-c", "from diloco.cli import main; main()"),
            *("start", "--steps", "100000"),
            *("--threads", "1", "--H", "4", "--checkpoint-dir", str(self.checkpoints)),
            *("--listen", "/ip4/127.0.0.1/tcp/0"),
        ]
        with open(self.log, "w") as out:
            self.process = spawn(command, out, dict(os.environ))
        self.helpers: list[int] = []

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_training(self) -> None:
        deadline = time.monotonic() + START_BOUND_S
        while ROUNDS_RUN not in self.output():
            assert self.process.poll() is None, f"node exited early:\n{self.output()}"
            assert time.monotonic() < deadline, f"node did not start:\n{self.output()}"
            time.sleep(0.5)
        self.helpers = _descendants(self.process.pid)

    def clean_up(self) -> None:
        for pid in [self.process.pid, *(self.helpers or _descendants(self.process.pid))]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.process.wait(10)


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, _Node]]:
    """One node per test, by the test's name, all started before the first test."""
    started: dict[str, _Node] = {}
    try:
        for name in ("sigterm_group", "sigterm_every", "ctrl_c"):
            started[name] = _Node(tmp_path_factory.mktemp(name))
        yield started
    finally:
        for node in started.values():
            node.clean_up()


def _stopped(node: _Node, expected_code: int) -> None:
    try:
        code = node.process.wait(EXIT_BOUND_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the node still runs {EXIT_BOUND_S} s after the signal:\n{node.output()}")
    assert code == expected_code, node.output()
    assert list(node.checkpoints.glob("step_*/state.json")), node.output()
    assert "Traceback" not in node.output()


@pytest.mark.swarm
def test_sigterm_to_the_process_group_saves_and_exits(nodes: dict[str, _Node]) -> None:
    node = nodes["sigterm_group"]
    node.wait_training()
    os.killpg(node.process.pid, signal.SIGTERM)
    _stopped(node, 143)  # 128 + SIGTERM, as README documents


@pytest.mark.swarm
def test_sigterm_to_every_process_of_the_node_saves_and_exits(nodes: dict[str, _Node]) -> None:
    """As systemd stops a service: the DHT process and p2pd get SIGTERM too, and die."""
    node = nodes["sigterm_every"]
    node.wait_training()
    assert node.helpers, "the node has no DHT process"
    for pid in [node.process.pid, *node.helpers]:
        os.kill(pid, signal.SIGTERM)
    _stopped(node, 143)  # 128 + SIGTERM, as README documents


@pytest.mark.swarm
def test_ctrl_c_saves_and_exits_130(nodes: dict[str, _Node]) -> None:
    """As a terminal's Ctrl-C: SIGINT to the whole foreground process group. The node says
    it stops, then its summary; no helper process prints an error or a warning (p2pd,
    stopped by the node once it left, not by the terminal before)."""
    node = nodes["ctrl_c"]
    node.wait_training()
    os.killpg(node.process.pid, signal.SIGINT)
    _stopped(node, 130)  # 128 + SIGINT
    after = node.output().split("stopping: ", 1)[1].splitlines()[1:]
    noisy = [line for line in after if re.search(r"\[(ERROR|WARN)\]|\b(ERROR|WARNING)\b", line)]
    assert not noisy, node.output()
    assert [line for line in after if line.startswith("done at step ")], node.output()
