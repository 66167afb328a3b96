"""The agreement over REPORTs, on hand-made reports: a strict majority decides, and who
cannot fail a round for the others."""

from __future__ import annotations

import pytest

from diloco.errors import ProtocolError
from diloco.protocol.core.agreement import (
    ANOTHER_RESULT,
    MISSING_PARTS,
    Verdict,
    awaited_reports,
    check_report,
    decide,
)
from diloco.protocol.wire.frames import RoundTag
from diloco.protocol.wire.part import Report

TAG = RoundTag(bytes(range(16)), 1, 3)
GID = b"g" * 16
MINE = b"m" * 32
OTHER = b"o" * 32
ALL = (True, True, True, True)
NONE_HELD = (False, False, False, False)


def _report(parts: tuple[bool, ...] = ALL, digest: bytes = MINE) -> Report:
    return Report(TAG, GID, parts, digest)


def test_decide_accepts_when_full_contributors_agree() -> None:
    reports = {1: _report(), 2: _report(), 3: _report()}
    assert decide(0, ALL, MINE, ALL, reports) == Verdict(True)


def test_decide_missing_part_here_fails() -> None:
    verdict = decide(0, (True, False, True, False), MINE, ALL, {1: _report()})
    assert verdict == Verdict(False, "parts [1, 3] missing here")


def test_decide_one_liar_of_four_does_not_fail_the_round() -> None:
    reports = {1: _report(), 2: _report(), 3: _report(digest=OTHER)}
    assert decide(0, ALL, MINE, ALL, reports) == Verdict(True, dissent={3: ANOTHER_RESULT})


def test_decide_one_missing_part_report_of_three_does_not_fail_the_round() -> None:
    full = (True, True, True, False)
    reports = {1: _report((True, True, False, True)), 2: _report()}
    assert decide(0, ALL, MINE, full, reports) == Verdict(True, dissent={1: MISSING_PARTS})


def test_decide_half_is_no_majority() -> None:
    reports = {1: _report(), 2: _report(digest=OTHER), 3: _report(NONE_HELD, OTHER)}
    verdict = decide(0, ALL, MINE, ALL, reports)
    assert not verdict.accepted
    assert verdict.dissent == {2: ANOTHER_RESULT, 3: MISSING_PARTS}
    assert verdict.reason.startswith("result held by 2 of 4 members, no majority")


def test_decide_minority_result_fails_its_holder() -> None:
    reports = {0: _report(digest=OTHER), 1: _report(digest=OTHER), 3: _report(digest=OTHER)}
    verdict = decide(2, ALL, MINE, ALL, reports)
    assert not verdict.accepted
    assert verdict.dissent == {0: ANOTHER_RESULT, 1: ANOTHER_RESULT, 3: ANOTHER_RESULT}


def test_decide_reports_that_did_not_come_are_no_agreement() -> None:
    assert not decide(0, ALL, MINE, ALL, {1: _report()}).accepted  # 2 of 4
    assert decide(0, ALL, MINE, ALL, {1: _report(), 2: _report()}).accepted  # 3 of 4


def test_decide_two_members_a_liar_can_veto() -> None:
    pair = (True, True)
    assert decide(0, pair, MINE, pair, {1: Report(TAG, GID, pair, MINE)}).accepted
    verdict = decide(0, pair, MINE, pair, {1: Report(TAG, GID, pair, OTHER)})
    assert not verdict.accepted and verdict.dissent == {1: ANOTHER_RESULT}


def test_decide_member_not_counted_everywhere_cannot_veto() -> None:
    full = (True, True, False, True)  # member 2 was excluded from some part
    reports = {1: _report(), 2: _report(NONE_HELD, OTHER), 3: _report()}
    assert decide(0, ALL, MINE, full, reports) == Verdict(True)


def test_decide_late_member_votes_with_the_full_contributors() -> None:
    full = (True, True, False, True)  # this member (2) counted in its own part only
    reports = {0: _report(), 1: _report(), 3: _report(digest=OTHER)}
    # voters 0, 1, 3 and itself: 3 of 4 hold its digest
    assert decide(2, ALL, MINE, full, reports) == Verdict(True, dissent={3: ANOTHER_RESULT})
    assert not decide(2, ALL, MINE, full, {0: _report()}).accepted  # 2 of 4


def test_decide_no_full_contributor_applies_nothing() -> None:
    """A pair where a frozen member's contribution reached neither part in time: this
    member holds every part and nobody contradicts it, but no part counts both, so the
    result is a mix nobody vouches for; the round fails (its holder would never heal)."""
    full = (False, False)
    verdict = decide(0, (True, True), MINE, full, {1: _report((True, True))})
    assert verdict == Verdict(False, "no member is counted in every part")


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
