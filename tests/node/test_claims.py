"""What healing may believe: claims bounded by the schedule, vouched states, robust step;
every rule on hand-made records and vouches."""

from __future__ import annotations

import logging

import pytest

from diloco.node.evidence.claims import (
    Evidence,
    Offences,
    Schedule,
    assess,
    creator_missing,
    creator_worked,
    group_target,
    schedule_offence,
    vouched,
    vouched_claims,
    vouchers,
)
from diloco.node.swarm.donors import choose_donors
from diloco.protocol.records.nodes import FragmentVersion, NodeRecord, Vouch

# T 300, H 30, 5 fragments: offsets 0, 6, 12, 18, 24; round k of p is sent at 6p + 30k.
SCHEDULE = Schedule(steps=300, sync_every=30, num_fragments=5)
H0, H1, H2 = "0" * 64, "1" * 64, "2" * 64
INITIAL = [H0] * 5
ABC = ("a", "b", "c")
NOBODY = Evidence("me")
"""A node that has seen nobody work, without anchors or creator: nobody's word counts."""


def worked_with(*workers: str, creator: str | None = None) -> Evidence:
    """The evidence of node "me" that applied rounds with ``workers``."""
    return Evidence("me", frozenset(workers), creator=creator)


def joiner(*anchors: str, creator: str | None = None) -> Evidence:
    """The evidence of node "me" that joined through ``anchors`` and has seen nobody work."""
    return Evidence("me", anchors=frozenset(anchors), creator=creator)


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
    view = assess([*members, near, far], vouches, SCHEDULE, INITIAL, worked_with("a", "b", "far"))
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
    view = assess([alone], vouches, SCHEDULE, INITIAL, worked_with("a", "b"))
    assert view.records == (alone,) and view.step == 200 and not view.offences


def test_without_vouches_the_pace_is_the_median_one_peer_cannot_move() -> None:
    honest = [record("a", 100), record("b", 104), record("c", 98)]
    liar = record("liar", 300)  # the run's last step: within the end, not the pace
    view = assess([*honest, liar], [], SCHEDULE, INITIAL, joiner("a", "b", "liar"))
    # Pace: the anchors' lower median (100, 104, 300 -> 104); step: without the liar (100).
    assert view.pace == 104 and view.step == 100
    assert view.offences["liar"].startswith("step not followed: global step 300 runs ahead")
    # A record that breaks the schedule does not count toward the median either.
    forged = record("forged", 300, (0, 1000, H1))
    two_forged = [honest[0], forged, record("f2", 300, (0, 1000, H1))]
    view = assess(two_forged, [], SCHEDULE, INITIAL, joiner("a", "forged", "f2"))
    assert view.pace == 100 and [r.peer_id for r in view.records] == ["a"]
    assert view.offences["forged"] == (
        "record ignored: fragment 0 at version 1000 is beyond round 10, the last its step 300 "
        "allows"
    )


# -- adoptable states ----------------------------------------------------------------------


def test_vouched_by_a_strict_majority_of_at_least_two_peers_it_worked_with() -> None:
    two_of_three = [vouch("a", 0, 3, H1, ABC), vouch("b", 0, 3, H1, ABC)]
    assert vouched(two_of_three, 0, 3, H1, worked_with(*ABC))
    assert vouchers(two_of_three, 0, 3, H1, worked_with(*ABC)) == {"a", "b"}
    both = [vouch("a", 0, 3, H1, ("a", "b")), vouch("b", 0, 3, H1, ("a", "b"))]
    assert vouched(both, 0, 3, H1, worked_with("a", "b"))
    # This node's own vouch counts with its partners'.
    mine = [vouch("me", 0, 3, H1, ("a", "me")), vouch("a", 0, 3, H1, ("a", "me"))]
    assert vouchers(mine, 0, 3, H1, worked_with("a")) == {"a", "me"}


def test_not_vouched_by_one_peer_or_against_a_majority() -> None:
    assert not vouched([vouch("a", 0, 3, H1, ABC)], 0, 3, H1, worked_with(*ABC))
    # Two for H1 against two for H2: a half is no majority.
    abcd = ("a", "b", "c", "d")
    split = [vouch(m, 0, 3, H1, abcd) for m in "ab"] + [vouch(m, 0, 3, H2, abcd) for m in "cd"]
    assert not vouched(split, 0, 3, H1, worked_with(*"abcd"))
    assert vouched(split[:3], 0, 3, H1, worked_with(*"abcd"))  # d said nothing: 2 of 3
    # Disagreeing on the hash, one each: a majority for neither.
    mixed = [vouch("a", 0, 3, H1, ABC), vouch("b", 0, 3, H2, ABC)]
    assert not vouched(mixed, 0, 3, H1, worked_with(*ABC))
    assert not vouched(mixed, 0, 3, H2, worked_with(*ABC))


def test_not_vouched_by_a_single_member_round() -> None:
    # min_group_size 1: the member's own word (the creator's vouch comes with the pinned run).
    assert not vouched([vouch("a", 0, 3, H1, ("a",))], 0, 3, H1, worked_with("a"))


def test_member_lists_decide_nothing() -> None:
    """The lists are written by the vouchers: two partners agreeing on a hash vouch for it
    whatever lists they sign (they did before, when they signed different lists)."""
    split = [vouch("a", 0, 3, H1, ABC), vouch("b", 0, 3, H1, ("a", "b", "d"))]
    assert vouchers(split, 0, 3, H1, worked_with(*ABC)) == {"a", "b"}
    # A list naming many absentees makes two no minority (it did: 2 of 4).
    many = [vouch(m, 0, 3, H1, ("a", "b", "c", "d")) for m in ("a", "b")]
    assert vouched(many, 0, 3, H1, worked_with("a", "b"))
    # And a list of strangers around one partner makes it no majority.
    strangers = [vouch("a", 0, 3, H1, ("a", "x", "y")), vouch("x", 0, 3, H1, ("a", "x", "y"))]
    assert not vouched(strangers, 0, 3, H1, worked_with("a"))


def test_an_author_vouching_for_two_hashes_counts_for_neither() -> None:
    vouches = [
        vouch("a", 0, 3, H1, ABC),
        vouch("a", 0, 3, H2, ABC),
        vouch("b", 0, 3, H2, ABC),
        vouch("c", 0, 3, H2, ABC),
    ]
    assert vouchers(vouches, 0, 3, H2, worked_with(*ABC)) == {"b", "c"}
    assert not vouched(vouches, 0, 3, H1, worked_with(*ABC))


def test_not_vouched_for_another_hash_round_or_fragment() -> None:
    vouches = [vouch(m, 0, 3, H1, ABC) for m in ABC]
    assert not vouched(vouches, 0, 3, H2, worked_with(*ABC))
    assert not vouched(vouches, 0, 4, H1, worked_with(*ABC))
    assert not vouched(vouches, 1, 3, H1, worked_with(*ABC))


def test_vouches_from_outside_their_own_list_or_from_strangers_do_not_count() -> None:
    outsiders = [vouch(m, 0, 3, H1, ("x", "y", "z")) for m in ("a", "b", "c")]
    assert not vouched(outsiders, 0, 3, H1, worked_with(*ABC))  # malformed: author not listed
    # Nor can one peer vouch twice: authors are counted once.
    assert not vouched([vouch("a", 0, 3, H1, ABC)] * 3, 0, 3, H1, worked_with(*ABC))
    # A whole round of peers this node never worked with vouches for nothing.
    assert not vouched([vouch(m, 0, 3, H1, ABC) for m in ABC], 0, 3, H1, worked_with("d", "e"))
    assert not vouched([vouch(m, 0, 3, H1, ABC) for m in ABC], 0, 3, H1, NOBODY)


def test_a_joiner_counts_its_anchors_until_it_has_worked_with_someone() -> None:
    round_of_ab = [vouch(m, 0, 3, H1, ("a", "b")) for m in ("a", "b")]
    assert vouchers(round_of_ab, 0, 3, H1, joiner("a")) == {"a"}  # its anchor's word
    assert not vouched(round_of_ab, 0, 3, H1, joiner("z"))  # strangers to it
    # Two anchors disagreeing: neither hash.
    torn = [vouch("a", 0, 3, H1, ("a", "b")), vouch("b", 0, 3, H2, ("a", "b"))]
    assert not vouched(torn, 0, 3, H1, joiner("a", "b"))
    # Once it has worked with someone, the anchors count only as workers would.
    assert not vouched(round_of_ab[:1], 0, 3, H1, Evidence("me", frozenset("c"), frozenset("a")))


def test_vouched_claims_hold_the_initial_state_and_drop_rounds_the_run_never_sends() -> None:
    beyond = [vouch(m, 0, 11, H1, ABC) for m in ABC]  # round 11 would be sent at step 330
    in_run = [vouch(m, 2, 4, H2, ABC) for m in ABC]
    claims = vouched_claims([*beyond, *in_run], SCHEDULE, INITIAL, worked_with(*ABC))
    assert claims == {**{(p, 0, H0): frozenset() for p in range(5)}, (2, 4, H2): set(ABC)}


def test_the_runs_creator_vouches_alone() -> None:
    # min_group_size 1: the creator's lone round is adoptable on the creator's word only.
    assert vouched([vouch("a", 0, 3, H1, ("a",))], 0, 3, H1, joiner(creator="a"))
    assert vouched([vouch("a", 0, 3, H1, ("a",))], 0, 3, H1, worked_with("b", creator="a"))
    assert not vouched([vouch("b", 0, 3, H1, ("b",))], 0, 3, H1, worked_with("b", creator="a"))
    # One of two members: enough when it is the creator, never for the other one.
    assert vouched([vouch("a", 0, 3, H1, ("a", "b"))], 0, 3, H1, worked_with("b", creator="a"))
    assert not vouched([vouch("b", 0, 3, H1, ("a", "b"))], 0, 3, H1, worked_with("b", creator="a"))
    # A creator outside its own list vouches for nothing (a malformed vouch).
    assert not vouched([vouch("a", 0, 3, H1, ("b", "c"))], 0, 3, H1, joiner(creator="a"))


# -- the robust step ---------------------------------------------------------------------------


def test_robust_step_counts_the_peers_it_worked_with_not_sybils() -> None:
    vouches = [vouch(m, 0, 3, H1, ("a", "b")) for m in ("a", "b")]  # sent at step 90
    honest = [record("a", 95, (0, 3, H1)), record("b", 96, (0, 3, H1))]
    sybils = [record(f"s{i}", 150, (0, 3, H1)) for i in range(10)]  # 90 + 60: plausible
    view = assess([*sybils, *honest], vouches, SCHEDULE, INITIAL, worked_with("a", "b"))
    assert len(view.records) == 12 and view.step == 95
    assert view.vouched_by(honest[0], 0) and not view.vouched_by(sybils[0], 0)
    assert view.holds_vouched(sybils[0], 0)  # a copied claim is still an adoptable state


def test_the_creators_record_sets_the_step_with_the_workers() -> None:
    records = [record("a", 95), record("creator", 99), record("s", 150)]
    view = assess(records, [], SCHEDULE, INITIAL, worked_with("a", creator="creator"))
    assert view.step == 95 and view.pace == 95
    assert assess(records[1:], [], SCHEDULE, INITIAL, joiner(creator="creator")).step == 99


def test_before_any_round_a_joiner_follows_its_anchors_not_sybils() -> None:
    anchor = record("anchor", 10)
    sybils = [record(f"s{i}", 40, (0, 1, H1)) for i in range(5)]  # step 40 allows round 1
    view = assess([anchor, *sybils], [], SCHEDULE, INITIAL, joiner("anchor"))
    assert view.pace == 10 and view.step == 10
    assert len(view.records) == 6  # 40 is within the pace's slack: plausible, not followed
    # The run's first node (nobody to follow) has no robust step, nor any pace: Sybils set
    # neither (they set its pace before, 40 here).
    alone = assess([anchor, *sybils], [], SCHEDULE, INITIAL, NOBODY)
    assert alone.step is None and alone.pace is None
    assert assess([], [], SCHEDULE, INITIAL, joiner("anchor")).step is None


def test_a_joiner_whose_anchors_left_follows_nobody() -> None:
    # Before, it took the median of whoever published a record: Sybils chose its step.
    others = [record("a", 10), record("b", 14), record("c", 12)]
    assert assess(others, [], SCHEDULE, INITIAL, joiner("gone")).step is None


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


def test_refused_vouches_are_named_but_agreeing_ones_are_not() -> None:
    vouches = [
        *[vouch(m, 0, 3, H1, ("a", "b", "new")) for m in ("a", "b", "new")],
        *[vouch(s, 0, 4, H2, ("s1", "s2")) for s in ("s1", "s2")],
    ]
    view = assess([], vouches, SCHEDULE, INITIAL, worked_with("a", "b"))
    assert set(view.uncounted) == {"s1", "s2"}  # "new" agrees with a and b: no refusal
    assert view.uncounted["s1"] == (
        "fragment 0 round 4 hash 2222222222222222... is not adoptable on the word of peers "
        "this node has not seen work"
    )


# -- paper identities --------------------------------------------------------------------------

Z = "f" * 64
"""The hash the paper keys vouch for (the all-zero state's, in the swarm test)."""


def paper_attack(honest: list[str], papers: list[str]) -> tuple[list[NodeRecord], list[Vouch]]:
    """The swarm as one process holding ``papers`` keys makes it look: the honest nodes all
    at step 100 with round 3 of fragment 0 (sent at 90) at H1, each vouching for it; the
    paper keys vouch for Z at rounds 3 and 4 under member lists of every kind (their own,
    theirs and the honest nodes', each alone), and claim steps far ahead (150: within the
    pace's slack; 300: the run's end) holding Z."""
    records = [record(h, 100, (0, 3, H1)) for h in honest]
    vouches = [vouch(h, 0, 3, H1, tuple(sorted(honest))) for h in honest]
    lists = [tuple(sorted(papers)), tuple(sorted([*papers, *honest]))]
    for i, s in enumerate(papers):
        step = 150 if i % 2 else 300
        records.append(record(s, step, (0, SCHEDULE.last_round(step, 0), Z)))
        for members in [*lists, (s,)]:
            vouches += [vouch(s, 0, 3, Z, members), vouch(s, 0, 4, Z, members)]
            vouches.append(vouch(s, 0, SCHEDULE.last_round(step, 0), Z, members))
    return records, vouches


@pytest.mark.parametrize("k", range(1, 9))
def test_paper_keys_neither_make_a_state_adoptable_nor_move_the_step(k: int) -> None:
    """1 to 8 keys that never worked in a round, against 2 to 20 honest nodes, seen by every
    honest node (it worked with the others; the run's creator is h0), by a joiner (anchor
    h0) and by one that missed round 3: nothing of Z is adoptable, the robust step stays at
    the honest nodes' 100, and the honest state stays adoptable and is what is healed to.
    With the rule before (a majority of a vouch's own member list; the step of whoever
    vouched for a vouched round) two keys made Z adoptable and moved the step."""
    papers = [f"s{i}" for i in range(k)]
    for n in range(2, 21):
        honest = [f"h{i}" for i in range(n)]
        records, vouches = paper_attack(honest, papers)
        views = [
            Evidence(h, frozenset(honest) - {h}, frozenset({"h0"}), creator="h0") for h in honest
        ]
        views.append(joiner("h0", creator="h0"))
        views.append(Evidence("late", frozenset(honest), creator="h0"))  # it missed round 3
        for evidence in views:
            others = [r for r in records if r.peer_id != evidence.me]
            view = assess(others, vouches, SCHEDULE, INITIAL, evidence)
            assert not [c for c in view.vouched if c[2] == Z], (n, k, evidence)
            assert view.step == 100, (n, k, evidence)
            assert (0, 3, H1) in view.vouched
            assert set(view.uncounted) == set(papers)
            mine = (3, H1) if evidence.me in honest else (2, H2)
            donors = choose_donors(view, 0, *mine)
            assert {r.peer_id for r in donors} == (set() if mine[1] == H1 else set(honest))


@pytest.mark.parametrize("k", range(1, 9))
def test_paper_keys_do_not_raise_the_group_a_round_waits_for(k: int) -> None:
    """1 to 8 paper keys' records beside 2 to 8 honest nodes' (each honest node read every
    record, its own included): an honest node that worked with the others waits for the
    honest nodes alone, a joiner for itself and its anchor, never for a paper key. Counting
    every record (the rule before) made each wait for n + k declarations, so every round
    it led waited out its whole window for members who never come."""
    papers = [f"s{i}" for i in range(k)]
    for n in range(2, 9):
        honest = [f"h{i}" for i in range(n)]
        records, _ = paper_attack(honest, papers)
        assert len(records) == n + k
        for h in honest:
            evidence = Evidence(h, frozenset(honest) - {h}, frozenset({"h0"}), creator="h0")
            assert group_target(records, evidence, 2) == n, (n, k, h)
        assert group_target(records, joiner("h0", creator="h0"), 2) == 2, (n, k)
        # the floor: a node that worked with nobody, the creator's record not read yet
        assert group_target(papers_only(papers), NOBODY, 3) == 3


def papers_only(papers: list[str]) -> list[NodeRecord]:
    return [record(s, 300, (0, 10, Z)) for s in papers]


def test_a_round_without_the_creator_is_refused_until_it_has_worked_with_others() -> None:
    members = ("j1", "j2")
    why = creator_missing(members, "j1", "boss", live=True, worked=False)
    assert why is not None and "creator" in why
    assert creator_missing((*members, "boss"), "j1", "boss", live=True, worked=False) is None
    assert creator_missing(members, "j1", "boss", live=True, worked=True) is None
    assert creator_missing(members, "j1", "boss", live=False, worked=False) is None  # it left
    assert creator_missing(members, "boss", "boss", live=True, worked=False) is None
    assert creator_missing(members, "j1", None, live=True, worked=False) is None


def test_the_creator_has_worked_once_it_vouches_for_a_round_with_others() -> None:
    alone = vouch("boss", 0, 1, H1, ("boss",))
    shared = vouch("boss", 0, 2, H1, ("boss", "j1"))
    named = vouch("j1", 0, 2, H1, ("boss", "j1"))  # another author naming it decides nothing
    assert not creator_worked([alone, named], "boss")
    assert creator_worked([alone, shared], "boss")
    assert not creator_worked([shared], None)


def test_the_creator_waits_for_every_live_record_until_it_has_worked_with_others() -> None:
    """Before its first round with others the creator has nobody to count but newcomers: it
    waits for every live record's author (paper keys included, which can stretch those
    rounds to the window); once it has worked with peers, for them alone."""
    records = [record(p, 10, (0, 0, H1)) for p in ("j1", "j2", "j3", "s1")]
    assert group_target(records, Evidence("boss", creator="boss"), 2) == 5
    worked = Evidence("boss", frozenset({"j1", "j2"}), creator="boss")
    assert group_target(records, worked, 2) == 3
    assert group_target(records, Evidence("j1", creator="boss"), 2) == 2  # not the creator
