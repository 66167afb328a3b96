"""A node that fails its rounds one after another says why, once, in one line."""

from __future__ import annotations

import logging

import pytest

from diloco.node.swarm.round_failures import IN_A_ROW, FailureLog

REFUSED = (
    "fragment 0 round 4 failed: leader 12D3KooWD refused: UNKNOWN_ROUND not in round "
    "RoundKey(fragment=0, round=4)"
)
ALONE_ERROR = "fragment 0 round 3 failed: no group: 1 member(s) < min_group_size 2"


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_rounds_failed_in_a_row_with_peers_live_earn_one_line_saying_why(
    caplog: pytest.LogCaptureFixture,
) -> None:
    log = FailureLog(clock=lambda: 0.0)
    with caplog.at_level(logging.INFO, logger="diloco.node.swarm.round_failures"):
        for _ in range(3 * IN_A_ROW):
            log.failed(REFUSED, others=2)
    (line,) = _warnings(caplog)
    assert line.startswith(f"{IN_A_ROW} rounds in a row failed, the last: leader 12D3KooWD")
    assert "with 2 other live node(s): this node reaches its send steps out of step" in line
    assert "\n" not in line


def test_no_partner_while_others_are_live_is_not_told_as_alone(
    caplog: pytest.LogCaptureFixture,
) -> None:
    log = FailureLog(clock=lambda: 0.0)
    with caplog.at_level(logging.INFO, logger="diloco.node.swarm.round_failures"):
        for _ in range(IN_A_ROW):
            log.failed(ALONE_ERROR, others=2)
    messages = [r.getMessage() for r in caplog.records]
    assert not any("alone in the swarm" in m for m in messages), messages
    (line,) = _warnings(caplog)
    assert "no group: 1 member(s)" in line and "2 other live node(s)" in line


def test_a_round_applied_between_failures_starts_the_count_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    log = FailureLog(clock=lambda: 0.0)
    with caplog.at_level(logging.INFO, logger="diloco.node.swarm.round_failures"):
        for _ in range(3):
            for _ in range(IN_A_ROW - 1):
                log.failed(REFUSED, others=2)
            log.succeeded(3)
    assert _warnings(caplog) == []
