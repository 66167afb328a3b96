"""A protocol simulator for thousands of peers: one staged (or flat) round per draw.

Pure and in one process: peers get links drawn at random, the round follows the protocol's
own stage plan (``diloco.protocol.staged.grid.plan_grid``; flat = one group of everyone), and every
transfer's time comes from a link model, so thousands of peers take seconds, not a swarm.

**Links** (``LinkModel``): each peer draws an uplink and a downlink rate (log-normal around
home-broadband medians) and a one-way latency to the core (uniform); between peers ``i`` and
``j`` the one-way delay is ``lat_i + lat_j``. Concurrent flows share a peer's link evenly,
so a flow of ``S`` bytes from ``i`` to ``j`` in a phase where ``i`` sends ``F_i`` such flows
and ``j`` receives ``G_j`` takes ``lat_i + lat_j + S * max(F_i / up_i, G_j / down_j)``.
Opening streams costs ``setup_rtts`` round trips per wave of ``max_streams`` streams (libp2p:
TCP + noise + yamux), so a member with ``M - 1`` streams pays ``ceil((M-1)/max_streams)``
waves. A stream is lost (after the protocol's one retry) with probability ``stream_loss``.

**Churn:** every peer dies at an exponential time of mean ``lifetime_s`` from the start of
the all-reduce (``inf``: nobody dies). A peer that dies stops sending at once.

**Rules** (what the protocol does, docs/design.md "The round"):

* Deadlines adapt to recent transfers and are fixed per stage from the start of
  the all-reduce, so every member knows them: stage ``s`` has a budget of
  ``timeout_factor`` times a median peer's nominal phase time (its widest group) for the
  parts to reach their reducers, and as long again for the averages to come back; a
  member starts a stage as soon as its previous one ended for it.
* Stage 0 (single members): a part that misses the reducer's deadline (dead, lost, slow)
  leaves its sender uncounted in that part (weights renormalised); the reducer waits until
  its deadline for a live sender, and a round trip after the death for a dead one (its
  stream breaks).
* Later stages: every group of a cell must count the same sub-cells, or the groups' results
  would differ, so a contributor that holds no value (its earlier group failed) or whose
  part does not arrive fails its group; under ``rereduce``, a contributor that holds no
  value or is dead when the stage starts is replaced by the sibling of its sub-cell (same
  bytes) that lives longest, and a part lost on the way is sent again by such a sibling,
  each starting when the loss is seen (a broken stream: a round trip after the death).
* An averaged part that does not reach a live member by its deadline (reducer dead, stream
  lost, reducer late) fails the group for all its members under ``fail`` (today's rule:
  "all treat the round as failed"); under ``rereduce`` a part lost to a dead
  reducer or a lost stream is re-reduced by the first live contributor (every live member
  sends it that part again and it sends the average back), if that ends by the deadline;
  these transfers are not charged against the links' other flows (optimistic).
* A member of a failed group holds no value and does not apply the round. The round
  succeeds when every member alive at its end applies it; all that apply hold the same
  bytes, since every successful group of a cell counts the same sub-cells.

Matchmaking is the same for flat and staged rounds and reported apart: the window, the DHT's
round trips at a median peer's latency (``dht_round_trips``: none by default, as a node
declares and reads the round before its send step; 3 before that, declaring 2 and reading
the view 1, docs/design.md "Across the internet"), a round trip to the leader, and the leader's
uplink sending every member the member list (``GROUP``: ``GROUP_BYTES_PER_MEMBER`` per
member), which grows as ``N ** 2``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
from numpy.typing import NDArray

from diloco.protocol.staged.grid import GridPlan, StageGroup, plan_grid

Rule = Literal["fail", "rereduce"]
RULES: tuple[Rule, ...] = ("fail", "rereduce")
GROUP_BYTES_PER_MEMBER = 48
"""A member in GROUP: a 38-byte peer id, its weight and framing."""
Floats = NDArray[np.float64]


@dataclass(frozen=True, kw_only=True, slots=True)
class LinkModel:
    """How peers' links are drawn."""

    up_mbps: float = 20.0
    """Median uplink, Mbit/s (home broadband)."""
    down_mbps: float = 100.0
    """Median downlink, Mbit/s."""
    sigma: float = 0.7
    """Log-normal spread of both rates (0: every peer at the median)."""
    latency_ms: tuple[float, float] = (10.0, 60.0)
    """One-way latency to the core, uniform in this range (peer-to-peer RTT 40-240 ms)."""
    setup_rtts: float = 2.0
    """Round trips to open one wave of streams."""
    max_streams: int = 64
    """Streams a peer opens at once."""
    stream_loss: float = 0.0
    """Probability that a stream is lost for the round, after one retry."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SwarmSpec:
    """One simulated configuration."""

    num_peers: int
    max_group_size: int | None = None
    """None: one flat group of everyone (today)."""
    num_values: int = 1 << 20
    """Values of the fragment."""
    bits: float = 4.25
    """Bits per value on the wire (E3M0)."""
    lifetime_s: float = math.inf
    """Mean time until a peer dies (churn); inf: no churn."""
    rule: Rule = "fail"
    timeout_factor: float = 10.0
    """Stage budget over a median peer's nominal time; the slowest of a thousand log-normal
    links (sigma 0.7) is about 10 times slower than the median."""
    matchmaking_window_s: float = 2.0
    dht_round_trips: float = 0.0
    """Round trips to the DHT between the send step and the JOIN: none, since matchmaking
    declares and reads ahead of the send step (3 without that: declare 2, read the view 1)."""
    links: LinkModel = field(default_factory=LinkModel)

    def __post_init__(self) -> None:
        if self.num_peers < 2:
            raise ValueError(f"need at least 2 peers, got {self.num_peers}")
        if self.rule not in RULES:
            raise ValueError(f"rule must be one of {RULES}, got {self.rule!r}")
        if not (self.lifetime_s > 0 and self.timeout_factor >= 1 and self.num_values > 0):
            raise ValueError("need lifetime_s > 0, timeout_factor >= 1, num_values > 0")
        if not self.dht_round_trips >= 0:
            raise ValueError(f"need dht_round_trips >= 0, got {self.dht_round_trips}")


@dataclass(frozen=True, slots=True)
class Peers:
    """Drawn links: rates in bytes/s, one-way latency in s, death time in s (inf: none)."""

    up: Floats
    down: Floats
    latency: Floats
    death: Floats


def draw_peers(spec: SwarmSpec, rng: np.random.Generator) -> Peers:
    n, links = spec.num_peers, spec.links
    spread = rng.lognormal(0.0, links.sigma, size=(2, n)) if links.sigma else np.ones((2, n))
    death = (
        rng.exponential(spec.lifetime_s, size=n)
        if math.isfinite(spec.lifetime_s)
        else np.full(n, math.inf)
    )
    return Peers(
        up=links.up_mbps * 1e6 / 8 * spread[0],
        down=links.down_mbps * 1e6 / 8 * spread[1],
        latency=rng.uniform(*links.latency_ms, size=n) / 1e3,
        death=death,
    )


@dataclass(frozen=True, slots=True)
class RoundOutcome:
    success: bool
    """Every member alive at the end applied the round."""
    applied: float
    """Share of the members alive at the end that applied it."""
    counted: float
    """Share of all members whose contribution is in the result (0 when none applied)."""
    seconds: float
    """All-reduce time until the last member that applies holds the result (nan if none)."""
    stage_seconds: tuple[float, ...]
    """When each stage ended for its last successful member, from the all-reduce start."""
    matchmaking_seconds: float


class _Round:
    """One round's state; ``run`` walks the stages."""

    def __init__(self, spec: SwarmSpec, plan: GridPlan, peers: Peers, rng: np.random.Generator):
        self.spec, self.plan, self.peers, self.rng = spec, plan, peers, rng
        n = spec.num_peers
        self.ok = np.ones(n, dtype=bool)
        self.ready = np.zeros(n)
        self.counted = np.zeros(n, dtype=bool)
        self.lat_med = float(np.median(peers.latency))
        self.rate_med = float(np.median(np.minimum(peers.up, peers.down)))
        self.stage_end: list[float] = []
        self.position = {member: q for q, member in enumerate(plan.order)}
        # cells[s][q]: the level-(s+1) cell of line position q.
        self.cells = [{q: g.cell for g in groups for q in range(*g.cell)} for groups in plan.stages]
        # Absolute deadlines per stage (scatter, gather), from the all-reduce start.
        self.deadlines: list[tuple[float, float]] = []
        end = 0.0
        for m in plan.shape:
            budget = spec.timeout_factor * self.nominal(m, spec.num_values * spec.bits / 8 / m)
            self.deadlines.append((end + budget, end + 2 * budget))
            end += 2 * budget

    def lost(self, shape: tuple[int, ...]) -> NDArray[np.bool_]:
        p = self.spec.links.stream_loss
        return self.rng.random(shape) < p if p > 0 else np.zeros(shape, dtype=bool)

    def setup(self, members: NDArray[np.int64], num_streams: int) -> Floats:
        """Time for each of ``members`` to open ``num_streams`` streams."""
        links = self.spec.links
        waves = math.ceil(num_streams / links.max_streams)
        rtt = 2 * (self.peers.latency[members] + self.lat_med)
        result: Floats = waves * links.setup_rtts * rtt
        return result

    def nominal(self, m: int, part: float) -> float:
        """One phase's time for a median peer: deadlines scale with it."""
        waves = math.ceil((m - 1) / self.spec.links.max_streams)
        return (
            waves * self.spec.links.setup_rtts * 4 * self.lat_med
            + 2 * self.lat_med
            + (m - 1) * part / self.rate_med
        )

    def run_group(self, s: int, group: StageGroup) -> None:
        p, spec = self.peers, self.spec
        c = np.array(group.contributors, dtype=np.int64)
        r = np.array(group.receivers, dtype=np.int64)
        members = np.concatenate([c, r])
        m = len(c)
        if s > 0 and m == 1:
            return
        part = spec.num_values * spec.bits / 8 / m
        send_due, due_at = self.deadlines[s]
        # Sources of each contribution: the contributor, or under rereduce a live sibling.
        src = c.copy()
        start = self.ready[c] + self.setup(c, m - 1)
        missing = ~self.ok[c] | (p.death[c] <= self.ready[c])
        if s > 0 and missing.any():
            if spec.rule == "fail":
                self.ok[members] = False
                return
            for i in np.flatnonzero(missing):
                sibling = self._sibling(s, int(c[i]))
                if sibling is None:
                    self.ok[members] = False
                    return
                src[i] = sibling
                seen = min(self.ready[c[i]], p.death[c[i]]) + 4 * self.lat_med
                start[i] = max(seen, self.ready[sibling]) + self.setup(src[i : i + 1], m - 1)[0]
        # Scatter: a[i, j] = part i -> reducer j.
        send = (m - 1) * part
        a = (
            start[:, None]
            + p.latency[src][:, None]
            + p.latency[c][None, :]
            + np.maximum(send / p.up[src][:, None], send / p.down[c][None, :])
        )
        arrived = (a <= p.death[src][:, None]) & ~self.lost((m, m))
        np.fill_diagonal(a, 0.0)
        np.fill_diagonal(arrived, True)
        deadline = np.full(m, send_due)
        on_time = arrived & (a <= send_due)
        if s == 0:
            self.counted[c] = on_time.all(axis=1)
            # A dead sender's stream breaks: seen a round trip later, not waited for.
            dead = ~arrived & (p.death[src][:, None] < a)
            seen = np.where(dead, p.death[src][:, None] + 4 * self.lat_med, 0.0)
            waited = np.maximum(np.where(on_time, a, 0.0), seen).max(axis=0)
            gather = np.where((on_time | dead).all(axis=0), waited, deadline)
        else:
            if not on_time.all() and not self._resend(s, c, src, a, on_time, send, send_due):
                self.ok[members] = False
                return
            gather = a.max(axis=0)
        gather = np.maximum(gather, self.ready[c])
        # Gather: reducer j's average -> member k (its own part: at once).
        fanout = (m - 1 + len(r)) * part
        inbound = np.where(np.arange(len(members)) < m, m - 1, m) * part
        b = (
            gather[:, None]
            + p.latency[c][:, None]
            + p.latency[members][None, :]
            + np.maximum(fanout / p.up[c][:, None], inbound[None, :] / p.down[members][None, :])
        )
        b[np.arange(m), np.arange(m)] = gather
        due = np.full(len(members), due_at)
        delivered = (b <= p.death[c][:, None]) & ~self.lost((m, len(members)))
        delivered[np.arange(m), np.arange(m)] = True
        alive = p.death[members] > self.ready[members]
        good = delivered & (b <= due[None, :])
        need = ~good & alive[None, :]
        if need.any():
            if spec.rule == "fail":
                self.ok[members] = False
                return
            b = self._rereduce(c, members, b, need, delivered, part, due)
            if b is None:
                self.ok[members] = False
                return
        self.ready[members] = b.max(axis=0)
        self.ok[members] = alive

    def _sibling(self, s: int, member: int, tried: int | None = None) -> int | None:
        """The member of ``member``'s level-``s`` sub-cell that holds the value and lives
        longest (``tried`` excluded), or None."""
        lo, hi = self.cells[s - 1][self.position[member]]
        holders = [self.plan.order[q] for q in range(lo, hi)]
        holders = [q for q in holders if q not in (member, tried) and self.ok[q]]
        return max(holders, key=lambda q: self.peers.death[q]) if holders else None

    def _resend(
        self,
        s: int,
        c: NDArray[np.int64],
        src: NDArray[np.int64],
        a: Floats,
        on_time: NDArray[np.bool_],
        send: float,
        send_due: float,
    ) -> bool:
        """Stage ``s >= 1``: under ``rereduce``, the parts that did not arrive are sent again
        by a sibling, from when the loss is seen (``a`` and ``src`` updated); False when that
        is not possible or not in time."""
        if self.spec.rule == "fail":
            return False
        p = self.peers
        for i in np.flatnonzero(~on_time.all(axis=1)):
            sibling = self._sibling(s, int(c[i]), int(src[i]))
            if sibling is None:
                return False
            cols = ~on_time[i]
            seen = min(p.death[src[i]] + 4 * self.lat_med, float(a[i, cols].max()))
            src[i] = sibling
            start = max(seen, self.ready[sibling]) + self.setup(src[i : i + 1], len(c) - 1)[0]
            a[i, cols] = (
                start
                + p.latency[sibling]
                + p.latency[c[cols]]
                + np.maximum(send / p.up[sibling], send / p.down[c[cols]])
            )
            fine = (a[i, cols] <= p.death[sibling]) & (a[i, cols] <= send_due)
            if not (fine & ~self.lost((int(cols.sum()),))).all():
                return False
        return True

    def _rereduce(
        self,
        c: NDArray[np.int64],
        members: NDArray[np.int64],
        b: Floats,
        need: NDArray[np.bool_],
        delivered: NDArray[np.bool_],
        part: float,
        due: Floats,
    ) -> Floats | None:
        """Times once the parts in ``need`` are re-reduced by the first live contributor,
        or None. A loss is seen a round trip after the reducer died, when the stream broke,
        or (a live reducer that is late) only at the deadline, too late to re-reduce."""
        p = self.peers
        lost = np.flatnonzero(need.any(axis=1))
        seen = 0.0
        for j in lost:
            late = need[j] & delivered[j]
            if late.any():
                return None
            dead = p.death[c[j]]
            seen = max(seen, min(dead + 4 * self.lat_med, float(b[j, need[j]].max())))
        live = [i for i in range(len(c)) if i not in lost and p.death[c[i]] > seen]
        if not live:
            return None
        h = int(c[live[0]])
        size = len(lost) * part
        into_h = seen + max(
            p.latency[c[i]]
            + p.latency[h]
            + max(size / p.up[c[i]], (len(live) - 1) * size / p.down[h])
            for i in live
        )
        back = (
            into_h
            + p.latency[h]
            + p.latency[members]
            + np.maximum((len(live) - 1) * size / p.up[h], size / p.down[members])
        )
        if ((back > due) & (p.death[members] > back)).any() or p.death[h] <= back.max():
            return None
        b = b.copy()
        b[lost, :] = back[None, :]
        return b

    def run(self) -> None:
        for s, groups in enumerate(self.plan.stages):
            for group in groups:
                self.run_group(s, group)
            if s == 0:
                self.counted &= self.ok
            self.stage_end.append(float(self.ready[self.ok].max()) if self.ok.any() else math.nan)


def matchmaking_seconds(spec: SwarmSpec, peers: Peers) -> float:
    """Window, the DHT's round trips, a round trip to the leader, and GROUP fanned out by the
    leader's uplink."""
    leader = 0
    fanout = spec.num_peers**2 * GROUP_BYTES_PER_MEMBER / float(peers.up[leader])
    rtt = 2 * float(np.max(peers.latency + peers.latency[leader]))
    dht = spec.dht_round_trips * 4 * float(np.median(peers.latency))
    return spec.matchmaking_window_s + dht + rtt + fanout


def simulate_round(spec: SwarmSpec, rng: np.random.Generator) -> RoundOutcome:
    """Draw peers and run one round of ``spec``."""
    return run_round(spec, draw_peers(spec, rng), rng)


def run_round(spec: SwarmSpec, peers: Peers, rng: np.random.Generator) -> RoundOutcome:
    """One round of ``spec`` among ``peers`` (placed by a key drawn from ``rng``)."""
    ids = [int(i).to_bytes(4, "big") for i in range(spec.num_peers)]
    size = spec.max_group_size or spec.num_peers
    plan = plan_grid(f"sim/{rng.integers(1 << 30)}", ids, [1.0] * spec.num_peers, size)
    state = _Round(spec, plan, peers, rng)
    state.run()
    end = float(state.ready[state.ok].max()) if state.ok.any() else math.nan
    alive = peers.death > (end if state.ok.any() else 0.0)
    applied = state.ok & alive
    share = float(applied.sum() / max(alive.sum(), 1))
    return RoundOutcome(
        success=bool(alive.any() and applied[alive].all()),
        applied=share,
        counted=float(state.counted.mean()) if state.ok.any() else 0.0,
        seconds=end,
        stage_seconds=tuple(state.stage_end),
        matchmaking_seconds=matchmaking_seconds(spec, peers),
    )


@dataclass(frozen=True, slots=True)
class Summary:
    """Rounds of one configuration."""

    spec: SwarmSpec
    num_rounds: int
    success_rate: float
    applied: float
    """Mean share of live members that applied."""
    median_seconds: float
    """Median all-reduce time of the rounds that succeeded (nan if none)."""
    p90_seconds: float
    matchmaking_seconds: float
    """Median."""


def summarise(spec: SwarmSpec, num_rounds: int, seed: int = 0) -> Summary:
    rng = np.random.default_rng(seed)
    outcomes = [simulate_round(spec, rng) for _ in range(num_rounds)]
    times = [o.seconds for o in outcomes if o.success]
    return Summary(
        spec=spec,
        num_rounds=num_rounds,
        success_rate=sum(o.success for o in outcomes) / num_rounds,
        applied=float(np.mean([o.applied for o in outcomes])),
        median_seconds=float(np.median(times)) if times else math.nan,
        p90_seconds=float(np.percentile(times, 90)) if times else math.nan,
        matchmaking_seconds=float(np.median([o.matchmaking_seconds for o in outcomes])),
    )
