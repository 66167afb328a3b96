"""Attacks on healing and joining by real `diloco-node` processes, by a hostile peer that really
misbehaves (``hostile_claims.py``, built from the project's classes, with validly signed
records of its own identities).

- Attack 1: a peer claims every fragment at version +1000 and the run's last step, vouches
  for its forged state alone and serves zeros; it also spams the honest nodes' state
  handler (attack 6's "hash and stream the whole state for every 30-byte request").
- Attack 6: Sybil records crowd the donors (copies of the honest claims, newer unvouched
  claims, claims of the run's last step); a late joiner must still join honestly.
- Paper identities (docs/design.md "Evidence"): a process holding K keys that never work
  in a round (K = 2 and K = 8, two processes) serves zeros at the run's last step and
  vouches for them under member lists it writes; nobody may adopt them or follow its step.

All attacks run in one swarm (a module fixture; a swarm run costs about 40 s on two
cores): node a starts and waits for another record before its first step (the forger's,
as a rule), the forger, the Sybil peer and the paper peers join, b joins early, c late.
Each test fails without its defence: without the schedule bound and the vouch rule the
early joiner b adopts the zeros at the last step and exits at once; without them the late
joiner c tries Sybils only and never joins; without the evidence rule (counting any vouch
a member list makes a majority) a and b adopt the paper peers' zeros at the last step.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import signal
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from test_swarm_node import SMALL, Node, listen

from diloco.bench.launcher import Process, spawn

pytestmark = pytest.mark.swarm

HOSTILE = Path(__file__).with_name("hostile_claims.py")
STEPS = 150
TIMEOUT = 900.0
FAST = [*SMALL, "--matchmaking-window", "0.5"]
"""The window at 0.5 s (default 2 s): the Sybil and paper keys count as live nodes, so every
round open to them waits out its window, the widest (four windows) while a peer that took
a node's state has not met it yet (the forger's state requests)."""
PAPER_KEYS = (2, 8)
"""Keys of each paper peer (one process each)."""


class Hostile:
    """The hostile peer process; its stdout holds JSON lines (``hostile_claims.py``)."""

    def __init__(self, mode: str, address: str, folder: Path, host: int, *extra: str) -> None:
        self.log = folder / f"hostile-{mode}{''.join(extra)}.log"
        with self.log.open("w") as log:
            where = ["--initial-peers", address, "--listen", f"/ip4/127.0.0.{host}/tcp/0"]
            env = {**os.environ, "PYTHONUNBUFFERED": "1"}
            command = [sys.executable, str(HOSTILE), mode, *where, *extra]
            self.process: Process = spawn(command, log, env)

    def lines(self) -> list[dict[str, Any]]:
        text = self.log.read_text() if self.log.exists() else ""
        return [json.loads(line) for line in text.splitlines() if line.startswith("{")]

    def ready(self, timeout: float = 120.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if found := [line for line in self.lines() if "ready" in line]:
                return found[0]
            assert self.process.poll() is None, self.log.read_text()
            time.sleep(0.5)
        raise AssertionError(f"the hostile peer did not start:\n{self.log.read_text()}")

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)


@dataclass
class Run:
    """The finished swarm run both tests read."""

    a: Node
    b: Node
    c: Node
    forge: Hostile
    forger: str
    sybils: list[str]
    papers: dict[int, list[str]]
    """Keys -> the paper peer's identities (its own, which serves, first)."""


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    folder = tmp_path_factory.mktemp("attacks")
    started: list[Node | Hostile] = []
    try:
        creator = ["--name", "atk", "--steps", str(STEPS), "--wait-for-peers", "1"]
        a = Node("a", ["start", *creator, *FAST, *listen(2)], folder)
        started.append(a)
        address = a.address()
        forge = Hostile("forge", address, folder, host=6)
        started.append(forge)
        sybil = Hostile("sybil", address, folder, host=7)
        started.append(sybil)
        paper = {
            k: Hostile("paper", address, folder, 8 + i, "--keys", str(k))
            for i, k in enumerate(PAPER_KEYS)
        }
        started.extend(paper.values())
        forger, sybils = forge.ready()["peer_id"], sybil.ready()["sybils"]
        papers = {k: [(r := p.ready())["peer_id"], *r["sybils"]] for k, p in paper.items()}
        b = Node("b", ["join", "--initial-peers", address, *FAST, *listen(3)], folder)
        started.append(b)
        a.wait_step(STEPS // 3, timeout=TIMEOUT)
        c = Node("c", ["join", "--initial-peers", address, *FAST, *listen(4)], folder)
        started.append(c)
        for node in (a, b, c):
            assert node.process.wait(TIMEOUT) == 0, node.output()
            summary = node.summary()
            assert summary["step"] == STEPS and not summary["interrupted"]
        yield Run(a, b, c, forge, forger, sybils, papers)
    finally:
        for process in started:
            process.stop()


def round_hashes(nodes: list[Node]) -> dict[tuple[int, int], dict[str, str]]:
    hashes: dict[tuple[int, int], dict[str, str]] = defaultdict(dict)
    for node in nodes:
        for r in node.records():
            if r["event"] == "round":
                hashes[(r["fragment"], r["round"])][node.name] = r["outer_sha256"]
    return hashes


def zero_hashes(node: Node) -> list[str]:
    """Per fragment, the hash of the all-zero state the forger serves."""
    config = next(r for r in node.records() if r["event"] == "config")
    return [hashlib.sha256(bytes(8 * n)).hexdigest() for n in config["fragment_numel"]]


def test_forged_versions_last_step_and_state_spam_change_nothing(run: Run) -> None:
    a, b, forger = run.a, run.b, run.forger
    # Nobody jumped to the last step: b joined early; a catch-up (if any) is a short one.
    joined = next(r for r in b.records() if r["event"] == "joined")
    assert joined["step"] < STEPS // 2, joined
    for node in (a, b):
        jumps = [r for r in node.records() if r["event"] == "caught_up"]
        assert all(r["to_step"] - r["from_step"] < 30 for r in jumps), jumps

    # Nothing of the forged state reached them: their rounds agree, their states are equal.
    zeros = zero_hashes(a)
    hashes = round_hashes([a, b, run.c])
    shared = {k: v for k, v in hashes.items() if "a" in v and "b" in v}
    assert len(shared) >= 10
    assert all(len(set(v.values())) == 1 for v in shared.values()), shared
    assert all(h != zeros[p] for (p, _), v in hashes.items() for h in v.values())
    assert a.summary()["outer_sha256"] == b.summary()["outer_sha256"]
    assert not set(a.summary()["outer_sha256"]) & set(zeros)

    # The offender is named with its offence, by the joiner and by the node it spammed.
    offence = f"peer {forger}: record ignored: fragment 0 at version 1000 is beyond round"
    assert offence in b.output(), b.output()
    assert f"peer {forger}: record ignored:" in a.output(), a.output()
    assert f"state requests from {forger} refused (BUSY)" in a.output()
    counts = [line for line in run.forge.lines() if "refused" in line]
    assert counts and counts[-1]["refused"] > counts[-1]["served"] >= 1, counts[-1:]
    assert_no_honest_offender([a, b, run.c])


def assert_no_honest_offender(nodes: list[Node]) -> None:
    """No honest node took another for an offender (the bounds leave honest claims room)."""
    ids = [next(r for r in n.records() if r["event"] == "config")["peer_id"] for n in nodes]
    for node in nodes:
        assert not [i for i in ids if f"peer {i}: " in node.output()], node.output()


def test_sybil_records_do_not_crowd_out_a_late_joiners_honest_donors(run: Run) -> None:
    a, b, c = run.a, run.b, run.c
    # c came in once a had passed STEPS // 3; it starts at the swarm's step when it has
    # found its donors among the Sybils (30-40 steps later on two cores), never at the
    # Sybils' last step: it has at least one round to train with the others.
    joined = next(r for r in c.records() if r["event"] == "joined")
    sync_every = next(r for r in c.records() if r["event"] == "config")["sync_every"]
    assert 0 < joined["step"] < STEPS - sync_every, joined
    # The joiner took an honest, vouched state: it trains in line with the others.
    hashes = round_hashes([a, b, c])
    c_rounds = [v for v in hashes.values() if "c" in v and len(v) >= 2]
    assert c_rounds and all(len(set(v.values())) == 1 for v in c_rounds)
    assert a.summary()["outer_sha256"] == b.summary()["outer_sha256"]
    assert a.summary()["outer_sha256"] == c.summary()["outer_sha256"], c.output()[-6000:]
    # The Sybils that claim the run's last step (every third) are named with the offence by
    # b, which read them from its join on. Their claims run ahead of the pace only while it
    # is below STEPS - 2 * sync_every (90): c first read them at a pace of 68-84 here, and
    # once in CI at 90 or more, where they are inside the bound.
    for sybil in run.sybils[2::3]:
        assert f"peer {sybil}: step not followed: global step {STEPS} runs ahead" in b.output()


def test_paper_identities_change_no_state_and_no_step(run: Run) -> None:
    """K keys that never worked with a or b vouch for zeros at the run's last step, under
    member lists they write (a majority of their own list): a and b never adopt them, never
    jump ahead, and name every key once."""
    a, b = run.a, run.b
    zeros = zero_hashes(a)
    for node in (a, b):
        rounds = [r for r in node.records() if r["event"] == "round"]
        assert len(rounds) >= 10 and all(r["outer_sha256"] != zeros[r["fragment"]] for r in rounds)
        jumps = [r for r in node.records() if r["event"] == "caught_up"]
        assert all(r["to_step"] - r["from_step"] < 30 for r in jumps), jumps
        summary = node.summary()
        assert not set(summary["outer_sha256"]) & set(zeros)
        # All-zero weights give uniform logits over the 256 bytes: a loss of ln 256.
        assert summary["eval_loss"] < 0.9 * math.log(256), summary["eval_loss"]
    assert a.summary()["outer_sha256"] == b.summary()["outer_sha256"]
    # a (the creator, no anchors) has a pace only through the peers it saw work (the
    # witness that SwarmNode feeds after each round): its "step not followed" shows it.
    for keys in run.papers.values():
        for key in keys:
            for node in (a, b):
                refused = f"not counting the vouches of peer {key} (no round with this node)"
                assert refused in node.output(), (key, node.name)
                assert f"peer {key}: step not followed: global step {STEPS} runs ahead" in (
                    node.output()
                ), (key, node.name)
