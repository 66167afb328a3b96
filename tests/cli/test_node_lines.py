"""What a new user sees: step lines with the total and an ETA, what a node trains with,
failed rounds by cause, ``join --help`` in two groups, a bad peer address in one line."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from click.testing import CliRunner

from diloco.cli import main
from diloco.cli.node_lines import progress_line, startup_lines, summary_line
from diloco.cli.options import SWARM_HEADING
from diloco.node.swarm.round_failures import ALONE, WAITING, FailureLog, failure_cause


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
    assert summary_line(record).endswith("rounds pending at end: 0")
    assert summary_line(record | {"tau_range": [1, 9]}).endswith("at end: 0, tau 1-9")
    assert summary_line(record | {"tau_range": [3, 3]}).endswith("at end: 0, tau 3")
    assert "of one" not in summary_line(record)
    assert "30 rounds of one (alone), " in summary_line(record | {"rounds_alone": 30})


@pytest.mark.parametrize(
    ("error", "cause"),
    [
        ("fragment 0 round 3 failed: no group: 1 member(s) < min_group_size 2", ALONE),
        (
            "fragment 1 round 2 failed: no group: 2 member(s) < min_group_size 3",
            "too few partners for the group size",
        ),
        ("fragment 1 round 2 failed: round deadline passed", "timed out"),
        (
            "fragment 0 round 1 failed: leader 12D3KooWD refused: UNKNOWN_ROUND not in round "
            "RoundKey(fragment=0, round=1)",
            "refused by the round's leader (not in that round)",
        ),
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
    with caplog.at_level(logging.INFO, logger="diloco.node.swarm.round_failures"):
        for _ in range(12):  # a round every 3 s, under a minute
            log.failed(alone)
            now[0] += 3.0
        assert [r.getMessage() for r in caplog.records] == [WAITING]
        assert WAITING.startswith("waiting for peers: alone in the swarm")
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


def test_rounds_of_one_are_waiting_not_a_group_and_not_failures(
    caplog: pytest.LogCaptureFixture,
) -> None:
    log = FailureLog(clock=lambda: 0.0)
    with caplog.at_level(logging.INFO, logger="diloco.node.swarm.round_failures"):
        for _ in range(3):
            log.succeeded(1)
        assert [r.getMessage() for r in caplog.records] == [WAITING]
        caplog.clear()
        log.succeeded(3)
        assert [r.getMessage() for r in caplog.records] == [
            "a group formed: 3 members in this round"
        ]
    assert (log.alone_rounds, sum(log.total.values())) == (3, 0)


@pytest.mark.parametrize(
    "address",
    [
        "127.0.0.1:31337",
        "/ip4/127.0.0.1/tcp/abc/p2p/12D3KooW",
        "/ip4/127.0.0.1/tcp/31337",
        "/ip4/127.0.0.1/tcp/31337/p2p/Qmxyz",
    ],
)
def test_join_names_a_malformed_peer_address_in_one_line(address: str) -> None:
    result = CliRunner().invoke(main, ["join", "--initial-peers", address])
    assert result.exit_code == 2, result.output
    assert f"bad --initial-peers address {address!r}: expected /ip4/HOST/tcp/PORT/p2p/PEERID" in (
        result.output
    )
    assert "(" + repr(address) + ",)" not in result.output  # no Python tuple


def test_join_help_sets_the_runs_settings_apart_without_starts_defaults() -> None:
    text = CliRunner().invoke(main, ["join", "--help"]).output
    own, swarm = text.split(SWARM_HEADING)
    for flag in ("--initial-peers", "--batch-size", "--device", "--data", "--tau"):
        assert f"  {flag} " in own
    for flag in ("--H ", "--steps ", "--preset ", "--outer-lr ", "--config "):
        assert f"  {flag}" in swarm and f"  {flag}" not in own
    steps_help = "T: inner steps of the whole run."
    assert f"{steps_help} --H" in " ".join(swarm.split())  # no start's default
    assert "SPEC" not in text
    start_help = " ".join(CliRunner().invoke(main, ["start", "--help"]).output.split())
    assert SWARM_HEADING not in start_help and f"{steps_help} [default: 600]" in start_help


def test_waiting_and_failed_round_lines_show_without_verbose(tmp_path: Path) -> None:
    logger = logging.getLogger("diloco.node.swarm.round_failures")
    try:
        result = CliRunner().invoke(main, ["keygen", "--identity", str(tmp_path / "id.key")])
        assert result.exit_code == 0, result.output
        assert logger.isEnabledFor(logging.INFO)
    finally:
        logger.setLevel(logging.NOTSET)


def test_local_step_lines_show_the_total_and_an_eta(capsys: pytest.CaptureFixture[str]) -> None:
    from diloco.cli.experiments import _echo_progress

    record = {"event": "step", "step": 30, "steps": 120, "eta_s": 3725.0, "loss": 4.5}
    _echo_progress(record | {"tokens_per_s": 999.6, "mb_sent_per_replica": 0.5})
    assert capsys.readouterr().out == (
        "step 30/120 (25%) · loss 4.5000 · 1,000 tok/s · ETA 1h02m · sent 0.50 MB\n"
    )
