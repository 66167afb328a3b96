"""What healing may believe: claims bounded by the schedule, vouched states, robust step;
every rule on hand-made records and vouches."""

from __future__ import annotations

import logging

import pytest

from diloco.node.claims import (
    Offences,
    Schedule,
    assess,
    schedule_offence,
    vouched,
    vouched_claims,
    vouchers,
)
from diloco.protocol.records.nodes import FragmentVersion, NodeRecord, Vouch

# T 300, H 30, 5 fragments: offsets 0, 6, 12, 18, 24; round k of p is sent at 6p + 30k.
SCHEDULE = Schedule(steps=300, sync_every=30, num_fragments=5)
H0, H1, H2 = "0" * 64, "1" * 64, "2" * 64
INITIAL = [H0] * 5
ABC = ("a", "b", "c")


def record(peer: str, step: int, *frags: tuple[int, int, str]) -> NodeRecord:
    return NodeRecord(peer, (), step, tuple(FragmentVersion(*f) for f in frags), 0.0, "test")


def vouch(author: str, fragment: int, round: int, h: str, members: tuple[str, ...]) -> Vouch:
    return Vouch(author, fragment, round, h, members)


# -- claims bounded by the schedule ------------------------------------------------------------


def test_a_version_beyond_what_the_step_allows_is_an_offence() -> None:
    assert schedule_offence(record("p", 66, (0, 2, H1), (1, 2, H1)), SCHEDULE) is None
    # Fragment 1 sends round 2 at step 66: at step 65 its version is at most 1.
    why = schedule_offence(record("p", 65, (0, 2, H1), (1, 2, H1)), SCHEDULE)
    assert why == "fragment 1 at version 2 is beyond round 1, the last its step 65 allows"
    forged = schedule_offence(record("p", 300, (0, 1010, H1)), SCHEDULE)
    assert forged is not None and "version 1010 is beyond round 10" in forged


def test_a_step_beyond_the_runs_end_is_an_offence() -> None:
    assert schedule_offence(record("p", 300), SCHEDULE) is None
    assert schedule_offence(record("p", 301), SCHEDULE) == (
        "global step 301 is beyond the run's end (step 300)"
    )


def test_a_fragment_the_run_does_not_have_is_an_offence() -> None:
    assert schedule_offence(record("p", 100, (5, 0, H0)), SCHEDULE) == (
        "fragment 5 does not exist (5 in the run)"
    )


def test_a_step_far_ahead_of_the_members_pace_is_not_followed() -> None:
    # a, b and far vouched for round 2 of fragment 1: the pace is their lower median (100).
    vouches = [vouch(m, 1, 2, H1, ("a", "b", "far")) for m in ("a", "b", "far")]
    members = [record("a", 95, (1, 2, H1)), record("b", 100, (1, 2, H1))]
    near = record("near", 160, (1, 2, H1))
    far = record("far", 161, (1, 2, H1))
    view = assess([*members, near, far], vouches, SCHEDULE, INITIAL)
    assert view.pace == 100
    assert view.offences == {
        "far": "step not followed: global step 161 runs ahead of the swarm's pace (step 100 + 60)"
    }
    assert view.step == 95  # the lower median of a and b; with far's 161 it would be 100
    # What it holds is still on offer (a state is taken only when vouched and hashed).
    assert far in view.records and view.holds_vouched(far, 1)


def test_a_member_training_on_alone_stays_plausible() -> None:
    # Its partner left after round 2 of fragment 1 (sent at step 66); its rounds fail since,
    # so no newer round is vouched, and it is far past that round: still the swarm's pace.
    vouches = [vouch(m, 1, 2, H1, ("a", "b")) for m in ("a", "b")]
    alone = record("a", 200, (1, 2, H1))
    view = assess([alone], vouches, SCHEDULE, INITIAL)
    assert view.records == (alone,) and view.step == 200 and not view.offences


def test_without_vouches_the_pace_is_the_median_one_peer_cannot_move() -> None:
    honest = [record("a", 100), record("b", 104), record("c", 98)]
    liar = record("liar", 300)  # the run's last step: within the end, not the pace
    view = assess([*honest, liar], [], SCHEDULE, INITIAL, anchors=frozenset({"a", "b", "liar"}))
    # Pace: the anchors' lower median (100, 104, 300 -> 104); step: without the liar (100).
    assert view.pace == 104 and view.step == 100
    assert view.offences["liar"].startswith("step not followed: global step 300 runs ahead")
    # A record that breaks the schedule does not count toward the median either.
    forged = record("forged", 300, (0, 1000, H1))
    view = assess([honest[0], forged, record("f2", 300, (0, 1000, H1))], [], SCHEDULE, INITIAL)
    assert view.pace == 100 and [r.peer_id for r in view.records] == ["a"]
    assert view.offences["forged"] == (
        "record ignored: fragment 0 at version 1000 is beyond round 10, the last its step 300 "
        "allows"
    )


# -- vouched states ----------------------------------------------------------------------------


def test_vouched_by_a_strict_majority_of_at_least_two() -> None:
    two_of_three = [vouch("a", 0, 3, H1, ABC), vouch("b", 0, 3, H1, ABC)]
    assert vouched(two_of_three, 0, 3, H1)
    assert vouchers(two_of_three, 0, 3, H1) == {"a", "b"}
    both = [vouch("a", 0, 3, H1, ("a", "b")), vouch("b", 0, 3, H1, ("a", "b"))]
    assert vouched(both, 0, 3, H1)


def test_not_vouched_by_a_minority() -> None:
    one_of_three = [vouch("a", 0, 3, H1, ABC)]
    assert not vouched(one_of_three, 0, 3, H1)
    two_of_four = [vouch(m, 0, 3, H1, ("a", "b", "c", "d")) for m in ("a", "b")]
    assert not vouched(two_of_four, 0, 3, H1)  # a half is no majority


def test_not_vouched_by_a_single_member_round() -> None:
    # min_group_size 1: the member's own word (the creator's vouch comes with the pinned run).
    assert not vouched([vouch("a", 0, 3, H1, ("a",))], 0, 3, H1)


def test_not_vouched_when_vouches_disagree_on_the_member_list() -> None:
    split = [vouch("a", 0, 3, H1, ABC), vouch("b", 0, 3, H1, ("a", "b", "d"))]
    assert not vouched(split, 0, 3, H1)
    # A third member on the first list makes it a majority of that list: the odd list
    # neither counts nor vetoes.
    assert vouched([*split, vouch("c", 0, 3, H1, ABC)], 0, 3, H1)
    assert vouchers([*split, vouch("c", 0, 3, H1, ABC)], 0, 3, H1) == {"a", "c"}


def test_not_vouched_for_another_hash_round_or_fragment() -> None:
    vouches = [vouch(m, 0, 3, H1, ABC) for m in ABC]
    assert not vouched(vouches, 0, 3, H2)
    assert not vouched(vouches, 0, 4, H1)
    assert not vouched(vouches, 1, 3, H1)
    # Disagreeing on the hash: a majority for neither.
    mixed = [vouch("a", 0, 3, H1, ABC), vouch("b", 0, 3, H2, ABC)]
    assert not vouched(mixed, 0, 3, H1) and not vouched(mixed, 0, 3, H2)


def test_vouches_from_outside_the_member_list_do_not_count() -> None:
    outsiders = [vouch(m, 0, 3, H1, ("x", "y", "z")) for m in ("a", "b", "c")]
    assert not vouched(outsiders, 0, 3, H1)
    # Nor can one peer vouch twice: authors are counted once.
    assert not vouched([vouch("a", 0, 3, H1, ABC)] * 3, 0, 3, H1)


def test_vouched_claims_hold_the_initial_state_and_drop_rounds_the_run_never_sends() -> None:
    beyond = [vouch(m, 0, 11, H1, ABC) for m in ABC]  # round 11 would be sent at step 330
    in_run = [vouch(m, 2, 4, H2, ABC) for m in ABC]
    claims = vouched_claims([*beyond, *in_run], SCHEDULE, INITIAL)
    assert claims == {**{(p, 0, H0): frozenset() for p in range(5)}, (2, 4, H2): set(ABC)}


# -- the robust step ---------------------------------------------------------------------------


def test_robust_step_counts_the_members_that_vouched_not_sybils() -> None:
    vouches = [vouch(m, 0, 3, H1, ("a", "b")) for m in ("a", "b")]  # sent at step 90
    honest = [record("a", 95, (0, 3, H1)), record("b", 96, (0, 3, H1))]
    sybils = [record(f"s{i}", 150, (0, 3, H1)) for i in range(10)]  # 90 + 60: plausible
    view = assess([*sybils, *honest], vouches, SCHEDULE, INITIAL)
    assert len(view.records) == 12 and view.step == 95
    assert view.vouched_by(honest[0], 0) and not view.vouched_by(sybils[0], 0)
    assert view.holds_vouched(sybils[0], 0)  # a copied claim is still a vouched state


def test_before_any_vouch_a_joiner_follows_its_anchors_not_sybils() -> None:
    anchor = record("anchor", 10)
    sybils = [record(f"s{i}", 40, (0, 1, H1)) for i in range(5)]  # step 40 allows round 1
    view = assess([anchor, *sybils], [], SCHEDULE, INITIAL, anchors=frozenset({"anchor"}))
    assert view.pace == 10 and view.step == 10
    assert len(view.records) == 6  # 40 is within the pace's slack: plausible, not followed
    # The run's first node (no anchors) has no robust step until a round is vouched.
    alone = assess([anchor, *sybils], [], SCHEDULE, INITIAL)
    assert alone.step is None and alone.pace == 40
    assert assess([], [], SCHEDULE, INITIAL, anchors=frozenset({"anchor"})).step is None


def test_without_vouchers_or_anchor_records_a_joiner_takes_the_median() -> None:
    others = [record("a", 10), record("b", 14), record("c", 12)]
    assert assess(others, [], SCHEDULE, INITIAL, anchors=frozenset({"gone"})).step == 12


def test_offences_are_logged_once_per_peer(caplog: pytest.LogCaptureFixture) -> None:
    offences = Offences()
    with caplog.at_level(logging.WARNING):
        offences.report_all({"p": "global step 301 is beyond the run's end (step 300)"})
        offences.report_all({"p": "something else"})
        offences.report("q", "download refused: a forged state")
    assert caplog.messages == [
        "peer p: global step 301 is beyond the run's end (step 300)",
        "peer q: download refused: a forged state",
    ]


def test_the_runs_creator_vouches_alone() -> None:
    # min_group_size 1: the creator's lone round is vouched by the creator's word only.
    assert vouched([vouch("a", 0, 3, H1, ("a",))], 0, 3, H1, creator="a")
    assert not vouched([vouch("b", 0, 3, H1, ("b",))], 0, 3, H1, creator="a")
    # One of two members: enough when it is the creator, never for the other one.
    assert vouched([vouch("a", 0, 3, H1, ("a", "b"))], 0, 3, H1, creator="a")
    assert not vouched([vouch("b", 0, 3, H1, ("a", "b"))], 0, 3, H1, creator="a")
    # A creator outside the round's members vouches for nothing.
    assert not vouched([vouch("a", 0, 3, H1, ("b", "c"))], 0, 3, H1, creator="a")
