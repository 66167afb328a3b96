"""``--tau auto``: each node picks its own overlap from its round latency and step time
(docs/design.md "Across the internet").

A round sent at step ``s`` is applied at ``s + tau``; the node blocks there unless the round
came back within ``tau`` steps of compute. So the tau that hides a round is its latency in
steps, ``ceil(latency / step_seconds)``, plus a step of margin. ``target_tau`` is that figure
from a robust view of recent rounds (a high quantile of latencies, the median step time),
bounded to ``[1, H/2]`` and to what matchmaking tolerates; ``next_tau`` moves toward it
with hysteresis; ``TauAuto`` keeps the recent figures, raises tau after any round that
calls for it and lowers it once per few rounds. tau is local to the node: a change applies
to rounds sent after it (each pending round keeps its receive step), and since ``tau < H``
a fragment's rounds still apply in order.

A round's seconds include its matchmaking, and matchmaking both costs the network a round
trip (a follower's JOIN -> GROUP; a leader's peers JOIN before it reaches its send step)
and waits for peers that reach the send step later. That wait is not the network's: a node
ahead of its peers would see it grow with its own tau (a larger tau lets it run further
ahead), raise tau for it, run further ahead, and merge ever staler rounds (counting whole
rounds drove two nodes of three to tau 12-15 on loopback, their rounds waiting a second
for the third). So the
latency counted is each round's all-reduce seconds plus its matchmaking up to one measured
round trip: the network's part, whichever role the node had. (Counting the shortest
matchmaking of the recent rounds instead, often a leader's 0, left every followed round
blocking for its JOIN's round trip: tau 3 at 200 ms for rounds of 4 steps.)

The bound: with tau ``t`` a node blocks on a round at most ``t`` steps after its send, and
the round cannot end before its last member sent plus the network's part, so the node runs
at most ``t * step - network`` seconds ahead of its slowest peer; ``tau_ceiling`` keeps
that within ``max_ahead`` (what matchmaking waits for a peer), with the network's part at
its least over the recent rounds.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

LATENCY_QUANTILE = 0.8
"""Share of recent rounds that the chosen tau should hide (a high quantile, not the worst)."""
MARGIN_STEPS = 1
"""Steps added to the latency in steps: the step time and latency jitter."""
LOWER_BY = 2
"""tau falls only when the target is at least this many steps below it (rises at once)."""
ROUNDS_WINDOW = 8
"""Recent rounds whose latencies count."""
STEPS_WINDOW = 32
"""Recent inner steps whose compute seconds count."""
ROUNDS_BETWEEN = 4
"""Rounds observed since the last decision before the next fall of tau (a rise may come
after any round: a tau too small blocks every round until it rises)."""
MAX_AHEAD_SHARE = 0.5
"""Share of the matchmaking window a node's tau may let it run ahead of its peers (the rest
is for the matchmaking exchanges themselves)."""


def nearest_rank(values: Sequence[float], quantile: float) -> float:
    """The nearest-rank ``quantile`` of ``values``: the smallest value with at least that
    share of ``values`` at or below it (a figure that was observed, not interpolated)."""
    if not values:
        raise ValueError("no values")
    ordered = sorted(values)
    return ordered[max(0, math.ceil(quantile * len(ordered)) - 1)]


def tau_bounds(sync_every: int) -> tuple[int, int]:
    """The taus auto may pick: ``[1, H/2]`` (0 when H is 1, the only tau there is). At most
    half the period: a round is applied in the first half of the period after its send, so
    its update is never staler than half the steps it summarises, and a node is never more
    than half a period ahead of the peers it blocks for."""
    if sync_every < 2:
        return 0, 0
    return 1, max(1, sync_every // 2)


def tau_ceiling(
    step_seconds: Sequence[float],
    sync_every: int,
    max_ahead: float | None = None,
    network: float = 0.0,
) -> int:
    """The largest tau auto may pick: H/2, and at most ``(max_ahead + network) / step``
    steps (median step seconds).

    A node blocks on a round only at its receive step, and the round ends no sooner than
    ``network`` seconds (the network's part of a round, at its least) after its last member
    sent, so with tau t a node may run up to ``t * step - network`` seconds ahead of its
    peers and meet them at a send step that much earlier; ``max_ahead`` (seconds) keeps that
    within what matchmaking waits for peers. Without it the round's seconds, which include
    waiting for the others, grow with the gap and push tau to its bound, the nodes drift
    apart beyond the window and every round fails.
    """
    low, high = tau_bounds(sync_every)
    if max_ahead is None:
        return high
    step = max(nearest_rank(step_seconds, 0.5), 1e-9)
    return max(low, min(high, math.floor((max_ahead + max(0.0, network)) / step)))


def target_tau(
    latencies: Sequence[float],
    step_seconds: Sequence[float],
    sync_every: int,
    max_ahead: float | None = None,
    quantile: float = LATENCY_QUANTILE,
    margin: int = MARGIN_STEPS,
    network: float = 0.0,
) -> int:
    """``clamp(steps_to_hide, 1, tau_ceiling)``."""
    low = tau_bounds(sync_every)[0]
    high = tau_ceiling(step_seconds, sync_every, max_ahead, network)
    return max(low, min(high, steps_to_hide(latencies, step_seconds, quantile, margin)))


def steps_to_hide(
    latencies: Sequence[float],
    step_seconds: Sequence[float],
    quantile: float = LATENCY_QUANTILE,
    margin: int = MARGIN_STEPS,
) -> int:
    """``ceil(latency quantile / median step seconds) + margin``: the tau that hides the
    rounds, unbounded."""
    step = max(nearest_rank(step_seconds, 0.5), 1e-9)
    return math.ceil(nearest_rank(latencies, quantile) / step) + margin


def next_tau(current: int, target: int, lower_by: int = LOWER_BY) -> int:
    """The tau to use given the ``target``: up at once (a tau too small blocks every
    round), down only by a clear margin (so jitter does not make it oscillate)."""
    if target > current or target <= current - lower_by:
        return target
    return current


@dataclass(frozen=True, slots=True)
class TauChange:
    """A change of tau, and the figures behind it (for the log line)."""

    old: int
    new: int
    latency: float
    """The latency quantile, seconds (without the wait for later peers)."""
    step_seconds: float
    """The median step's compute, seconds."""


@dataclass
class TauAuto:
    """Recent round latencies and step times of one node, and its tau decisions."""

    sync_every: int
    tau: int
    latencies: deque[float] = field(default_factory=lambda: deque(maxlen=ROUNDS_WINDOW))
    """Recent rounds' network part: all-reduce seconds plus matchmaking up to ``round_trip``
    (module docstring)."""
    step_seconds: deque[float] = field(default_factory=lambda: deque(maxlen=STEPS_WINDOW))
    rounds_since: int = 0
    """Rounds observed since the last decision that could lower tau."""
    used: set[int] = field(default_factory=set)
    """Every tau this node used (the summary's range)."""
    round_trip: float = 0.0
    """The measured round trip to the peers, seconds (the node sets it from its reducer; 0:
    a transport whose matchmaking costs no network)."""
    max_ahead: float | None = None
    """Seconds a node may run ahead of its peers (``target_tau``); None: no bound but H/2
    (a transport without matchmaking). The node sets it from its matchmaking window, which
    follows the measured round trip."""
    period_short: bool = False
    """Whether hiding the recent rounds takes more steps than H/2, the most tau may be:
    the sync period is too short for this network, and rounds block training."""

    def __post_init__(self) -> None:
        low, high = tau_bounds(self.sync_every)
        self.tau = max(low, min(high, self.tau))
        self.used.add(self.tau)

    def observe_step(self, seconds: float) -> None:
        self.step_seconds.append(seconds)

    @property
    def network(self) -> float:
        """The network's part of a round, at its least over the recent rounds."""
        return min(self.latencies, default=0.0)

    def observe_round(self, seconds: float, matchmaking_seconds: float = 0.0) -> TauChange | None:
        """Count one applied round (``seconds`` from send to result, ``matchmaking_seconds``
        of them forming its group); a new tau if the figures call for one: a rise after any
        round, a fall only every ``ROUNDS_BETWEEN`` rounds."""
        matchmaking = min(max(0.0, matchmaking_seconds), seconds)
        self.latencies.append(seconds - matchmaking + min(matchmaking, self.round_trip))
        self.rounds_since += 1
        if not self.step_seconds:
            return None
        ceiling = tau_ceiling(self.step_seconds, self.sync_every, self.max_ahead, self.network)
        target = target_tau(
            self.latencies,
            self.step_seconds,
            self.sync_every,
            self.max_ahead,
            network=self.network,
        )
        hiding = steps_to_hide(self.latencies, self.step_seconds)
        self.period_short = hiding > tau_bounds(self.sync_every)[1]
        new = self.tau
        if target > self.tau or self.rounds_since >= ROUNDS_BETWEEN:
            new = next_tau(self.tau, target)
            self.rounds_since = 0
        new = min(new, ceiling)  # the bound on running ahead holds at once
        if new == self.tau:
            return None
        change = TauChange(
            self.tau,
            new,
            nearest_rank(self.latencies, LATENCY_QUANTILE),
            nearest_rank(self.step_seconds, 0.5),
        )
        self.tau = new
        self.used.add(new)
        return change
