"""A volunteer behind NAT: a node in a network namespace behind a masquerading
router, which nobody can dial, trains with two dialable nodes as a client.

Topology (root only; everything made here is removed at the end, also on failure)::

    root namespace: nodes a, b on WAN_HOST  --veth--  router ns (WAN_ROUTER, MASQUERADE)
                                                          |  veth
                                                      client ns: node c on LAN_CLIENT

The root namespace has no route to the LAN: c reaches a and b through the router, which
rewrites its source address; a and b cannot open a connection to c. The iptables rule and
ip_forward live inside the router's namespace and vanish with it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from diloco.bench import launcher

pytestmark = pytest.mark.swarm

STEPS = 120
SMALL = ["--seq-len", "32", "--batch-size", "4", "--log-every", "20", "--threads", "1"]
TAG = f"{os.getpid() % 100_000}"
ROUTER, CLIENT = f"dlnr{TAG}", f"dlnc{TAG}"
WAN_HOST, WAN_ROUTER = "10.79.0.1", "10.79.0.2"
LAN_ROUTER, LAN_CLIENT = "172.31.79.1", "172.31.79.2"


def _run(*command: str) -> None:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"`{' '.join(command)}` failed: {done.stderr.strip()}")


def _down() -> None:
    for name in (ROUTER, CLIENT):
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    subprocess.run(["ip", "link", "del", f"dlw{TAG}"], capture_output=True)


def _up() -> None:
    wan, rwan, rlan, clan = f"dlw{TAG}", f"dlrw{TAG}", f"dlrl{TAG}", f"dlcl{TAG}"
    _run("ip", "netns", "add", ROUTER)
    _run("ip", "netns", "add", CLIENT)
    _run("ip", "link", "add", wan, "type", "veth", "peer", "name", rwan)
    _run("ip", "link", "set", rwan, "netns", ROUTER)
    _run("ip", "addr", "add", f"{WAN_HOST}/24", "dev", wan)
    _run("ip", "link", "set", wan, "up")
    _run("ip", "link", "add", rlan, "type", "veth", "peer", "name", clan)
    _run("ip", "link", "set", rlan, "netns", ROUTER)
    _run("ip", "link", "set", clan, "netns", CLIENT)
    for ns, dev, addr in ((ROUTER, rwan, WAN_ROUTER), (ROUTER, rlan, LAN_ROUTER)):
        _run("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
        _run("ip", "-n", ns, "link", "set", dev, "up")
    _run("ip", "-n", CLIENT, "addr", "add", f"{LAN_CLIENT}/24", "dev", clan)
    _run("ip", "-n", CLIENT, "link", "set", clan, "up")
    for ns in (ROUTER, CLIENT):
        _run("ip", "-n", ns, "link", "set", "lo", "up")
    _run("ip", "-n", CLIENT, "route", "add", "default", "via", LAN_ROUTER)
    _run("ip", "netns", "exec", ROUTER, "sysctl", "-qw", "net.ipv4.ip_forward=1")
    _run("ip", "netns", "exec", ROUTER, "iptables", "-t", "nat", "-A", "POSTROUTING",
         "-o", rwan, "-j", "MASQUERADE")  # fmt: skip


def _skip_reason() -> str | None:
    if sys.platform != "linux" or os.geteuid() != 0:
        return "needs root on Linux (network namespaces)"
    missing = [tool for tool in ("ip", "iptables", "sysctl") if shutil.which(tool) is None]
    if missing:
        return f"needs {', '.join(missing)}"
    return None


@pytest.fixture
def nat() -> Iterator[None]:
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    _down()  # leftovers of a killed run with this pid
    try:
        _up()
    except RuntimeError as error:
        _down()
        pytest.skip(f"cannot build the NAT namespaces here: {error}")
    try:
        yield
    finally:
        _down()


class Node:
    def __init__(self, name: str, args: list[str], folder: Path, netns: str | None = None):
        self.name, self.log, self.metrics = name, folder / f"{name}.log", folder / f"{name}.jsonl"
        prefix = ["ip", "netns", "exec", netns] if netns else []
        command = [*prefix, sys.executable, "-m", "diloco", *args]
        with self.log.open("w") as log:
            env = {**os.environ, "PYTHONUNBUFFERED": "1"}
            self.process = launcher.spawn([*command, "--metrics-out", str(self.metrics)], log, env)

    def output(self) -> str:
        return self.log.read_text() if self.log.exists() else ""

    def address(self, prefix: str = f"/ip4/{WAN_HOST}/", timeout: float = 120.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.output().splitlines():
                if line.startswith(prefix):
                    return line.strip()
            assert self.process.poll() is None, self.output()
            time.sleep(0.5)
        raise AssertionError(f"{self.name} printed no address:\n{self.output()}")

    def records(self) -> list[dict[str, Any]]:
        if not self.metrics.exists():
            return []
        lines = self.metrics.read_text().splitlines()
        return [json.loads(line) for line in lines if line.endswith("}")]

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)


def test_node_behind_nat_trains_as_a_client_with_two_dialable_nodes(nat, tmp_path) -> None:
    listen = ["--listen", f"/ip4/{WAN_HOST}/tcp/0"]
    started: list[Node] = []
    # all three start at step 0 (each waits for the two others): the run takes seconds, and
    # c's start in its namespace must not decide how many rounds it shares
    wait = ["--wait-for-peers", "2"]
    try:
        run = ["start", "--name", "nat", "--steps", str(STEPS), *SMALL, *wait, *listen]
        a = Node("a", run, tmp_path)
        started.append(a)
        address = a.address()
        join = ["join", "--initial-peers", address, *SMALL, *wait]
        started.append(Node("b", [*join, *listen], tmp_path))
        behind = ["--listen", f"/ip4/{LAN_CLIENT}/tcp/0"]
        started.append(Node("c", [*join, *behind], tmp_path, netns=CLIENT))
        for node in started:
            assert node.process.wait(600) == 0, node.output()
    finally:
        for node in started:
            node.stop()
    a, b, c = started
    # a and b could not dial c back, so c found out by itself that it is a client.
    assert "no peer could dial this node back" in c.output(), c.output()
    assert "no peer could dial this node back" not in a.output() + b.output()

    hashes: dict[tuple[int, int], dict[str, str]] = defaultdict(dict)
    for node in started:
        for r in node.records():
            if r["event"] == "round" and r["members"] == 3:
                hashes[(r["fragment"], r["round"])][node.name] = r["outer_sha256"]
    with_c = {k: v for k, v in hashes.items() if "c" in v}
    assert len(with_c) >= 3, dict(hashes)
    assert all(len(v) >= 2 and len(set(v.values())) == 1 for v in with_c.values()), with_c
    assert c.records()[-1]["event"] == "summary"


def test_forced_client_mode_trains_with_a_dialable_node(tmp_path) -> None:
    """`--client-mode` on loopback: the node is dialable but told to be a client (its DHT
    in hivemind's client mode too); it takes part in rounds, which agree."""
    started: list[Node] = []
    try:
        start = ["start", "--name", "cm", "--steps", "90", *SMALL]
        a = Node("a", [*start, "--listen", "/ip4/127.0.0.2/tcp/0"], tmp_path)
        started.append(a)
        join = ["join", "--initial-peers", a.address("/ip4/127.0.0.2/"), *SMALL]
        c = Node("c", [*join, "--client-mode", "--listen", "/ip4/127.0.0.4/tcp/0"], tmp_path)
        started.append(c)
        for node in started:
            assert node.process.wait(600) == 0, node.output()
    finally:
        for node in started:
            node.stop()
    hashes: dict[tuple[int, int], dict[str, str]] = defaultdict(dict)
    for node in started:
        for r in node.records():
            if r["event"] == "round" and r["members"] == 2:
                hashes[(r["fragment"], r["round"])][node.name] = r["outer_sha256"]
    both = {k: v for k, v in hashes.items() if len(v) == 2}
    assert len(both) >= 2, dict(hashes)
    assert all(len(set(v.values())) == 1 for v in both.values()), both
    assert "dial this node back" not in c.output()  # forced: nobody was asked
