"""The agreement over REPORTs, on hand-made reports: who can fail a round, and who cannot."""

from __future__ import annotations

import pytest

from diloco.errors import ProtocolError
from diloco.protocol.agreement import Verdict, awaited_reports, check_report, decide
from diloco.protocol.wire import Report, RoundTag

TAG = RoundTag(bytes(range(16)), 1, 3)
GID = b"g" * 16
MINE = b"m" * 32
OTHER = b"o" * 32
ALL = (True, True, True, True)


def _report(parts: tuple[bool, ...] = ALL, digest: bytes = MINE) -> Report:
    return Report(TAG, GID, parts, digest)


def test_decide_accepts_when_full_contributors_agree() -> None:
    reports = {1: _report(), 2: _report(), 3: _report()}
    assert decide(ALL, MINE, ALL, reports) == Verdict(True)


def test_decide_accepts_with_reports_still_missing() -> None:
    assert decide(ALL, MINE, ALL, {}) == Verdict(True)


def test_decide_missing_part_here_fails() -> None:
    verdict = decide((True, False, True, False), MINE, ALL, {1: _report()})
    assert verdict == Verdict(False, "parts [1, 3] missing here")


def test_decide_full_contributor_missing_a_part_fails() -> None:
    reports = {1: _report(), 2: _report((True, True, False, True))}
    assert decide(ALL, MINE, ALL, reports) == Verdict(False, "member 2 is missing parts")


def test_decide_full_contributor_with_another_digest_fails() -> None:
    reports = {1: _report(), 3: _report(digest=OTHER)}
    assert decide(ALL, MINE, ALL, reports) == Verdict(False, "member 3 assembled another result")


def test_decide_member_not_counted_everywhere_cannot_veto() -> None:
    full = (True, True, False, True)  # member 2 was excluded from some part
    reports = {1: _report(), 2: _report((False, False, False, False), OTHER), 3: _report()}
    assert decide(ALL, MINE, full, reports) == Verdict(True)


def test_awaited_reports_are_the_other_full_contributors() -> None:
    assert awaited_reports(1, (True, True, False, True)) == {0, 3}


@pytest.mark.parametrize(
    "report",
    [Report(TAG, b"x" * 16, ALL, MINE), Report(TAG, GID, (True, True, True), MINE)],
    ids=["another group", "another size"],
)
def test_check_report_for_another_group_rejected(report: Report) -> None:
    with pytest.raises(ProtocolError, match="another group"):
        check_report(report, GID, 4)
