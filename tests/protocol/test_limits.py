"""Stream caps on hand-made request times: per peer one at a time, per-peer rate, total."""

from __future__ import annotations

import pytest

from diloco.protocol.trust.limits import MAX_TRACKED_PEERS, StreamLimiter, StreamLimits

LIMITS = StreamLimits(max_streams=3, burst=2, refill_seconds=10.0)


def test_one_stream_at_a_time_per_peer() -> None:
    limiter = StreamLimiter(LIMITS)
    assert limiter.admit("a", 0.0) is None
    assert limiter.admit("a", 0.1) == "one stream at a time per peer"
    limiter.release("a")
    assert limiter.admit("a", 0.2) is None


def test_burst_then_one_request_per_refill_period() -> None:
    limiter = StreamLimiter(LIMITS)
    for now in (0.0, 1.0):
        assert limiter.admit("a", now) is None
        limiter.release("a")
    assert limiter.admit("a", 2.0) == "over 2 requests, then one per 10 s"
    # 0.1 of a request was left at t=1 (0.1 regained since t=0): 0.99 at t=9.9.
    assert limiter.admit("a", 9.9) is not None
    assert limiter.admit("a", 10.5) is None
    limiter.release("a")
    assert limiter.admit("a", 12.0) is not None
    # A refused request costs nothing: quiet for long, the bucket is full (not more).
    assert limiter.admit("a", 1000.0) is None
    limiter.release("a")
    assert limiter.admit("a", 1000.0) is None
    limiter.release("a")
    assert limiter.admit("a", 1000.0) is not None


def test_total_streams_capped_over_all_peers() -> None:
    limiter = StreamLimiter(LIMITS)
    assert [limiter.admit(p, 0.0) for p in "abc"] == [None, None, None]
    assert limiter.admit("d", 0.0) == "3 streams open already"
    limiter.release("b")
    assert limiter.admit("d", 0.0) is None


def test_peers_are_limited_each_on_their_own() -> None:
    limiter = StreamLimiter(LIMITS)
    for _ in range(2):
        assert limiter.admit("a", 0.0) is None
        limiter.release("a")
    assert limiter.admit("a", 0.0) is not None
    assert limiter.admit("b", 0.0) is None


def test_full_buckets_are_forgotten_when_many_peers_asked() -> None:
    limiter = StreamLimiter(StreamLimits(max_streams=1, burst=1, refill_seconds=1.0))
    for i in range(MAX_TRACKED_PEERS):
        assert limiter.admit(f"p{i}", float(i) / MAX_TRACKED_PEERS) is None
        limiter.release(f"p{i}")
    assert limiter.admit("late", 5.0) is None  # every earlier bucket is full again
    assert set(limiter.buckets) == {"late"}


@pytest.mark.parametrize(
    "bad",
    [{"max_streams": 0}, {"burst": 0}, {"refill_seconds": 0.0}, {"refill_seconds": float("nan")}],
)
def test_limits_must_be_positive(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="must be positive"):
        StreamLimits(**bad)  # type: ignore[arg-type]
