"""The node as a user runs it: separate `diloco-node` processes on loopback.

One scenario covers several promises at once (starting processes costs seconds on two
cores): a joiner with a mismatching configuration is refused; a second node joins at once;
a third joins after about a third of the run and catches up; SIGINT stops the second node
within the bound, with a checkpoint and nothing left behind, while the others train on;
every (fragment, round) that several nodes applied has one state hash.

A swarm of these small nodes trains faster than a new node starts (its DHT process and
p2pd: seconds on two cores, many more under load), so a joiner started at a given step
could find the run over, and the test waits for no process while the swarm trains towards
a step it acts at: the late joiner starts with the swarm held (``held``), the refused
joiner runs beside the others.

Every node process is forked from one warm interpreter (``diloco.bench.launcher``): a new
interpreter would first spend about 2 s of CPU importing torch and hivemind.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from diloco.bench.launcher import Process, spawn

pytestmark = pytest.mark.swarm

STEPS = 300
H = 30
EXIT_BOUND_S = 10.0
"""The node abandons rounds at once and waits at most 5 s for those in flight; leaving the
swarm takes at most about 3 s more (typically 0.1 s), the interpreter's exit about 1-2 s."""
CLEANUP_S = 30.0
"""torch's shared-memory manager removes the node's /dev/shm files, then exits, about 2 s
after the node (10.05 s once on the loaded machine: the bound is a guard against files
never removed, not a speed target)."""
SMALL = [
    "--preset", "micro", "--seq-len", "32", "--batch-size", "4", "--log-every", "20",
    "--threads", "1", "--tau", "1",
]  # fmt: skip
"""Small and fast nodes, tau pinned (not auto, which follows the timing): the tests that
compare final states or a resumed run with an uninterrupted one need the same tau everywhere
(test_wan_tau.py covers auto)."""


def stat(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name (state, ppid, pgrp, session, ...);
    None for a process that is gone or a zombie (nothing runs; its parent has not reaped it)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in "ZX" else fields


def started_by(pid: int) -> tuple[list[int], list[int]]:
    """The running processes a node started: its DHT process (in the node's session:
    start_new_session) and that process's p2pd (in a session of its own, so a terminal's
    Ctrl-C reaches it only through the node), and the node's children outside them
    (torch's shared-memory manager)."""
    table = {}
    for entry in Path("/proc").iterdir():
        fields = stat(int(entry.name)) if entry.name.isdigit() else None
        if fields and int(entry.name) != pid:
            table[int(entry.name)] = fields
    session = [p for p, f in table.items() if f[3] == str(pid)]
    session += [p for p, f in table.items() if f[1] in map(str, session) and p not in session]
    others = [p for p, f in table.items() if f[1] == str(pid) and p not in session]
    return session, others


def unix_sockets(pids: list[int]) -> set[str]:
    """Paths of the unix sockets these processes hold (p2pd's, p2p clients', torch's)."""
    inodes = set()
    for pid in pids:
        fds = Path(f"/proc/{pid}/fd")
        for fd in fds.iterdir() if fds.exists() else ():
            try:
                link = os.readlink(fd)
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[len("socket:[") : -1])
    lines = Path("/proc/net/unix").read_text().splitlines()[1:]
    return {f[7] for f in map(str.split, lines) if len(f) == 8 and f[6] in inodes}


def shm_files(pids: list[int]) -> set[str]:
    """torch's shared-memory files (/dev/shm/torch_PID_...) made by these processes."""
    prefixes = tuple(f"torch_{pid}_" for pid in pids)
    return {f.name for f in Path("/dev/shm").glob("torch_*") if f.name.startswith(prefixes)}


def listen(host: int) -> list[str]:
    """Each node on its own loopback address: libp2p limits connections per source IP."""
    return ["--listen", f"/ip4/127.0.0.{host}/tcp/0"]


class Node:
    """``python -m diloco ARGS`` in a session of its own, its output in ``NAME.log``, its
    metrics in ``NAME.jsonl``."""

    def __init__(self, name: str, args: list[str], folder: Path) -> None:
        self.name = name
        self.log = folder / f"{name}.log"
        self.metrics = folder / f"{name}.jsonl"
        command = [sys.executable, "-m", "diloco", *args, "--metrics-out", str(self.metrics)]
        with self.log.open("w") as log:
            env = {**os.environ, "PYTHONUNBUFFERED": "1"}
            self.process: Process = spawn(command, log, env)

    def output(self) -> str:
        return self.log.read_text() if self.log.exists() else ""

    def address(self, timeout: float = 120.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.output().splitlines():
                if line.startswith("/ip4/127."):
                    return line.strip()
            assert self.process.poll() is None, self.output()
            time.sleep(0.5)
        raise AssertionError(f"{self.name} printed no address:\n{self.output()}")

    def records(self) -> list[dict[str, Any]]:
        if not self.metrics.exists():
            return []
        lines = self.metrics.read_text().splitlines()
        return [json.loads(line) for line in lines if line.endswith("}")]

    def step(self) -> int:
        steps = [r["step"] for r in self.records() if r["event"] == "step"]
        return steps[-1] if steps else 0

    def wait_step(self, step: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.step() < step:
            assert time.monotonic() < deadline, f"{self.name} stuck at {self.step()}"
            assert self.process.poll() is None, self.output()
            time.sleep(0.5)

    def wait_dht(self, timeout: float) -> None:
        """Until this node's DHT process and p2pd run (its interpreter has started)."""
        deadline = time.monotonic() + timeout
        while len(started_by(self.process.pid)[0]) < 2:
            assert time.monotonic() < deadline, f"{self.name} started no DHT"
            assert self.process.poll() is None, self.output()
            time.sleep(0.2)

    def summary(self) -> dict[str, Any]:
        return next(r for r in self.records() if r["event"] == "summary")

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)


@contextmanager
def held(*nodes: Node) -> Iterator[None]:
    """The nodes' training processes stopped (SIGSTOP) meanwhile, then continued: they take
    no step, while their DHT processes and p2pds (other processes) keep answering the
    DHT."""
    for node in nodes:
        os.kill(node.process.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for node in nodes:
            os.kill(node.process.pid, signal.SIGCONT)


@pytest.fixture
def nodes(tmp_path):
    started: list[Node] = []

    def spawn(name: str, args: list[str]) -> Node:
        node = Node(name, args, tmp_path)
        started.append(node)
        return node

    yield spawn
    for node in started:
        node.stop()


def test_swarm_of_cli_processes_trains_agrees_and_survives(nodes, tmp_path) -> None:
    run = ["--name", "t", "--steps", str(STEPS), "--H", str(H)]
    a = nodes("a", ["start", *run, *SMALL, *listen(2)])
    address = a.address()

    checkpoints = tmp_path / "b_checkpoints"
    join_b = ["join", "--initial-peers", address, *SMALL, *listen(3)]
    b = nodes("b", [*join_b, "--checkpoint-dir", str(checkpoints)])

    # the refused joiner runs beside the others: waited for here (a DHT start, seconds,
    # many more under load), it would let the swarm train past c's turn
    wrong_err = tmp_path / "wrong.err"
    with wrong_err.open("w") as err, open(os.devnull, "w") as devnull:
        wrong = spawn(
            [sys.executable, "-m", "diloco", "join", "--initial-peers", address,
             "--H", "7", "--steps", "999", *listen(5)],
            devnull,
            dict(os.environ),
            stderr=err,
        )  # fmt: skip

    a.wait_step(STEPS // 3, timeout=300)
    # c's DHT starts while a and b are held; then c asks a for the run, is dialled back
    # and asks for the state (a's training process answers those), which takes the swarm
    # about 70 steps on two cores
    with held(a, b):
        c = nodes("c", ["join", "--initial-peers", address, *SMALL, *listen(4)])
        c.wait_dht(timeout=300)
    assert wrong.wait(120) != 0
    assert "differs from the swarm" in wrong_err.read_text(), wrong_err.read_text()
    assert f"--H: the run's {H}, yours 7" in wrong_err.read_text()
    c.wait_step(STEPS // 3 + 40, timeout=300)
    b.wait_step(STEPS - H, timeout=300)  # the others train on for 5 rounds after b left

    session, others = started_by(b.process.pid)
    assert len(session) == 2, f"expected the DHT process and p2pd, got {session}"
    everyone = [b.process.pid, *session, *others]
    sockets = unix_sockets(everyone)
    assert any("/hivemind-p2pd-" in path for path in sockets), sockets
    assert shm_files(everyone), "expected hivemind's shared memory (torch_PID_*) in use"
    b.process.send_signal(signal.SIGINT)
    stopped_at = time.monotonic()
    assert b.process.wait(60) == 130, b.output()  # 128 + SIGINT: stopped after saving
    exit_seconds = time.monotonic() - stopped_at
    assert exit_seconds < EXIT_BOUND_S, f"SIGINT took {exit_seconds:.1f} s"
    summary = b.summary()
    assert summary["interrupted"] and summary["step"] < STEPS
    assert summary["checkpoint"] and Path(summary["checkpoint"]).parent == checkpoints
    assert Path(summary["checkpoint"]).exists()
    # The DHT process, p2pd and their sockets end with the node; torch's manager removes
    # the shared memory and exits soon after.
    assert not [pid for pid in session if stat(pid)], "processes left running"
    assert not [path for path in sockets if "/hivemind-" in path and Path(path).exists()]
    deadline = time.monotonic() + CLEANUP_S
    while left := [
        *[pid for pid in others if stat(pid)],
        *shm_files(everyone),
        *[path for path in sockets if Path(path).exists()],
    ]:
        assert time.monotonic() < deadline, f"left behind: {left}"
        time.sleep(0.2)

    for node in (a, c):
        assert node.process.wait(300) == 0, node.output()
        assert node.summary()["step"] == STEPS and not node.summary()["interrupted"]

    # Loss falls: the first progress line against the last.
    progress = [r["loss"] for r in a.records() if r["event"] == "progress"]
    assert progress[-1] < 0.75 * progress[0]

    # Every (fragment, round) applied by several nodes has one outer state hash.
    hashes: dict[tuple[int, int], dict[str, str]] = defaultdict(dict)
    for node in (a, b, c):
        for r in node.records():
            if r["event"] == "round":
                hashes[(r["fragment"], r["round"])][node.name] = r["outer_sha256"]
    shared = {k: v for k, v in hashes.items() if len(v) >= 2}
    assert len(shared) >= 10
    assert all(len(set(v.values())) == 1 for v in shared.values()), shared

    # The late joiner started from the swarm's step and shares rounds with the others.
    joined = next(r for r in c.records() if r["event"] == "joined")
    assert joined["step"] >= STEPS // 3
    c_rounds = [k for k, v in hashes.items() if "c" in v and len(v) >= 2]
    assert c_rounds, "the late joiner never shared a round"
    assert a.summary()["outer_sha256"] == c.summary()["outer_sha256"]


def test_single_node_resume_equals_uninterrupted_run(nodes, tmp_path) -> None:
    common = [
        "start",
        "--name",
        "r",
        "--steps",
        "60",
        "--matchmaking-window",
        "0.1",
        "--data-seed",
        "3",
        "--checkpoint-every",
        "30",
        *SMALL,
    ]
    straight = nodes(
        "straight",
        [
            *common,
            "--checkpoint-dir",
            str(tmp_path / "d1"),
            "--export",
            str(tmp_path / "straight.safetensors"),
        ],
    )
    # the resumed run starts as soon as the checkpoint is there (saved by an atomic rename)
    checkpoint = tmp_path / "d1" / "step_000000030"
    deadline = time.monotonic() + 300
    while not checkpoint.exists():
        assert straight.process.poll() is None or checkpoint.exists(), straight.output()
        assert time.monotonic() < deadline, "no checkpoint at step 30"
        time.sleep(0.2)
    (tmp_path / "d2").mkdir()
    shutil.copytree(checkpoint, tmp_path / "d2" / "step_000000030")
    # the run's creator resumes it: its identity (kept in the checkpoint dir) comes along
    shutil.copy(tmp_path / "d1" / "identity.key", tmp_path / "d2" / "identity.key")

    resumed = nodes(
        "resumed",
        [
            *common,
            "--checkpoint-dir",
            str(tmp_path / "d2"),
            "--resume",
            "--export",
            str(tmp_path / "resumed.safetensors"),
        ],
    )
    assert straight.process.wait(300) == 0, straight.output()
    assert resumed.process.wait(300) == 0, resumed.output()
    assert "resumed from" in resumed.output()
    a, b = straight.summary(), resumed.summary()
    assert a["versions"] == b["versions"] and min(a["versions"]) >= 1
    # tiny: 5 fragments at offsets 0, 6, ..., 24 (H 30): fragment 0 sends round 2 at step
    # 60, the last, and with tau 1 receives it after it; the run's end applies it.
    # Alone in its swarm, with the default group size: every round is a round of one.
    assert a["versions"] == [2, 1, 1, 1, 1] and a["rounds_pending"] == b["rounds_pending"] == 0
    assert (a["rounds_alone"], a["failed_rounds"]) == (6, 0)
    assert "rounds pending at end: 0" in straight.output()
    assert a["outer_sha256"] == b["outer_sha256"]
    assert a["eval_loss"] == b["eval_loss"] and a["eval_loss_local"] == b["eval_loss_local"]
    straight_weights = load_file(str(tmp_path / "straight.safetensors"))
    resumed_weights = load_file(str(tmp_path / "resumed.safetensors"))
    assert straight_weights.keys() == resumed_weights.keys()
    assert all(torch.equal(straight_weights[k], resumed_weights[k]) for k in straight_weights)


def test_bf16_nodes_on_prepared_tokens_agree_and_export_for_transformers(
    nodes, tmp_path, monkeypatch
) -> None:
    """Two nodes with bf16 autocast and micro-batches (each its own) on a BPE-prepared
    corpus: the run takes the tokenizer's vocabulary, every shared round has one outer hash,
    and `--export-hf` loads in transformers with the logits of the `--export` weights.
    The run sends means back in int8 (`--return-codec`, which the joiner takes from the
    run), and both nodes end with the last rounds applied and one outer state."""
    from bpe_corpus import write_bpe_corpus
    from click.testing import CliRunner

    from diloco.cli import main

    write_bpe_corpus(tmp_path)
    data = tmp_path / "tokens"
    prepared = CliRunner().invoke(
        main,
        ["prepare-data", str(tmp_path / "docs.jsonl"), "-o", str(data), "--processes", "1",
         "--tokenizer", str(tmp_path / "tokenizer.json")],
    )  # fmt: skip
    assert prepared.exit_code == 0, prepared.output
    common = ["--data", str(data), "--precision", "bf16", "--batch-size", "4", "--threads", "1"]
    a = nodes(
        "a",
        ["start", "--name", "bf", "--preset", "micro", "--steps", "40", "--H", "10",
         "--seq-len", "32", *common,
         "--micro-batch-size", "2", "--return-codec", "int8", *listen(2),
         "--export", str(tmp_path / "outer.safetensors"),
         "--export-hf", str(tmp_path / "hf")],
    )  # fmt: skip
    b = nodes(
        "b",
        ["join", "--initial-peers", a.address(), *common, "--micro-batch-size", "1", *listen(3)],
    )
    for node in (a, b):
        assert node.process.wait(300) == 0, node.output()
    hashes: dict[tuple[int, int], set[str]] = defaultdict(set)
    for node in (a, b):
        for r in node.records():
            if r["event"] == "round" and r["members"] == 2:
                hashes[(r["fragment"], r["round"])].add(r["outer_sha256"])
    assert len(hashes) >= 5 and all(len(h) == 1 for h in hashes.values()), hashes
    configs = [next(r for r in n.records() if r["event"] == "config") for n in (a, b)]
    assert [c["return_codec"] for c in configs] == ["int8", "int8"]
    ends = [n.summary() for n in (a, b)]
    assert [e["rounds_pending"] for e in ends] == [0, 0]
    assert ends[0]["versions"] == ends[1]["versions"]
    assert ends[0]["outer_sha256"] == ends[1]["outer_sha256"]

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a local folder; never the network
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from diloco.node.model.transformer import ModelConfig, Transformer

    with safe_open(str(tmp_path / "outer.safetensors"), framework="pt") as f:
        config = ModelConfig(**json.loads(f.metadata()["model_config"]))
    vocab = json.loads((data / "manifest.json").read_text())["tokenizer"]["vocab_size"]
    assert config.vocab_size == vocab > 256
    ours = Transformer(config).eval()
    ours.load_state_dict(load_file(str(tmp_path / "outer.safetensors")))
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tokens = torch.randint(0, vocab, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(theirs(tokens).logits, ours(tokens)[0], atol=1e-4, rtol=0)
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == (
        tmp_path / "tokenizer.json"
    ).read_bytes()
