"""What the dashboard knows about a run, accumulated from successive reads of the DHT.

Pure state, no I/O: the follower feeds it each poll's node and metrics records
(``update``), the HTTP server asks it for JSON-able views. Records carry only a node's
recent past (``metrics_records``: the newest 64 losses and rounds), so the view keeps the
history it has seen: up to ``max_points`` losses per node and ``max_rounds`` rounds.

Everything here is what peers claim (their records are signed, so a peer can speak only for
itself): the view shows claims side by side, for instance each fragment's state hash per
peer, and marks where they disagree; it decides nothing.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from diloco.node.observe.traffic import data_parallel_bytes
from diloco.protocol.records.metrics import MetricsRecord, RoundEntry
from diloco.protocol.records.nodes import NodeRecord

STALE_AFTER = 15.0
"""Seconds after its last sighting in the DHT that a node no longer counts as alive (nodes
refresh their records every 5 s; a read may miss one)."""
ETA_WINDOW = 120.0
"""Seconds of recent progress the time left is estimated from (the swarm's pace changes
as nodes come and go)."""
MAX_CLOCK = 2000
"""Most (step, time) samples kept for the charts' time axis (older ones are thinned)."""
SHORT_PEER = 8
"""Characters of a peer id shown as its name (its end: the start is the same for all)."""


@dataclass
class PeerHistory:
    """One node as the dashboard has seen it; times are the dashboard's wall clock."""

    record: NodeRecord
    first_seen: float
    present_at: float
    """The last poll that found its record."""
    changed_at: float
    """The last poll that found its record changed (a refresh with new numbers)."""
    metrics: MetricsRecord | None = None
    losses: dict[int, float] = field(default_factory=dict)
    evals: dict[int, float] = field(default_factory=dict)


class SwarmView:
    """Thread-safe: one follower updates, many HTTP requests read."""

    def __init__(self, max_points: int = 2000, max_rounds: int = 5000) -> None:
        self.max_points, self.max_rounds = max_points, max_rounds
        self.lock = threading.Lock()
        self.run_id: str | None = None
        self.config: dict[str, Any] = {}
        self.num_params: int | None = None
        self.status = "looking for a run"
        self.peers: dict[str, PeerHistory] = {}
        self.rounds: dict[tuple[int, int], dict[str, RoundEntry]] = {}
        self.updated_at: float | None = None
        self.clock: list[tuple[int, float]] = []
        """(the swarm's global step, the dashboard's wall time) at each poll that moved it:
        the time axis of the charts and the estimate of the time left."""

    def set_run(self, run_id: str, config: Mapping[str, Any], num_params: int | None) -> None:
        """Follow ``run_id`` (its configuration as published; parameters of its model)."""
        with self.lock:
            self.run_id, self.config, self.num_params = run_id, dict(config), num_params

    def set_status(self, status: str) -> None:
        """A line for people: what the follower is doing or what went wrong."""
        with self.lock:
            self.status = status

    def update(
        self, records: Sequence[NodeRecord], metrics: Mapping[str, MetricsRecord], now: float
    ) -> None:
        """Take one poll's records (``metrics`` by peer id) read at wall time ``now``."""
        with self.lock:
            self.updated_at = now
            for record in records:
                peer = self.peers.get(record.peer_id)
                if peer is None:
                    peer = self.peers[record.peer_id] = PeerHistory(record, now, now, now)
                elif record != peer.record:
                    peer.record, peer.changed_at = record, now
                peer.present_at = now
            for peer_id, m in metrics.items():
                if peer_id not in self.peers:
                    continue  # metrics of a node without a node record: not in the run
                peer = self.peers[peer_id]
                peer.metrics = m
                _merge(peer.losses, {p.step: p.loss for p in m.losses}, self.max_points)
                _merge(peer.evals, {p.step: p.loss for p in m.evals}, self.max_points)
                for entry in m.rounds:
                    self.rounds.setdefault((entry.fragment, entry.round), {})[peer_id] = entry
            while len(self.rounds) > self.max_rounds:
                del self.rounds[min(self.rounds, key=lambda k: _round_step(self.rounds[k]))]
            step = max((p.record.global_step for p in self._alive(now)), default=None)
            if step is not None and (not self.clock or step > self.clock[-1][0]):
                self.clock.append((step, now))
                if len(self.clock) > MAX_CLOCK:
                    del self.clock[1:-1:2]  # every other one: the span stays, density halves

    # -- views (each takes the lock; ``state`` takes it once for all) ---------------------

    def state(self, now: float) -> dict[str, Any]:
        """Everything the page shows, as one JSON-able dict (``/api/state``)."""
        with self.lock:
            return {
                "run": self._run(now),
                "peers": self._peers(now),
                "loss": self._loss(),
                "rounds": self._rounds(),
                "fragments": self._fragments(now),
                "totals": self._totals(now),
            }

    def view(self, name: str, now: float) -> object:
        """One part of ``state`` by name (``/api/<name>``).

        Raises:
            KeyError: no such view.
        """
        views: dict[str, Callable[[], object]] = {
            "run": lambda: self._run(now),
            "peers": lambda: self._peers(now),
            "loss": self._loss,
            "rounds": self._rounds,
            "fragments": lambda: self._fragments(now),
            "totals": lambda: self._totals(now),
        }
        make = views[name]
        with self.lock:
            return make()

    def _alive(self, now: float) -> list[PeerHistory]:
        """Peers training now: seen lately and not gone with a last record."""
        return [p for p in self.peers.values() if _state(p, now) == "training"]

    def _run(self, now: float) -> dict[str, Any]:
        outer = self.config.get("outer", {})
        steps = self.config.get("steps")
        steps = steps if isinstance(steps, int) and steps > 0 else None
        peers = list(self.peers.values())
        step = max((p.record.global_step for p in peers), default=0)
        state = run_state([_state(p, now) for p in peers])
        eta = None
        if steps is not None and step >= steps:
            eta = 0.0
        elif steps is not None and state == "training":
            eta = time_left(self.clock, steps, now)
        return {
            "run_id": self.run_id,
            "name": self.config.get("name"),
            "steps": self.config.get("steps"),
            "sync_every": outer.get("sync_every") if isinstance(outer, dict) else None,
            "codec": self.config.get("codec"),
            "preset": self.config.get("preset"),
            "num_params": self.num_params,
            "status": self.status,
            "updated_s_ago": None if self.updated_at is None else now - self.updated_at,
            "state": state,
            "global_step": step,
            "progress": None if steps is None else min(1.0, step / steps),
            "eta_s": eta,
            "final_eval": final_eval(peers),
            "join_command": join_command(sorted(self._alive(now), key=lambda p: p.first_seen)),
        }

    def _peers(self, now: float) -> list[dict[str, Any]]:
        rows = []
        for peer_id, p in sorted(self.peers.items()):
            r, m = p.record, p.metrics
            evals = p.evals
            rows.append(
                {
                    "peer_id": peer_id,
                    "name": peer_id[-SHORT_PEER:],
                    "alive": _state(p, now) == "training",
                    "state": _state(p, now),
                    "device": None if m is None else m.device,
                    "precision": None if m is None else m.precision,
                    "batch_size": None if m is None else m.batch_size,
                    "final_eval": evals[max(evals)] if m and m.end and evals else None,
                    "step": r.global_step,
                    "tokens_per_s": r.throughput,
                    "cu": None if m is None else m.cu,
                    "tokens": None if m is None else m.tokens,
                    "bytes_sent": None if m is None else m.bytes_sent,
                    "bytes_received": None if m is None else m.bytes_received,
                    "failed_rounds": None if m is None else m.failed_rounds,
                    "healed_fragments": None if m is None else m.healed_fragments,
                    "loss": p.losses[max(p.losses)] if p.losses else None,
                    "last_seen_s": now - p.changed_at,
                    "reachability": reachability(r.addrs),
                    "addrs": list(r.addrs),
                    "software_version": r.software_version,
                }
            )
        return rows

    def _loss(self) -> dict[str, Any]:
        def series(attr: str) -> list[dict[str, Any]]:
            return [
                {"peer_id": peer_id, "points": sorted(getattr(p, attr).items())}
                for peer_id, p in sorted(self.peers.items())
                if getattr(p, attr)
            ]

        return {
            "train": series("losses"),
            "outer": series("evals"),
            "clock": [list(sample) for sample in self.clock],
        }

    def _rounds(self) -> list[dict[str, Any]]:
        rows = []
        for (fragment, round_), reports in self.rounds.items():
            ok = {peer: e for peer, e in reports.items() if e.ok}
            failed = sorted(peer for peer, e in reports.items() if not e.ok)
            rows.append(
                {
                    "fragment": fragment,
                    "round": round_,
                    "step": _round_step(reports),
                    "members": max((e.members for e in ok.values()), default=0),
                    "seconds": max((e.seconds for e in ok.values()), default=0.0),
                    "bytes_sent": sum(e.bytes_sent for e in ok.values()),
                    "bytes_received": sum(e.bytes_received for e in ok.values()),
                    "reported_by": sorted(reports),
                    "failed_by": failed,
                    "outcome": "failed" if not ok else "partial" if failed else "ok",
                }
            )
        return sorted(rows, key=lambda row: (row["step"], row["fragment"]))

    def _fragments(self, now: float) -> list[dict[str, Any]]:
        """Per fragment, each live node's version and hash, with agreement marked."""
        alive = sorted(self._alive(now), key=lambda p: p.record.peer_id)
        indices = sorted({f.fragment for p in alive for f in p.record.fragments})
        rows = []
        for index in indices:
            entries = [(p.record.peer_id, p.record.fragment(index)) for p in alive]
            held = [(peer, e) for peer, e in entries if e is not None]
            newest = max(e.version for _, e in held)
            marks = agreement([e.state_hash for _, e in held if e.version == newest])
            rows.append(
                {
                    "fragment": index,
                    "newest_version": newest,
                    "agreed": len(marks) == 1,
                    "cells": [
                        {
                            "peer_id": peer,
                            "version": e.version,
                            "state_hash": e.state_hash,
                            "mark": marks[e.state_hash] if e.version == newest else "behind",
                        }
                        for peer, e in held
                    ],
                }
            )
        return rows

    def _totals(self, now: float) -> dict[str, Any]:
        alive = self._alive(now)
        measured = [p.metrics for p in self.peers.values() if p.metrics is not None]
        sent = sum(m.bytes_sent for m in measured)
        dp = None
        if self.num_params is not None:
            # What each node would have sent in a data-parallel swarm of the live size.
            replicas = max(2, len(alive))
            dp = sum(
                data_parallel_bytes(
                    num_params=self.num_params, steps=m.steps, num_replicas=replicas
                ).bytes_sent
                for m in measured
            )
        rounds = self._rounds()
        return {
            "peers_alive": len(alive),
            "peers_seen": len(self.peers),
            "global_step": max((p.record.global_step for p in self.peers.values()), default=0),
            "tokens": sum(m.tokens for m in measured),
            "tokens_per_s": sum(p.record.throughput for p in alive),
            "bytes_sent": sent,
            "bytes_received": sum(m.bytes_received for m in measured),
            "dp_bytes_estimate": dp,
            "dp_ratio": None if dp is None or sent == 0 else dp / sent,
            "rounds_ok": sum(r["outcome"] == "ok" for r in rounds),
            "rounds_partial": sum(r["outcome"] == "partial" for r in rounds),
            "rounds_failed": sum(r["outcome"] == "failed" for r in rounds),
        }


def _state(peer: PeerHistory, now: float) -> str:
    """``finished`` or ``stopped`` (it left, saying so), ``training`` (seen lately), or
    ``gone`` (its records expired without a last word: killed, crashed, cut off)."""
    if peer.metrics is not None and peer.metrics.end is not None:
        return peer.metrics.end
    return "training" if now - peer.present_at <= STALE_AFTER else "gone"


def run_state(states: Sequence[str]) -> str:
    """The run as a whole, from its peers' states: ``waiting`` for a first node,
    ``training`` while any trains, else ``finished`` if any reached the end, else
    ``stopped`` (all stopped by their people) or ``gone``."""
    for state in ("training", "finished", "stopped", "gone"):
        if state in states:
            return state
    return "waiting"


def final_eval(peers: Sequence[PeerHistory]) -> dict[str, Any] | None:
    """The held-out loss at the end: the last evaluation of the peers that left saying so
    (finished, or stopped: where they stopped), at the furthest step any reached (their
    mean: they hold the same outer weights)."""
    last = {
        p.record.peer_id: max(p.evals.items())
        for p in peers
        if p.metrics is not None and p.metrics.end is not None and p.evals
    }
    if not last:
        return None
    step = max(s for s, _ in last.values())
    losses = [loss for s, loss in last.values() if s == step]
    return {"step": step, "loss": sum(losses) / len(losses), "peers": len(losses)}


def time_left(clock: Sequence[tuple[int, float]], steps: int, now: float) -> float | None:
    """Seconds until the swarm reaches ``steps``, at its pace over the last ``ETA_WINDOW``
    seconds of ``clock`` ((step, time) samples of training peers); None without two
    samples in the window (nothing trains, or only just started)."""
    recent = [(s, t) for s, t in clock if now - t <= ETA_WINDOW]
    if len(recent) < 2 or recent[-1][1] <= recent[0][1] or recent[-1][0] <= recent[0][0]:
        return None
    (s0, t0), (s1, t1) = recent[0], recent[-1]
    return (steps - s1) * (t1 - t0) / (s1 - s0)


def join_command(peers: Sequence[PeerHistory]) -> str | None:
    """What a newcomer types to join: an address of the longest-running peer that others
    reach directly (a relayed one if none does); None without a live peer."""
    for p in peers:
        direct = [a for a in p.record.addrs if "/p2p-circuit" not in a]
        if direct:
            return f"diloco-node join --initial-peers {direct[0]}"
    relayed = [a for p in peers for a in p.record.addrs]
    return f"diloco-node join --initial-peers {relayed[0]}" if relayed else None


def agreement(hashes: Sequence[str]) -> dict[str, str]:
    """Mark each distinct state hash of one fragment at its newest version: ``agree`` when
    there is only one; else ``majority`` for the hash strictly most held, ``conflict`` for
    the others (all of them on a tie)."""
    counts = Counter(hashes).most_common()
    if len(counts) == 1:
        return {counts[0][0]: "agree"}
    top = counts[0][0] if counts[0][1] > counts[1][1] else None
    return {h: "majority" if h == top else "conflict" for h, _ in counts}


def reachability(addrs: Sequence[str]) -> str:
    """How peers reach a node, from the addresses it announces: through a ``relay``
    (``/p2p-circuit``), not at all (``client``: no address), or ``direct``."""
    if not addrs:
        return "client"
    return "relay" if any("/p2p-circuit" in a for a in addrs) else "direct"


def _merge(history: dict[int, float], points: Mapping[int, float], limit: int) -> None:
    history.update(points)
    for step in sorted(history)[: max(0, len(history) - limit)]:
        del history[step]


def _round_step(reports: Mapping[str, RoundEntry]) -> int:
    """Where a round landed: the earliest step a reporter applied it at."""
    return min(e.step for e in reports.values())
