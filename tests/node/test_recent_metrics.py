"""A node's events become its metrics record: counts, bounded recent points, valid always."""

from __future__ import annotations

from typing import Any

from diloco.node.observe.recent_metrics import RecentMetrics
from diloco.protocol.records.metrics import MAX_POINTS, MAX_ROUNDS, LossPoint, RoundEntry


def _round(fragment: int, round_: int, step: int) -> dict[str, Any]:
    return {
        "event": "round",
        "step": step,
        "fragment": fragment,
        "round": round_,
        "members": 3,
        "bytes_sent": 100,
        "bytes_received": 120,
        "seconds": 0.25,
        "blocked_seconds": 0.0,
        "outer_sha256": "ab" * 32,
    }


def test_events_become_counts_points_and_rounds() -> None:
    recent = RecentMetrics()
    recent.observe({"event": "config", "tokens_per_step": 128, "run_id": "x"})
    for step in (1, 2, 3):
        recent.observe({"event": "step", "step": step, "loss": 5.0})
    recent.observe({"event": "progress", "step": 3, "loss": 4.5, "cu": 0.8})
    recent.observe({"event": "eval", "step": 3, "loss_outer": 4.75})
    recent.observe(_round(0, 1, 3))
    recent.observe({"event": "round_failed", "step": 3, "fragment": 1, "round": 1, "error": "x"})
    recent.observe({"event": "healed", "step": 3, "fragments": [1, 2]})
    recent.observe({"event": "joined", "step": 3, "versions": [1, 1]})
    record = recent.record()
    record.check()
    assert (record.steps, record.tokens, record.cu) == (3, 384, 0.8)
    assert (record.bytes_sent, record.bytes_received) == (100, 120)
    assert (record.failed_rounds, record.healed_fragments) == (1, 2)
    assert record.losses == (LossPoint(3, 4.5),)
    assert record.evals == (LossPoint(3, 4.75),)
    assert record.rounds == (
        RoundEntry(0, 1, 3, 3, 0.25, 100, 120, True),
        RoundEntry(1, 1, 3, 0, 0.0, 0, 0, False),
    )


def test_the_last_record_says_how_the_node_trained_and_ended() -> None:
    recent = RecentMetrics("cuda:0", "bf16", 16)
    recent.observe({"event": "eval", "step": 30, "loss_outer": 4.75})
    assert recent.record().end is None
    recent.observe({"event": "summary", "step": 40, "interrupted": False, "eval_loss": 4.5})
    record = recent.record()
    record.check()
    assert (record.device, record.precision, record.batch_size) == ("cuda:0", "bf16", 16)
    assert record.end == "finished"
    assert record.evals == (LossPoint(30, 4.75), LossPoint(40, 4.5))
    recent.observe({"event": "summary", "step": 40, "interrupted": True, "eval_loss": 4.5})
    assert recent.record().end == "stopped"


def test_points_and_rounds_are_bounded_to_the_newest() -> None:
    recent = RecentMetrics()
    for step in range(1, 200):
        recent.observe({"event": "progress", "step": step, "loss": 1.0 + step, "cu": 1.0})
        recent.observe(_round(step % 3, step, step))
    record = recent.record()
    record.check()
    assert len(record.losses) == MAX_POINTS and record.losses[-1] == LossPoint(199, 200.0)
    assert len(record.rounds) == MAX_ROUNDS and record.rounds[0].round == 199 - MAX_ROUNDS + 1


def test_non_finite_and_repeated_losses_are_left_out() -> None:
    recent = RecentMetrics()
    recent.observe({"event": "progress", "step": 5, "loss": float("nan"), "cu": 1.0})
    recent.observe({"event": "progress", "step": 6, "loss": 3.0, "cu": 1.0})
    recent.observe({"event": "progress", "step": 6, "loss": 2.0, "cu": 1.0})  # not after 6
    recent.observe({"event": "eval", "step": 7, "loss_outer": float("inf")})
    record = recent.record()
    record.check()
    assert record.losses == (LossPoint(6, 3.0),) and record.evals == ()
