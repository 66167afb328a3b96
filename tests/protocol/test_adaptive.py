"""Adaptive part deadlines: hand-made transfer histories, hand-computed budgets."""

from __future__ import annotations

import pytest

from diloco.protocol.core.adaptive import MARGIN_S, RECENT_ROUNDS, adapted_timeouts, percentile
from diloco.protocol.core.group import RoundTimeouts

RUN = RoundTimeouts(sender_timeout=10.0, reducer_timeout=8.0, connect_timeout=5.0)


def test_percentile_nearest_rank() -> None:
    samples = [float(x) for x in range(10, 0, -1)]  # 10..1, unsorted on purpose
    assert percentile(samples, 0.9) == 9.0
    assert percentile(samples, 1.0) == 10.0
    assert percentile([3.0], 0.9) == 3.0
    with pytest.raises(ValueError):
        percentile([], 0.9)


def test_part_deadlines_follow_factor_times_p90_plus_margin() -> None:
    transfers = [0.2, 0.25, 0.3, 0.4, 0.3, 0.2, 0.35, 0.3, 0.25, 0.9]  # p90: 0.4
    t = adapted_timeouts(RUN, transfers, factor=4.0, floor=1.0)
    assert t.sender_timeout == t.reducer_timeout == pytest.approx(4 * 0.4 + MARGIN_S)
    assert t.rereduce_timeout == t.reducer_timeout
    assert t.connect_timeout == t.sender_timeout  # never above the sender timeout
    assert (t.report_timeout, t.verify_timeout) == (RUN.report_timeout, RUN.verify_timeout)
    assert t.total < RUN.total


def test_part_deadlines_bounded_by_floor_and_by_the_run() -> None:
    fast = adapted_timeouts(RUN, [0.01] * 5, factor=4.0, floor=2.0)
    assert fast.sender_timeout == fast.reducer_timeout == 2.0
    slow = adapted_timeouts(RUN, [30.0] * 5, factor=4.0, floor=2.0)
    assert (slow.sender_timeout, slow.reducer_timeout) == (10.0, 8.0)
    assert slow.connect_timeout == RUN.connect_timeout


def test_only_recent_rounds_count() -> None:
    old_slow = [30.0] * 50
    recent_fast = [0.5] * RECENT_ROUNDS
    t = adapted_timeouts(RUN, old_slow + recent_fast, factor=2.0, floor=1.0)
    assert t.sender_timeout == pytest.approx(2 * 0.5 + MARGIN_S)


@pytest.mark.parametrize(("transfers", "factor"), [([0.1, 0.1], 4.0), ([0.1] * 8, 0.0)])
def test_too_few_rounds_or_factor_zero_keep_the_run_timeouts(
    transfers: list[float], factor: float
) -> None:
    assert adapted_timeouts(RUN, transfers, factor=factor, floor=1.0) == RUN
