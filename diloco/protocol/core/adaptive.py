"""Round deadlines that follow the measured transfer times of recent rounds. Pure.

A round's part deadlines (``RoundTimeouts.sender_timeout`` and ``reducer_timeout``, and
the re-reduction window, which is as long as the latter) are upper bounds that must hold
on the slowest link a run allows, so on a fast swarm a reducer that stalls is noticed,
and its part re-reduced (``rereduction``), only long after the round could have ended.
``adapted_timeouts`` shrinks them to ``factor`` times the 90th percentile of the transfer
times of this node's recent rounds (all-reduce start to every part held) plus a margin,
bounded below by ``floor`` and above by the run's own timeouts: never longer than the
configuration allows, never so short that a round of ordinary jitter misses them.

A member that has not even started its contribution to a part when most of the part's
contributors have (``start_bound``) is dropped from the part at once rather than at the
sender deadline (and charged an offence if it stays silent until then, docs/design.md
"Liveness"): the bound is a
multiple of how long that majority took in this very round, so it follows the swarm's
transfer times too.

Each node adapts its own deadlines from its own measurements; nodes of one group may thus
stop waiting at different times. That is safe (a member that gives up on a part asks for
its re-reduction, and the REPORT majority settles any difference) but costs a round when
the spread is wide, hence the factor and the margin.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from diloco.protocol.core.group import RoundTimeouts

RECENT_ROUNDS = 16
"""Transfer times kept: the last rounds that completed with every part on the first try."""
MIN_SAMPLES = 3
"""Fewer measured rounds than this: the run's timeouts, unchanged."""
MARGIN_S = 0.5
"""Added to ``factor`` times the percentile: scheduling jitter of a busy host."""
START_FACTOR = 4.0
"""A contributor may start this many times later than a part's majority did."""

RTT_FACTOR = 8.0
"""Round trips the matchmaking window and the join timeout last at least: declaring on the
DHT takes 2-4 of them alone (more as the swarm grows), a JOIN one, and a leader waits for
joins that left their nodes up to a round trip apart."""
MAX_STRETCH = 4.0
"""How far the round trip time may stretch a configured matchmaking timeout: a JOIN stream
is held at most this many times the configured bound (``Matchmaker.start``)."""


def rtt_timeouts(timeouts: RoundTimeouts, rtt: float | None) -> RoundTimeouts:
    """``timeouts`` with the matchmaking window and the join timeout raised to
    ``RTT_FACTOR`` times ``rtt`` (seconds, the measured round trip to the swarm's peers;
    None: not measured yet), at most ``MAX_STRETCH`` times the configured ones, never
    lowered: a window that is a fixed 2 s holds 20 round trips on one continent and fewer
    than the DHT's declaration needs across a satellite link."""
    if rtt is None or not rtt > 0:
        return timeouts

    def stretched(configured: float) -> float:
        return min(MAX_STRETCH * configured, max(configured, RTT_FACTOR * rtt))

    return dataclasses.replace(
        timeouts,
        matchmaking_window=stretched(timeouts.matchmaking_window),
        join_timeout=stretched(timeouts.join_timeout),
    )


def round_trip_estimate(samples: Sequence[float]) -> float | None:
    """The round trip to the swarm's peers from the last ``RECENT_ROUNDS`` rounds' shortest
    request/response exchange each (seconds): their median, None with fewer than
    ``MIN_SAMPLES``. An exchange lasts at least a round trip, and its shortest in a round
    is the one that waited least on anything else."""
    recent = list(samples)[-RECENT_ROUNDS:]
    return percentile(recent, 0.5) if len(recent) >= MIN_SAMPLES else None


def percentile(samples: Sequence[float], q: float) -> float:
    """The nearest-rank ``q``-quantile of ``samples`` (``0 < q <= 1``, samples not empty)."""
    if not samples or not 0 < q <= 1:
        raise ValueError(f"need samples and 0 < q <= 1, got {len(samples)} samples, q={q}")
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def adapted_timeouts(
    timeouts: RoundTimeouts, transfers: Sequence[float], *, factor: float, floor: float
) -> RoundTimeouts:
    """``timeouts`` with the part deadlines set to ``factor * p90 + MARGIN_S`` of the last
    ``RECENT_ROUNDS`` ``transfers`` (seconds), clamped to ``[floor, configured]``; the
    connect timeout is clamped to the sender timeout it must not exceed. ``factor <= 0`` or
    fewer than ``MIN_SAMPLES`` transfers: ``timeouts`` unchanged."""
    recent = list(transfers)[-RECENT_ROUNDS:]
    if factor <= 0 or len(recent) < MIN_SAMPLES:
        return timeouts
    budget = max(floor, factor * percentile(recent, 0.9) + MARGIN_S)
    sender = min(budget, timeouts.sender_timeout)
    return dataclasses.replace(
        timeouts,
        sender_timeout=sender,
        reducer_timeout=min(budget, timeouts.reducer_timeout),
        connect_timeout=min(timeouts.connect_timeout, sender),
    )


def start_bound(majority_seconds: float, timeouts: RoundTimeouts) -> float:
    """Seconds from the all-reduce's start by which every contributor to a part must have
    started sending it, once a majority of them started within ``majority_seconds``:
    ``START_FACTOR`` times that, at least ``timeouts.start_floor``, at most the sender timeout."""
    if not majority_seconds >= 0:
        raise ValueError(f"need majority_seconds >= 0, got {majority_seconds}")
    return min(timeouts.sender_timeout, max(timeouts.start_floor, START_FACTOR * majority_seconds))
