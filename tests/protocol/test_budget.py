"""``RoundBudget``: every deadline of a round from its timeouts, the round trip and recent
transfers. Expected values are worked out by hand from ``RoundTimeouts()``'s defaults
(window 2, join 2, sender 10, reducer 10, report 3, verify 5, connect 5 seconds)."""

from __future__ import annotations

from diloco.protocol.core.budget import Deadlines, RoundBudget, StreamBounds
from diloco.protocol.core.group import RoundTimeouts

RUN = RoundTimeouts()


def test_a_flat_round_ends_after_matchmaking_an_all_reduce_its_checks_and_a_second() -> None:
    # matchmaking 2 + 3 * 2 = 8; all-reduce 10 + 10 + 10 + 3 = 33; checks 2 * 5 = 10; slack 1
    assert RoundBudget.of(RUN).round_end(100.0, matched=103.0) == 152.0


def test_a_round_holds_a_followers_wait_for_a_leader_on_the_widest_window() -> None:
    budget = RoundBudget.of(RUN)
    # before its group is known: the widest matchmaking, 4 x 2 + 3 * 4 x 2 = 32, then 44
    assert budget.round_end(100.0) == 100.0 + 32.0 + 44.0
    # a group known after its own matchmaking bound (8): the all-reduce counts from then
    assert budget.round_end(100.0, matched=120.0) == 120.0 + 44.0


def test_the_round_trip_stretches_matchmaking_and_so_the_round_not_the_all_reduce() -> None:
    budget = RoundBudget.of(RUN, rtt=0.5)  # window and join: 8 x 0.5 = 4 s each
    assert budget.matching.matchmaking == 4.0 + 3 * 4.0
    assert budget.round_end(0.0, matched=3.0) == 16.0 + 33.0 + 10.0 + 1.0
    assert budget.running == RUN
    assert budget.deadlines(0.0) == RoundBudget.of(RUN).deadlines(0.0)


def test_a_staged_round_has_five_stage_lengths_per_stage_on_the_adapted_timeouts() -> None:
    # three transfers of 1 s, factor 2, margin 0.5: sender, reducer and connect 2.5 s
    budget = RoundBudget.of(RUN).adapted([1.0, 1.0, 1.0], factor=2.0, floor=0.5)
    assert budget.stage_length == 2.5 + 2.5 + 2.5 + 3.0 + 10.0
    assert budget.stage_wait(1) == 8.0 + 20.5
    assert budget.round_end(0.0, matched=1.0) == 52.0  # the flat bound is the run's
    assert budget.round_end(0.0, stages=2, matched=1.0) == 52.0 + (5 * 2 - 1) * 20.5
    assert budget.deadlines(0.0) == Deadlines(2.5, 5.0, 7.5, 10.5, 15.5, 20.5, 28.5)


def test_the_routers_streams_and_answers_keep_to_the_runs_timeouts() -> None:
    budget = RoundBudget.of(RUN, rtt=0.5).adapted([1.0] * 3, factor=2.0, floor=0.5)
    # the first frame (5) and a matchmaking (8) before each stream's phase; a PART stream's
    # goes on to the checks asked on it (10 + 10 + 10 + 3, then 5)
    assert budget.streams() == StreamBounds(part=51.0, report=18.0, check=56.0, reply=5.0)
    assert budget.group_wait == 8.0
    checks_due = RoundBudget.of(RUN).deadlines(0.0).check  # 10 + 10 + 10 + 3 + 5
    assert budget.answering_until(RoundBudget.of(RUN).deadlines(0.0)) == checks_due + 8.0 == 46.0


def test_a_join_stream_is_bounded_for_the_widest_window_the_round_trip_may_set() -> None:
    # window and join stretched four times (8 s each): matchmaking 8 + 3 * 8, one join more
    assert RoundBudget.of(RUN).join_stream() == 8.0 + 3 * 8.0 + 8.0
