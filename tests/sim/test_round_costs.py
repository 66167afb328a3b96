"""Measured and predicted CU from hand-made metrics; every expected CU is worked out here."""

from __future__ import annotations

import json
from typing import Any

import pytest

from diloco.sim.round_costs import Round, fit_link, measured_cu, predict_cu


def _config(num_fragments: int, sync_every: int, tau: int) -> dict[str, Any]:
    return {
        "event": "config",
        "sync_every": sync_every,
        "num_fragments": num_fragments,
        "tau": tau,
        "fragment_numel": [100] * num_fragments,
        "codec": "none",
    }


def _steps(count: int, seconds: float = 1.0) -> list[dict[str, Any]]:
    return [{"event": "step", "step": s, "step_seconds": seconds} for s in range(1, count + 1)]


def _round(step: int, fragment: int, members: int, wire: int, **times: float) -> dict[str, Any]:
    return {
        "event": "round",
        "step": step,
        "fragment": fragment,
        "round": 1,
        "members": members,
        "bytes_sent": wire,
        "bytes_received": wire,
        **times,
    }


def _lines(records: list[dict[str, Any]]) -> list[str]:
    return [json.dumps(r) for r in records]


def _diloco_run() -> list[str]:
    """One fragment, H 4, tau 0, 12 steps of 1 s: alone at step 4, then 2 members.

    A full round: 1 s matchmaking, then 8e6 bits in 2 s (4 Mbit/s)."""
    return _lines(
        [
            _config(1, 4, 0),
            *_steps(12),
            _round(4, 0, 1, 0, seconds=2.0, matchmaking_seconds=2.0, blocked_seconds=2.0),
            _round(8, 0, 2, 10**6, seconds=3.0, matchmaking_seconds=1.0, blocked_seconds=3.0),
            _round(12, 0, 2, 10**6, seconds=3.0, matchmaking_seconds=1.0, blocked_seconds=2.5),
        ]
    )


def test_measured_cu_whole_run_and_after_the_swarm_formed() -> None:
    cu = measured_cu(_diloco_run())
    # Whole: 12 s of compute, 2 + 3 + 2.5 s blocked.
    assert cu.whole == pytest.approx(12 / 19.5)
    # The first round with both members is applied at step 8: steps 9-12, the round at 12.
    assert cu.steady_from_step == 8
    assert cu.steady == pytest.approx(4 / 6.5)


def test_predicted_cu_adds_matchmaking_to_the_transfer() -> None:
    cu = predict_cu(_diloco_run())
    # Steady: one round; 1 s matchmaking + 8e6 bits at 8e6 / 2 = 4e6 bit/s = 3 s blocked
    # per period of 4 s of compute (tau 0: nothing overlaps).
    assert cu.steady == pytest.approx(4 / 7)
    # Whole: bits (0, 8e6, 8e6) against all-reduce seconds (0, 2, 2) fit 4e6 bit/s and no
    # fixed part; mean matchmaking (2 + 1 + 1) / 3 = 4/3 s, mean bits 16e6 / 3 -> 4/3 s:
    # 8/3 s blocked for each of the 3 rounds.
    assert cu.whole == pytest.approx(12 / (12 + 3 * 8 / 3))


def _streaming_run(*, failed: bool) -> list[str]:
    """Two fragments, H 4, tau 1, 8 steps of 1 s; each round 0.5 s matchmaking and
    2e6 bits in 0.5 s: less than the step of compute it overlaps with."""
    records = [_config(2, 4, 1), *_steps(8)]
    records += [
        _round(s, p, 2, 250_000, seconds=1.0, matchmaking_seconds=0.5, blocked_seconds=0.0)
        for s, p in ((3, 1), (5, 0), (7, 1))
    ]
    if failed:
        records.append(
            {"event": "round_failed", "step": 8, "fragment": 0, "round": 2, "blocked_seconds": 4.0}
        )
    return _lines(records)


def test_overlapped_rounds_cost_nothing_and_a_failed_round_costs_its_wait() -> None:
    assert predict_cu(_streaming_run(failed=False)).whole == pytest.approx(1.0)
    # The failed round's 4 s are lost: 8 s of compute over 12 s.
    assert predict_cu(_streaming_run(failed=True)).whole == pytest.approx(8 / 12)
    assert measured_cu(_streaming_run(failed=True)).whole == pytest.approx(8 / 12)


def _r(bits: float, seconds: float) -> Round:
    return Round(1, 0, True, 2, bits / 8, seconds + 0.5, 0.5, 0.0)


def test_fit_link_separates_the_fixed_part_from_the_rate() -> None:
    # 2.5 s for 8e6 bits, 4.5 s for 16e6: 2 s per 8e6 bits (4 Mbit/s) plus 0.5 s.
    fixed, gbps = fit_link([_r(8e6, 2.5), _r(16e6, 4.5)])
    assert fixed == pytest.approx(0.5)
    assert gbps == pytest.approx(0.004)


def test_fit_link_with_a_negative_fixed_part_puts_all_of_it_in_the_rate() -> None:
    # 1 s and 4 s would fit -2 s + 3 s per 8e6 bits: instead 24e6 bits over 5 s.
    fixed, gbps = fit_link([_r(8e6, 1.0), _r(16e6, 4.0)])
    assert fixed == 0.0
    assert gbps == pytest.approx(24e6 / 5 / 1e9)


def test_bad_round_records_are_clear_errors() -> None:
    bad = _lines([_config(1, 4, 0), *_steps(4), {"event": "round_failed", "step": 4}])
    with pytest.raises(ValueError, match="fragment"):
        measured_cu(bad)


def test_predicted_cu_at_another_bandwidth_keeps_the_other_costs() -> None:
    # Steady state at 8 Mbit/s: 8e6 bits in 1 s after the 1 s of matchmaking.
    assert predict_cu(_diloco_run(), bandwidth_gbps=0.008).steady == pytest.approx(4 / 6)


def test_predicted_cu_at_a_round_trip_time_waits_its_round_trips() -> None:
    # Steady state: the round's 1 s matchmaking and 2 s transfer, plus 3 round trips of
    # 0.5 s: 4.5 s blocked per 4 s of compute (tau 0).
    cu = predict_cu(_diloco_run(), rtt_seconds=0.5, round_trips=3)
    assert cu.steady == pytest.approx(4 / 8.5)
    # By default 3 round trips (join part check).
    assert predict_cu(_diloco_run(), rtt_seconds=0.5).steady == pytest.approx(4 / 8.5)
    with pytest.raises(ValueError, match="rtt"):
        predict_cu(_diloco_run(), rtt_seconds=-1.0)


def test_no_steady_state_when_the_node_was_always_alone() -> None:
    alone = _lines(
        [
            _config(1, 4, 0),
            *_steps(8),
            _round(4, 0, 1, 0, seconds=2.0, matchmaking_seconds=2.0, blocked_seconds=2.0),
            _round(8, 0, 1, 0, seconds=2.0, matchmaking_seconds=2.0, blocked_seconds=2.0),
        ]
    )
    cu = measured_cu(alone)
    assert cu.whole == pytest.approx(8 / 12)
    assert (cu.steady, cu.steady_from_step) == (None, None)
