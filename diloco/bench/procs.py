"""Real ``diloco-node`` processes for the long benchmarks (soak, chaos) and their tests.

A ``NodeProcess`` is one ``python -m diloco`` process in a session of its own (forked by
``launcher``, which spares each node its imports), with its log and its ``--metrics-out``
JSON lines in one folder. ``process_tree``, ``sample`` and ``footprint`` read ``/proc``
(Linux only; no psutil needed): the node's helper processes (the DHT process, ``p2pd``,
torch's shared-memory manager) are found as its descendants by parent PID;
``left_behind`` says what of a killed node's footprint is still there.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diloco.bench.launcher import Process, spawn

PAGE_KB = os.sysconf("SC_PAGE_SIZE") // 1024


class NodeProcess:
    """One node process; ``records()`` reads its metrics file as it grows."""

    def __init__(
        self, name: str, args: list[str], folder: Path, namespace: str | None = None
    ) -> None:
        self.name = name
        self.args = args
        self.namespace = namespace
        """The network namespace it runs in (``diloco.bench.netns``); None: this one."""
        self.log = folder / f"{name}.log"
        self.metrics = folder / f"{name}.jsonl"
        self.process = self._spawn()

    def _spawn(self) -> Process:
        """Forked by the shared launcher, into its namespace if it has one."""
        self.log_offset = self.log.stat().st_size if self.log.exists() else 0
        inside = ["ip", "netns", "exec", self.namespace] if self.namespace else []
        node = [sys.executable, "-m", "diloco", *self.args, "--metrics-out", str(self.metrics)]
        with self.log.open("a") as log:
            return spawn([*inside, *node], log, {**os.environ, "PYTHONUNBUFFERED": "1"})

    def restart(self, args: list[str]) -> None:
        """Start the node again with ``args`` (e.g. with ``--resume``); its log and metrics
        go on in the same files."""
        self.args = args
        self.process = self._spawn()

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def current_output(self) -> str:
        """The log of the running incarnation only."""
        with self.log.open("rb") as log:
            log.seek(self.log_offset)
            return log.read().decode(errors="replace")

    def printed_address(self) -> str | None:
        """The multiaddr the running incarnation printed (its announced one, or on loopback
        or in its namespace), if it has yet."""
        for line in self.current_output().splitlines():
            if line.startswith("/ip4/") and "/p2p/" in line:
                return line.strip()
        return None

    def address(self, timeout: float = 180.0) -> str:
        """Wait for the running incarnation's address."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if address := self.printed_address():
                return address
            if not self.alive():
                raise RuntimeError(f"{self.name} exited:\n{self.output()[-3000:]}")
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} printed no address:\n{self.output()[-3000:]}")

    def records(self) -> list[dict[str, Any]]:
        """Complete JSON lines so far (a line being written is skipped)."""
        if not self.metrics.exists():
            return []
        out = []
        for line in self.metrics.read_text(errors="replace").splitlines():
            if line.endswith("}"):
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
        return out

    def step(self) -> int:
        steps = [r["step"] for r in self.records() if r.get("event") == "step"]
        return steps[-1] if steps else 0

    def kill_group(self) -> None:
        """SIGKILL the node's whole session (cleanup; not the fault a test injects)."""
        if self.alive():
            try:
                os.killpg(self.process.pid, signal.SIGCONT)
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait(10)


def _stat(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name; None if gone or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in "ZX" else fields


def process_tree(pid: int) -> list[int]:
    """The running descendants of ``pid`` (children, their children, ...)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := _stat(int(entry.name))):
            parents[int(entry.name)] = int(fields[1])
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        children = [p for p, pp in parents.items() if pp == parent]
        found += children
        frontier += children
    return sorted(found)


def role(pid: int) -> str:
    """What a node's descendant is: ``p2pd``, ``shm_manager`` or ``dht`` (a Python process:
    hivemind's DHT process has the node's command line)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return "gone"
    if "p2pd" in cmdline:
        return "p2pd"
    if "torch_shm_manager" in cmdline:
        return "shm_manager"
    return "dht"


def usage(pid: int) -> dict[str, int] | None:
    """RSS (kB), open file descriptors and sockets of one process; None if it is gone."""
    fields = _stat(pid)
    if fields is None:
        return None
    fds = sockets = 0
    try:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            fds += 1
            try:
                sockets += os.readlink(fd).startswith("socket:")
            except OSError:
                continue
    except OSError:
        return None
    rss_kb = int(fields[21]) * PAGE_KB  # field 24 of stat: resident pages
    return {"pid": pid, "rss_kb": rss_kb, "fds": fds, "sockets": sockets}


def sample(node_pid: int) -> dict[str, dict[str, int]]:
    """Usage of a node and of each of its helper processes, keyed by role (``node``,
    ``dht``, ``p2pd``, ...; a second process of one role gets ``dht#2``)."""
    out: dict[str, dict[str, int]] = {}
    if (mine := usage(node_pid)) is not None:
        out["node"] = mine
    for pid in process_tree(node_pid):
        name = role(pid)
        if (used := usage(pid)) is None or name == "gone":
            continue
        key, n = name, 1
        while key in out:
            n += 1
            key = f"{name}#{n}"
        out[key] = used
    return out


@dataclass(frozen=True)
class Footprint:
    """What a running node holds beside its own process, all of which must go when it is
    killed (SIGKILL, as the OOM killer sends it): nothing in it can clean up."""

    helpers: tuple[int, ...]
    """Its descendants: the DHT process, p2pd, torch's shared-memory manager."""
    daemon_sockets: frozenset[str]
    """p2pd's unix socket paths (``/tmp/hivemind-p2pd-*.sock``)."""
    shm_files: frozenset[str]
    """torch's shared-memory files of the node and its helpers (``/dev/shm/torch_PID_*``)."""


def footprint(pid: int) -> Footprint:
    """The footprint of the running node ``pid`` now."""
    helpers = process_tree(pid)
    inodes = set()
    for each in helpers:
        fds = Path(f"/proc/{each}/fd")
        try:
            links = [os.readlink(fd) for fd in fds.iterdir()]
        except OSError:
            continue
        inodes |= {link[len("socket:[") : -1] for link in links if link.startswith("socket:[")}
    lines = Path("/proc/net/unix").read_text().splitlines()[1:]
    sockets = {f[7] for f in map(str.split, lines) if len(f) == 8 and f[6] in inodes}
    prefixes = tuple(f"torch_{p}_" for p in (pid, *helpers))
    shm = {f.name for f in Path("/dev/shm").glob("torch_*") if f.name.startswith(prefixes)}
    return Footprint(
        tuple(helpers),
        frozenset(path for path in sockets if "/hivemind-p2pd-" in path),
        frozenset(shm),
    )


def left_behind(held: Footprint) -> list[str]:
    """What of a killed node's footprint is still there: running helpers (by PID), socket
    paths, shared-memory files."""
    return [
        *[f"pid {pid}" for pid in held.helpers if _stat(pid) is not None],
        *[path for path in held.daemon_sockets if Path(path).exists()],
        *[f"/dev/shm/{name}" for name in held.shm_files if Path("/dev/shm", name).exists()],
    ]
