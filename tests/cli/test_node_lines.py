"""The lines a node prints for a person: step of the total, ETA, what it trains with, and
failed rounds by cause."""

from __future__ import annotations

import logging

import pytest

from diloco.cli.node_lines import progress_line, startup_lines, summary_line
from diloco.node.round_failures import ALONE, FailureLog, failure_cause


def test_progress_line_shows_total_percent_eta_and_spells_compute_out() -> None:
    record = {
        "step": 120,
        "steps": 600,
        "eta_s": 192.0,
        "loss": 2.31,
        "tokens_per_s": 1234.4,
        "cu": 0.88,
        "mb_sent": 1.5,
        "mb_received": 1.25,
        "peers_last_round": 3,
    }
    assert progress_line(record) == (
        "step 120/600 (20%) · loss 2.3100 · 1,234 tok/s · compute 88% (of wall time) · "
        "ETA 3m12s · sent 1.50 MB · recv 1.25 MB · peers 3"
    )


def test_startup_lines_name_device_precision_data_vocab_preset_and_parameters() -> None:
    lines = startup_lines(
        device="cpu",
        precision="fp32",
        data=None,
        vocab_size=32000,
        preset="tiny",
        num_params=1234567,
    )
    assert lines == [
        "model: preset tiny, 1,234,567 parameters, vocabulary 32,000 tokens",
        "device cpu, precision fp32, data: embedded corpus",
    ]


def test_summary_says_why_rounds_failed() -> None:
    record = {
        "step": 600,
        "eval_loss": 2.5,
        "cu": 0.9,
        "bytes_sent": 2e6,
        "dp_bytes_estimate": 9e8,
        "rounds_pending": 0,
        "failed_causes": {ALONE: 10, "timed out": 2},
    }
    assert "12 failed rounds (10 no partner (alone in the swarm), 2 timed out)" in summary_line(
        record
    )
    assert "no failed rounds" in summary_line(record | {"failed_causes": {}})


@pytest.mark.parametrize(
    ("error", "cause"),
    [
        ("fragment 0 round 3 failed: no group: 1 member(s) < min_group_size 2", ALONE),
        (
            "fragment 1 round 2 failed: no group: 2 member(s) < min_group_size 3",
            "too few partners for the group size",
        ),
        ("fragment 1 round 2 failed: round deadline passed", "timed out"),
        ("fragment 1 round 2 failed: something new", "something new"),
    ],
)
def test_failure_cause(error: str, cause: str) -> None:
    assert failure_cause(error) == cause


def test_alone_node_logs_once_when_waiting_starts_and_once_when_a_group_forms(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    log = FailureLog(clock=lambda: now[0])
    alone = "fragment 0 round 1 failed: no group: 1 member(s) < min_group_size 2"
    with caplog.at_level(logging.INFO, logger="diloco.node.round_failures"):
        for _ in range(12):  # a round every 3 s, under a minute
            log.failed(alone)
            now[0] += 3.0
        assert [r.getMessage() for r in caplog.records] == [
            "waiting for peers: alone in the swarm, training alone meanwhile"
        ]
        caplog.clear()
        for _ in range(9):  # the 21st, at 60 s: one summary, not one line per round
            log.failed(alone)
            now[0] += 3.0
        assert [r.getMessage() for r in caplog.records] == [
            "21 rounds failed in the last 60 s: no partner (alone in the swarm)"
        ]
        caplog.clear()
        log.succeeded(2)
        log.succeeded(2)
        assert [r.getMessage() for r in caplog.records] == [
            "a group formed: 2 members in this round"
        ]
    assert log.total == {ALONE: 21}
