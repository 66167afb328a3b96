"""``--tau auto``: each node picks its own overlap from its round latency and step time
(docs/design.md "Across the internet").

A round sent at step ``s`` is applied at ``s + tau``; the node blocks there unless the round
came back within ``tau`` steps of compute. So the tau that hides a round is its latency in
steps, ``ceil(latency / step_seconds)``, plus a step of margin. ``target_tau`` is that figure
from a robust view of recent rounds (a high quantile of latencies, the median step time),
bounded to ``[1, H-1]`` and to what matchmaking tolerates; ``next_tau`` moves toward it
with hysteresis; ``TauAuto`` keeps the recent figures and decides once per few rounds. tau
is local to the node: a change applies to rounds sent after it (each pending round keeps its
receive step), and since ``tau < H`` a fragment's rounds still apply in order.
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
"""Rounds observed since the last decision before the next one (not every round)."""
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
    """The taus auto may pick: ``[1, H-1]`` (0 when H is 1, the only tau there is)."""
    high = sync_every - 1
    return min(1, high), high


def target_tau(
    latencies: Sequence[float],
    step_seconds: Sequence[float],
    sync_every: int,
    max_ahead: float | None = None,
    quantile: float = LATENCY_QUANTILE,
    margin: int = MARGIN_STEPS,
) -> int:
    """``clamp(ceil(latency quantile / median step seconds) + margin, 1, H-1)``, and at most
    ``max_ahead / step seconds`` steps.

    A node blocks on a round only at its receive step, so with tau t it may run up to t
    steps ahead of its peers and meet them at a send step that much earlier; ``max_ahead``
    (seconds) keeps that within what matchmaking waits for peers. Without it the round's
    seconds, which include waiting for the others, grow with the gap and push tau to H-1,
    the nodes drift apart beyond the window and every round fails.
    """
    low, high = tau_bounds(sync_every)
    step = max(nearest_rank(step_seconds, 0.5), 1e-9)
    if max_ahead is not None:
        high = max(low, min(high, math.floor(max_ahead / step)))
    steps = math.ceil(nearest_rank(latencies, quantile) / step) + margin
    return max(low, min(high, steps))


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
    """The latency quantile, seconds."""
    step_seconds: float
    """The median step's compute, seconds."""


@dataclass
class TauAuto:
    """Recent round latencies and step times of one node, and its tau decisions."""

    sync_every: int
    tau: int
    latencies: deque[float] = field(default_factory=lambda: deque(maxlen=ROUNDS_WINDOW))
    step_seconds: deque[float] = field(default_factory=lambda: deque(maxlen=STEPS_WINDOW))
    rounds_since: int = 0
    """Rounds observed since the last decision."""
    used: set[int] = field(default_factory=set)
    """Every tau this node used (the summary's range)."""
    max_ahead: float | None = None
    """Seconds of steps a node may run ahead of its peers (``target_tau``); None: no bound
    but H-1 (a transport without matchmaking)."""

    def __post_init__(self) -> None:
        low, high = tau_bounds(self.sync_every)
        self.tau = max(low, min(high, self.tau))
        self.used.add(self.tau)

    def observe_step(self, seconds: float) -> None:
        self.step_seconds.append(seconds)

    def observe_round(self, seconds: float) -> TauChange | None:
        """Count one applied round's latency (send to result); every ``ROUNDS_BETWEEN``
        rounds, a new tau if the figures call for one."""
        self.latencies.append(seconds)
        self.rounds_since += 1
        if self.rounds_since < ROUNDS_BETWEEN or not self.step_seconds:
            return None
        self.rounds_since = 0
        target = target_tau(self.latencies, self.step_seconds, self.sync_every, self.max_ahead)
        new = next_tau(self.tau, target)
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
