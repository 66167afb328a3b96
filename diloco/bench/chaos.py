"""Chaos run: real node processes, killed and frozen at random; what survives?

The swarm: ``diloco-node start`` (node ``a``) and ``nodes - 1`` joiners on loopback, each
with its own checkpoint folder, data seed and loopback address. After every node has made
its first checkpoint and the creator has applied a round with each joiner, the controller
runs ``cycles`` fault cycles (all choices from one seeded ``random.Random``). The faults
hit a swarm that has worked together: a node that has seen nobody work cannot tell the
joiners from paper keys, so it cannot heal to their state (docs/design.md "Healing and
joining"), and the run's first node works alone until the joiners are up.

1. *freeze*: SIGSTOP a random node's whole session (node, DHT process, p2pd: a machine
   that stalls) for ``freeze_s``, longer than a round's deadline (matchmaking window plus
   round timeout), then SIGCONT;
2. meanwhile *kill*: SIGKILL a random other joiner's node process alone (as the OOM killer
   does), either at a random moment or, every other cycle, right after it logs a send step
   of the schedule (docs/design.md "Algorithm and schedule": a round of its is then being matched or
   reduced: mid-round); after a random downtime it is started again with ``--resume`` (same
   checkpoint folder) and the addresses of the nodes then running as initial peers.

The creator ``a`` is frozen but never killed: a restarted ``start`` node has no peers to
bootstrap from. Then every node trains to the end. Recorded from the nodes' ``--metrics-out``
lines: rounds attempted / applied / failed, heals, non-finite losses, the outer state hash of
every (fragment, round) per node, final eval losses; from the processes: incarnations that
exited unasked (crashed), nodes whose step stood still ``hang_s`` while not frozen (hung),
what a killed node left behind: helper processes, p2pd's socket, torch's shared-memory
files (orphans). ``faults=False`` runs the same swarm without the controller: the
fault-free reference.
"""

from __future__ import annotations

import math
import os
import random
import signal
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from diloco.bench.procs import Footprint, NodeProcess, footprint, left_behind

LEFTOVER_BOUND_S = 40.0
"""Seconds after a kill by which its node's helpers, socket and shared-memory files must be
gone: torch's manager removes its files about 2 s after the node (10 s once on a loaded
machine); the bound guards against things never removed, it is no speed target."""


@dataclass(kw_only=True, slots=True)
class ChaosConfig:
    """One chaos (or fault-free) run."""

    nodes: int = 6
    steps: int = 600
    sync_every: int = 30
    """H of the run."""
    cycles: int = 3
    """Fault cycles (one freeze and one kill with restart each)."""
    seed: int = 0
    faults: bool = True
    matchmaking_window: float = 2.0
    round_timeout: float = 10.0
    freeze_margin_s: float = 3.0
    """A freeze lasts matchmaking_window + round_timeout + this."""
    checkpoint_every: int = 20
    downtime_s: tuple[float, float] = (1.0, 4.0)
    gap_s: tuple[float, float] = (2.0, 6.0)
    hang_s: float = 180.0
    """A running, unfrozen node whose step stands still this long is hung."""
    faults_until: float = 0.75
    """No fault starts after the leading node passed this share of the steps."""
    extra_args: tuple[str, ...] = ("--seq-len", "32", "--batch-size", "4", "--threads", "1")

    @property
    def freeze_s(self) -> float:
        return self.matchmaking_window + self.round_timeout + self.freeze_margin_s


class Swarm:
    """The node processes of one run and what the controller did to them."""

    def __init__(self, config: ChaosConfig, folder: Path) -> None:
        self.config = config
        self.folder = folder
        self.nodes: list[NodeProcess] = []
        self.frozen: set[str] = set()
        self.asked: set[int] = set()
        """PIDs the controller killed: their exit is no crash."""
        self.events: list[dict[str, Any]] = []
        self.crashed: list[dict[str, Any]] = []
        self.hung: list[str] = []
        self.orphans: list[dict[str, Any]] = []
        self.killed: list[tuple[str, float, Footprint]] = []
        """Each kill: the node, when, and what it held then."""
        self.start = time.monotonic()

    def args(self, i: int, resume: bool = False) -> list[str]:
        c = self.config
        # A node killed before its first checkpoint starts afresh: --resume refuses a folder
        # without one.
        resume = resume and any((self.folder / f"ckpt_{i}").glob("step_*"))
        common = [
            *c.extra_args,
            "--data-seed", str(i),
            "--listen", f"/ip4/127.0.0.{2 + i}/tcp/0",
            "--checkpoint-dir", str(self.folder / f"ckpt_{i}"),
            "--checkpoint-every", str(c.checkpoint_every),
            "--matchmaking-window", str(c.matchmaking_window),
            "--round-timeout", str(c.round_timeout),
            "--log-every", "50",
            *(["--resume"] if resume else []),
        ]  # fmt: skip
        if i == 0:
            return ["start", "--name", "chaos", "--steps", str(c.steps),
                    "--H", str(c.sync_every), *common]  # fmt: skip
        peers = [
            address
            for n in self.nodes
            if n.alive() and n.name not in self.frozen and (address := n.printed_address())
        ]
        return ["join", "--initial-peers", " ".join(peers), *common]

    def launch(self) -> None:
        """The creator first; the joiners at once, all bootstrapping from it."""
        self.nodes.append(NodeProcess("a", self.args(0), self.folder))
        self.nodes[0].address()
        joiners = [self.args(i) for i in range(1, self.config.nodes)]
        for i, args in enumerate(joiners, start=1):
            self.nodes.append(NodeProcess(chr(ord("a") + i), args, self.folder))
        for node in self.nodes:
            node.address()

    def log(self, **event: Any) -> None:
        self.events.append({"t": round(time.monotonic() - self.start, 2), **event})

    def check(self) -> None:
        """Record incarnations that exited unasked with an error."""
        for node in self.nodes:
            code = node.process.poll()
            if code not in (None, 0) and node.pid not in self.asked:
                self.crashed.append({"node": node.name, "code": code, "step": node.step()})
                self.asked.add(node.pid)

    def wait_all(self, ready: Callable[[NodeProcess], bool], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not all(ready(n) for n in self.nodes):
            self.check()
            if time.monotonic() > deadline or self.crashed:
                raise TimeoutError(f"nodes not ready: {[(n.name, n.step()) for n in self.nodes]}")
            time.sleep(0.5)

    def worked_with_creator(self, node: NodeProcess) -> bool:
        """Whether ``node`` and the creator applied a round together: one (fragment, round)
        that both applied with several members and left at the same outer state."""
        if node is self.nodes[0]:
            return True
        creator, joiner = (self.applied_together(n) for n in (self.nodes[0], node))
        return bool(creator & joiner)

    @staticmethod
    def applied_together(node: NodeProcess) -> set[tuple[int, int, str]]:
        return {
            (r["fragment"], r["round"], r["outer_sha256"])
            for r in node.records()
            if r.get("event") == "round" and r.get("members", 1) >= 2
        }

    def send_steps(self, node: NodeProcess) -> set[int]:
        """The steps at which some fragment sends (docs/design.md "Algorithm and schedule": t_p +
        kH, k >= 1)."""
        config = next(r for r in node.records() if r.get("event") == "config")
        h, f = int(config["sync_every"]), int(config["num_fragments"])
        return {
            (p * h) // f + k * h for p in range(f) for k in range(1, self.config.steps // h + 1)
        }

    def kill(self, node: NodeProcess, mid_round: bool) -> None:
        """SIGKILL the node process alone; mid-round: right after it logs a send step."""
        if mid_round:
            sends, deadline = self.send_steps(node), time.monotonic() + 60
            while node.step() not in sends and time.monotonic() < deadline and node.alive():
                time.sleep(0.02)
        step = node.step()
        held = footprint(node.pid)
        self.asked.add(node.pid)
        node.process.kill()
        node.process.wait(10)
        self.killed.append((node.name, time.monotonic(), held))
        saved = self.has_checkpoint(node)
        self.log(
            action="kill",
            node=node.name,
            step=step,
            mid_round=mid_round,
            saved=saved,
            helpers=len(held.helpers),
            daemon_sockets=len(held.daemon_sockets),
        )

    def cycle(self, rng: random.Random, n: int) -> None:
        """One freeze of a random node and, meanwhile, a kill and restart of another."""
        c = self.config
        running = [x for x in self.nodes if x.alive()]
        frozen = rng.choice(running)
        joiners = [x for x in running if x is not frozen and x.name != "a"]
        # a node with a checkpoint, when there is one: then --resume has something to resume
        saved = [x for x in joiners if self.has_checkpoint(x)]
        victim = rng.choice(saved or joiners)
        os.killpg(frozen.pid, signal.SIGSTOP)
        self.frozen.add(frozen.name)
        frozen_at = time.monotonic()
        self.log(action="freeze", node=frozen.name, step=frozen.step(), seconds=c.freeze_s)
        time.sleep(rng.uniform(0.0, 2.0))
        self.kill(victim, mid_round=n % 2 == 0)
        time.sleep(rng.uniform(*c.downtime_s))
        steps_before = self.steps_logged(victim)
        victim.restart(self.args(self.nodes.index(victim), resume=True))
        self.log(action="restart", node=victim.name)
        time.sleep(max(0.0, frozen_at + c.freeze_s - time.monotonic()))
        os.killpg(frozen.pid, signal.SIGCONT)
        self.frozen.discard(frozen.name)
        self.log(action="thaw", node=frozen.name, step=frozen.step())
        # The next faults wait for the restarted node to train again (its start takes
        # seconds to a minute on a busy machine); one that never does is hung.
        deadline = time.monotonic() + c.hang_s
        while self.steps_logged(victim) == steps_before and victim.alive():
            if time.monotonic() > deadline:
                self.hang(victim)
                break
            time.sleep(0.5)
        self.log(action="back", node=victim.name, step=victim.step())
        time.sleep(rng.uniform(*c.gap_s))

    def has_checkpoint(self, node: NodeProcess) -> bool:
        folder = self.folder / f"ckpt_{self.nodes.index(node)}"
        return any(folder.glob("step_*"))

    @staticmethod
    def steps_logged(node: NodeProcess) -> int:
        return sum(r.get("event") == "step" for r in node.records())

    def finish(self, timeout: float) -> None:
        """Wait for every node to end; one whose step stands still ``hang_s`` is hung."""
        last: dict[str, tuple[int, float]] = {}
        deadline = time.monotonic() + timeout
        while any(n.alive() for n in self.nodes) and time.monotonic() < deadline:
            self.check()
            now = time.monotonic()
            for node in self.nodes:
                step = node.step()
                if last.get(node.name, (None,))[0] != step:
                    last[node.name] = (step, now)
                elif node.alive() and now - last[node.name][1] > self.config.hang_s:
                    self.hang(node)
            time.sleep(1.0)
        for node in self.nodes:
            if node.alive():
                self.hang(node)
        self.check()
        for name, killed_at, held in self.killed:
            while (left := left_behind(held)) and time.monotonic() < killed_at + LEFTOVER_BOUND_S:
                time.sleep(0.2)
            if left:
                self.orphans.append({"node": name, "left": left})

    def hang(self, node: NodeProcess) -> None:
        self.hung.append(node.name)
        self.asked.add(node.pid)
        node.kill_group()

    def cleanup(self) -> None:
        for node in self.nodes:
            if node.alive():
                self.asked.add(node.pid)
                node.kill_group()


def finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def shared_rounds(
    rounds: Mapping[str, Sequence[Mapping[str, Any]]],
) -> tuple[int, dict[str, dict[str, list[str]]]]:
    """How many rounds two nodes or more applied together, and those whose members left
    them with different outer states ("{p}/{k}[/prior]" -> node -> hashes), from each node's
    "round" events.

    A round's members are the nodes that applied it from the same prior state
    (``prior_sha256``; events without one share one prior): two groups of one round that
    started from different states are two rounds, not a mismatch.
    """
    hashes: dict[tuple[int, int, str], dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for name, events in rounds.items():
        for r in events:
            key = (r["fragment"], r["round"], r.get("prior_sha256", ""))
            hashes[key][name].add(r["outer_sha256"])
    shared = {k: v for k, v in hashes.items() if len(v) >= 2}
    mismatched = {
        "/".join([str(p), str(k), *([prior[:16]] if prior else [])]): {
            name: sorted(h) for name, h in v.items()
        }
        for (p, k, prior), v in sorted(shared.items())
        if len(set().union(*v.values())) > 1
    }
    return len(shared), mismatched


def tally(swarm: Swarm) -> dict[str, Any]:
    """What the nodes' metrics lines and the controller recorded."""
    steps = swarm.config.steps
    per_node: dict[str, Any] = {}
    rounds: dict[str, list[dict[str, Any]]] = {}
    non_finite = []
    for node in swarm.nodes:
        records = node.records()
        kinds = [r.get("event") for r in records]
        summary = next((r for r in reversed(records) if r.get("event") == "summary"), None)
        rounds[node.name] = [r for r in records if r.get("event") == "round"]
        for r in records:
            for key in ("loss", "eval_loss", "loss_outer"):
                if key in r and not finite(r[key]):
                    non_finite.append({"node": node.name, "event": r.get("event"), key: r[key]})
        per_node[node.name] = {
            "rounds_applied": kinds.count("round"),
            "rounds_failed": kinds.count("round_failed"),
            "heals": kinds.count("healed"),
            "caught_up": kinds.count("caught_up"),
            "final_step": summary["step"] if summary else node.step(),
            "reached_end": bool(summary and summary["step"] == steps and not summary["interrupted"])
            and node.process.returncode == 0,
            "eval_loss": summary["eval_loss"] if summary else None,
            "exit_code": node.process.returncode,
            "outer_sha256": summary.get("outer_sha256") if summary else None,
        }
    num_shared, mismatched = shared_rounds(rounds)
    finals = {name: n.pop("outer_sha256") for name, n in per_node.items()}
    final_split = [
        p
        for p in range(max((len(h) for h in finals.values() if h), default=0))
        if len({tuple(h)[p] for h in finals.values() if h}) > 1
    ]
    losses = [n["eval_loss"] for n in per_node.values() if finite(n["eval_loss"])]
    return {
        "config": asdict(swarm.config),
        "events": swarm.events,
        "nodes": per_node,
        "rounds_attempted": sum(
            n["rounds_applied"] + n["rounds_failed"] for n in per_node.values()
        ),
        "rounds_applied": sum(n["rounds_applied"] for n in per_node.values()),
        "rounds_failed": sum(n["rounds_failed"] for n in per_node.values()),
        "heals": sum(n["heals"] for n in per_node.values()),
        "kills": sum(e["action"] == "kill" for e in swarm.events),
        "kills_mid_round": sum(e["action"] == "kill" and e["mid_round"] for e in swarm.events),
        "freezes": sum(e["action"] == "freeze" for e in swarm.events),
        "crashed": swarm.crashed,
        "hung": swarm.hung,
        "orphans": swarm.orphans,
        "non_finite": non_finite,
        "shared_rounds": num_shared,
        "mismatched_rounds": mismatched,
        "final_split_fragments": final_split,
        "all_reached_end": all(n["reached_end"] for n in per_node.values()),
        "eval_loss_mean": sum(losses) / len(losses) if losses else None,
        "seconds": round(time.monotonic() - swarm.start, 1),
    }


def run_chaos(config: ChaosConfig, folder: Path, timeout: float = 3600.0) -> dict[str, Any]:
    """Run the swarm (with the controller if ``config.faults``) to its end; the tally."""
    folder.mkdir(parents=True, exist_ok=True)
    swarm = Swarm(config, folder)
    rng = random.Random(config.seed)
    try:
        swarm.launch()
        # Every node's first checkpoint: a joiner starts at the swarm's step, and one that
        # joined after the creator's first checkpoint has none at that step yet (killed
        # before its own, it started afresh instead of resuming).
        swarm.wait_all(swarm.has_checkpoint, timeout=timeout / 4)
        if config.faults:
            swarm.wait_all(swarm.worked_with_creator, timeout=timeout / 4)
        n = 0
        while config.faults and n < config.cycles:
            if max(x.step() for x in swarm.nodes) > config.faults_until * config.steps:
                break
            swarm.cycle(rng, n)
            n += 1
        swarm.finish(timeout=timeout)
    finally:
        swarm.cleanup()
    return tally(swarm)
