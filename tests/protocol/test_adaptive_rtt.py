"""Matchmaking timeouts that follow the measured round trip (``adaptive.rtt_timeouts``)."""

from __future__ import annotations

import pytest

from diloco.protocol.core.adaptive import (
    MAX_STRETCH,
    RTT_FACTOR,
    round_trip_estimate,
    rtt_timeouts,
)
from diloco.protocol.core.group import RoundTimeouts

RUN = RoundTimeouts(matchmaking_window=2.0, join_timeout=2.0)


def test_a_long_round_trip_stretches_the_window_and_the_join_timeout() -> None:
    stretched = rtt_timeouts(RUN, 0.5)  # 8 round trips = 4 s
    assert stretched.matchmaking_window == stretched.join_timeout == pytest.approx(4.0)
    assert stretched.matchmaking > RUN.matchmaking and stretched.total > RUN.total
    # the all-reduce's deadlines are adapted from its transfers, not from here
    assert stretched.sender_timeout == RUN.sender_timeout
    assert stretched.verify_timeout == RUN.verify_timeout


def test_a_short_or_unknown_round_trip_keeps_the_run_timeouts() -> None:
    assert rtt_timeouts(RUN, 0.1) == RUN  # 8 x 0.1 < 2 s: never lowered
    assert rtt_timeouts(RUN, None) == RUN


def test_the_stretch_is_bounded() -> None:
    widest = rtt_timeouts(RUN, 10.0)
    assert widest.matchmaking_window == pytest.approx(MAX_STRETCH * RUN.matchmaking_window)
    assert widest.join_timeout == pytest.approx(MAX_STRETCH * RUN.join_timeout)
    assert RTT_FACTOR * 10.0 > widest.join_timeout


def test_the_estimate_is_the_median_of_recent_rounds_once_there_are_enough() -> None:
    assert round_trip_estimate([0.3, 0.31]) is None
    assert round_trip_estimate([0.3, 0.9, 0.31, 0.32, 2.0]) == pytest.approx(0.32)
