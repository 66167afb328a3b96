"""Seeing a real swarm: two `diloco-node` processes on loopback, one with a Prometheus
endpoint, and `diloco-node dashboard` following them, its page rendered by headless
Chromium (the DOM after the page's script ran)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
from prometheus_client.parser import text_string_to_metric_families

from diloco.bench import launcher

pytestmark = pytest.mark.swarm
T = TypeVar("T")

STEPS = 3000
"""More than the tests need: the nodes are stopped once both tests have seen enough."""
SMALL = ["--seq-len", "32", "--batch-size", "4", "--log-every", "10", "--threads", "1"]
WAIT_S = 240.0
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--virtual-time-budget=3000",  # let the page's script and its first poll run
]


@dataclass
class Process:
    name: str
    process: launcher.Process
    log: Path

    def output(self) -> str:
        return self.log.read_text() if self.log.exists() else ""

    def line(self, pattern: str) -> re.Match[str]:
        """The first match of ``pattern`` in the output, waiting for it."""
        return wait_for(lambda: re.search(pattern, self.output()), f"{self.name}: {pattern}", self)

    def interrupt(self) -> None:
        """SIGINT: a clean exit (records expire, p2pd ends); ``stop`` waits for it."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)

    def stop(self) -> None:
        """Wait for the exit ``interrupt`` asked for, then SIGKILL to the session."""
        self.interrupt()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)


def wait_for(check: Callable[[], T | None], what: str, *alive: Process) -> T:
    deadline = time.monotonic() + WAIT_S
    while (value := check()) is None or value is False:
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        for p in alive:
            assert p.process.poll() is None, f"{p.name} exited:\n{p.output()}"
        time.sleep(0.25)
    return value


@dataclass
class Swarm:
    a: Process
    b: Process
    dashboard: Process
    dashboard_url: str
    metrics_url: str
    peers: tuple[str, str]


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Swarm]:
    folder = tmp_path_factory.mktemp("dashboard")
    started: list[Process] = []

    def spawn(name: str, *args: str) -> Process:
        log = folder / f"{name}.log"
        with log.open("w") as out:
            env = {**os.environ, "PYTHONUNBUFFERED": "1"}
            process = launcher.spawn([sys.executable, "-m", "diloco", *args], out, env)
        started.append(Process(name, process, log))
        return started[-1]

    try:
        node = ["--steps", str(STEPS), *SMALL, "--eval-every", "20"]
        a = spawn(
            "a",
            "start",
            "--name",
            "seen",
            *node,
            "--listen",
            "/ip4/127.0.0.2/tcp/0",
            "--prometheus-port",
            "0",
        )
        address = a.line(r"(?m)^(/ip4/127\.0\.0\.2/\S+)$").group(1)
        metrics_url = a.line(r"Prometheus metrics at (http://\S+/metrics)").group(1)
        b = spawn(
            "b",
            "join",
            "--initial-peers",
            address,
            *SMALL,
            "--eval-every",
            "20",
            "--listen",
            "/ip4/127.0.0.3/tcp/0",
        )
        dashboard = spawn(
            "dashboard",
            "dashboard",
            "--initial-peers",
            address,
            "--port",
            "0",
            "--listen",
            "/ip4/127.0.0.4/tcp/0",
            "--poll-every",
            "1",
        )
        url = dashboard.line(r"dashboard at (http://\S+/)").group(1)
        peer_a = a.line(r"peer (\w+)").group(1)
        peer_b = b.line(r"peer (\w+)").group(1)
        yield Swarm(a, b, dashboard, url, metrics_url, (peer_a, peer_b))
    finally:
        for process in reversed(started):  # all at once: each exit takes seconds
            process.interrupt()
        for process in reversed(started):
            process.stop()


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


OK_ROUNDS = ("diloco_rounds_total", (("outcome", "ok"),))


def test_node_metrics_endpoint_counts_rounds_as_they_happen(swarm: Swarm) -> None:
    # A round with both nodes (a's rounds alone before b joined send nothing).
    first = wait_for(
        lambda: (m := scrape(swarm.metrics_url))[("diloco_peers_last_round", ())] == 2 and m,
        "a first round of two on /metrics",
        swarm.a,
    )
    later = wait_for(
        lambda: (m := scrape(swarm.metrics_url))[OK_ROUNDS] > first[OK_ROUNDS] and m,
        "the round counter to move",
        swarm.a,
    )
    assert later[("diloco_steps_total", ())] > first[("diloco_steps_total", ())]
    assert later[("diloco_bytes_sent_total", ())] > first[("diloco_bytes_sent_total", ())] > 0
    assert later[("diloco_round_seconds_count", ())] == later[OK_ROUNDS]
    assert later[("diloco_peers_last_round", ())] == 2
    assert later[("diloco_tokens_total", ())] == later[("diloco_steps_total", ())] * 4 * 32


def _state(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "api/state", timeout=10) as response:
        state: dict[str, Any] = json.loads(response.read())
    return state


def test_dashboard_page_shows_both_peers_and_loss_points(swarm: Swarm, tmp_path: Path) -> None:
    _chromium()

    def ready() -> dict[str, Any] | None:
        state = _state(swarm.dashboard_url)
        alive = {p["peer_id"] for p in state["peers"] if p["alive"]}
        train = {s["peer_id"]: len(s["points"]) for s in state["loss"]["train"]}
        outer = state["loss"]["outer"]
        done = set(swarm.peers) <= alive and all(train.get(p, 0) >= 3 for p in swarm.peers)
        return state if done and outer and state["rounds"] else None

    state = wait_for(ready, "both peers with losses on the dashboard", swarm.dashboard)
    assert state["run"]["name"] == "seen" and state["totals"]["peers_alive"] == 2
    dom = _render(swarm.dashboard_url, tmp_path)
    peers_table = _between(dom, '<table id="peers">', "</table>")
    for peer in swarm.peers:
        assert f'data-peer="{peer}"' in peers_table
    train_chart = _between(dom, '<div id="chart-train"', "</svg>")
    for peer in swarm.peers:
        series = _between(train_chart, f'<g class="series" data-peer="{peer}">', "</g>")
        assert series.count('class="point"') >= 3
    outer_chart = _between(dom, '<div id="chart-outer"', "</svg>")
    assert outer_chart.count('class="point"') >= 1
    assert 'class="round ok"' in _between(dom, '<div id="timeline"', "</svg>")
    assert 'class="time-tick"' in train_chart  # clock times under the step axis
    for peer in swarm.peers:  # named by their end: the page stays narrow
        assert f">{peer}<" not in peers_table and f">{peer[-8:]}<" in peers_table
    assert re.search(r'id="progress">step [\d,]+ / 3,000 \(\d+%\)', dom)
    marker = '<code id="join-command">'
    join = _between(dom, marker, "</code>")[len(marker) :]
    address = r"/ip4/127\.0\.0\.[23]/tcp/\d+/p2p/\w+"
    assert re.fullmatch(r"diloco-node join --initial-peers " + address, join), join


def test_after_ctrl_c_the_page_shows_the_run_stopped_with_its_last_eval(
    swarm: Swarm, tmp_path: Path
) -> None:
    """Runs last: Ctrl-C (SIGINT to each node's process group, as a terminal sends it)
    stops both nodes cleanly, and the dashboard, still up, shows how the run ended."""
    for node in (swarm.a, swarm.b):
        os.killpg(node.process.pid, signal.SIGINT)
    for node in (swarm.a, swarm.b):
        assert node.process.wait(120) == 130, node.output()
        after = node.output().split("stopping: ", 1)[1]
        assert not re.search(r"\[(ERROR|WARN)\]|\b(ERROR|WARNING)\b", after), node.output()

    def ended() -> dict[str, Any] | None:
        state = _state(swarm.dashboard_url)
        return state if state["run"]["state"] == "stopped" else None

    state = wait_for(ended, "the run stopped on the dashboard", swarm.dashboard)
    assert state["totals"]["peers_alive"] == 0 and state["run"]["join_command"] is None
    rows = {p["peer_id"]: p for p in state["peers"]}
    for peer in swarm.peers:
        assert rows[peer]["state"] == "stopped" and rows[peer]["final_eval"] is not None
        assert (rows[peer]["device"], rows[peer]["precision"], rows[peer]["batch_size"]) == (
            "cpu",
            "fp32",
            4,
        )
    final = state["run"]["final_eval"]
    assert final is not None and final["loss"] > 0
    dom = _render(swarm.dashboard_url, tmp_path)
    assert '<span id="run-state" class="state stopped">stopped</span>' in dom
    assert f"final held-out loss {final['loss']:.4f}" in dom
    assert '<p id="join" hidden="">' in dom


def _chromium() -> str:
    chromium = shutil.which("chromium")
    if chromium is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is missing in CI: .ci/run should have installed it")
        pytest.skip("chromium is not installed (.ci/run installs it)")
    return chromium


def _render(url: str, tmp_path: Path) -> str:
    """The page's DOM once its script ran, in headless Chromium."""
    result = subprocess.run(
        [
            _chromium(),
            *CHROMIUM_FLAGS,
            f"--user-data-dir={tmp_path / 'profile'}",
            "--dump-dom",
            url,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    dom = result.stdout
    assert result.returncode == 0 and "</html>" in dom, result.stderr[-2000:]
    return dom


def _between(text: str, start: str, end: str) -> str:
    assert start in text, f"{start!r} not in the page"
    head = text.index(start)
    return text[head : text.index(end, head)]
