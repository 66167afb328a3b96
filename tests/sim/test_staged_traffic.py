"""Per-peer bytes and streams of staged rounds, against the cost model by hand."""

from __future__ import annotations

import pytest

from diloco.sim.staged_traffic import staged_traffic


def test_staged_traffic_flat_is_the_butterfly() -> None:
    # 8 members, 1000 values of 8 bits: parts of 125 bytes, 7 out and 7 averages out.
    t = staged_traffic(1000, 8, 8, None)
    assert t.num_stages == 1 and t.shape == (8,)
    assert t.bytes_sent == pytest.approx(14 * 125)
    assert t.bytes_received == pytest.approx(14 * 125)
    assert t.streams == 7 and t.max_streams == 7


def test_staged_traffic_twelve_in_fours() -> None:
    # Stage 0: groups of 4, parts of 250 bytes: 6 x 250 sent, 3 streams. Stage 1: groups
    # of 3, parts of 333.3: 4 x 333.3 sent, 2 streams.
    t = staged_traffic(1000, 8, 12, 4)
    assert t.shape == (4, 3)
    assert t.stage_bytes_sent == pytest.approx((1500.0, 4000 / 3))
    assert t.bytes_sent == pytest.approx(1500 + 4000 / 3)
    assert t.streams == 5 and t.max_streams == 5


def test_staged_traffic_receiver_sends_nothing() -> None:
    # 10 in fours: cells 4, 3, 3; stage 1 has one receiver, which opens 3 streams and
    # gets 3 parts of 333.3 bytes; its group's reducers each send one more part.
    t = staged_traffic(1000, 8, 10, 4)
    stage0 = (4 * 6 * 250 + 6 * 4 * (1000 / 3)) / 10
    stage1 = (9 * 4 * (1000 / 3) + 3 * (1000 / 3)) / 10
    assert t.stage_bytes_sent == pytest.approx((stage0, stage1))
    assert t.streams == pytest.approx((4 * 3 + 6 * 2 + 9 * 2 + 3) / 10)
