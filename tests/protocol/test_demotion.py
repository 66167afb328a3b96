"""Demotion of a node whose reducer part keeps failing, on hand-made histories."""

from __future__ import annotations

import pytest

from diloco.protocol.core.demotion import Demotion, own_part_missing
from diloco.protocol.wire.frames import RoundTag
from diloco.protocol.wire.part import Report

TAG = RoundTag(bytes(16), 0, 1)


def _report(parts: tuple[bool, ...]) -> Report:
    return Report(TAG, b"g" * 16, parts, b"d" * 32)


def test_own_part_missing_when_a_report_lacks_it_or_the_reducer_failed() -> None:
    full = {0: _report((True, True, True)), 2: _report((True, True, True))}
    assert not own_part_missing(1, False, full)
    assert own_part_missing(1, True, full)
    lacking = {0: _report((True, True, True)), 2: _report((True, False, True))}
    assert own_part_missing(1, False, lacking)
    assert not own_part_missing(0, False, lacking)  # another member's part is not mine


def test_demoted_after_max_failures_within_the_window_for_cooldown_rounds() -> None:
    d = Demotion(max_failures=2, window=3, cooldown=2)
    d.record(reduced=True, failed=True)
    assert not d.demoted
    d.record(reduced=True, failed=False)
    d.record(reduced=True, failed=True)  # 2 of the last 3
    assert d.demoted
    d.record(reduced=False, failed=True)  # a client round serves the demotion
    assert d.demoted
    d.record(reduced=False, failed=False)
    assert not d.demoted
    d.record(reduced=True, failed=True)  # history was cleared: one failure is not enough
    assert not d.demoted


def test_failures_outside_the_window_are_forgotten() -> None:
    d = Demotion(max_failures=2, window=2, cooldown=1)
    for failed in (True, False, False, True, False, True):  # never 2 in any 2 in a row
        d.record(reduced=True, failed=failed)
        assert not d.demoted
    d.record(reduced=True, failed=True)  # the last two both failed
    assert d.demoted


@pytest.mark.parametrize(("max_failures", "window", "cooldown"), [(0, 3, 1), (4, 3, 1), (1, 3, 0)])
def test_bad_settings_raise(max_failures: int, window: int, cooldown: int) -> None:
    with pytest.raises(ValueError):
        Demotion(max_failures=max_failures, window=window, cooldown=cooldown)
