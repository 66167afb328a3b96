"""Pure tests of ``diloco.node.training.pace``: expected values are computed by hand."""

from __future__ import annotations

import pytest

from diloco.node.training.pace import (
    RECENT_STEPS,
    SETTLE_STEPS,
    PaceController,
    next_share,
    swarm_pace,
    target_rows,
)


def test_swarm_pace_is_the_upper_median() -> None:
    assert swarm_pace([3.0, 1.0, 1.2]) == 1.2
    assert swarm_pace([3.0, 1.0]) == 3.0  # even count: the slower of the two middle ones
    assert swarm_pace([0.5, 2.0, 1.0, 4.0]) == 2.0
    assert swarm_pace([2.0]) == 2.0
    assert swarm_pace([]) is None


def test_swarm_pace_liars_up_to_half_stay_between_honest_figures() -> None:
    honest = [1.0, 1.1, 3.0]
    assert swarm_pace([*honest, 1e-9]) == 1.1  # one "infinitely fast" of four
    assert swarm_pace([*honest, 1e-9, 1e-9]) == 1.0  # two of five
    assert swarm_pace([*honest, 1e-9, 1e-9, 1e-9]) == 1.0  # three of six: half
    assert swarm_pace([*honest, 1e9, 1e9]) == 3.0
    assert swarm_pace([1.0, 1e-9]) == 1.0  # a pair: the liar does not set it


def test_target_rows_scales_and_clamps() -> None:
    assert target_rows(8, 1.0, 3.0) == 2  # floor(8 / 3)
    assert target_rows(8, 1.0, 1.0) == 8
    assert target_rows(8, 2.0, 1.0) == 8  # never above the full batch
    assert target_rows(8, 1.0, 100.0) == 1  # never below min_rows
    assert target_rows(8, 1.0, 100.0, min_rows=2) == 2
    assert target_rows(16, 1.0, 3.0) == 5  # floor(5.33)


def test_next_share_keeps_the_share_inside_the_tolerance_band() -> None:
    assert next_share(4.0, 1.04, 1.0, 8) == 4.0
    assert next_share(4.0, 0.96, 1.0, 8) == 4.0
    assert next_share(4.0, 1.6, 1.0, 8) == 2.5  # 4 / 1.6, not rounded
    assert next_share(2.0, 0.5, 1.0, 8) == 4.0  # 2 / 0.5
    assert next_share(6.0, 0.5, 1.0, 8) == 8.0  # 12 clamped to the batch
    assert next_share(2.0, 0.8, 1.0, 8) == 2.5  # 2 / 0.8: whole rows kept 2, early
    assert next_share(8.0, 1.25, 1.0, 8) == 6.4  # 8 / 1.25; whole rows gave 6, then 7
    assert next_share(1.5, 4.0, 1.0, 8) == 1.0  # never below min_rows
    assert next_share(4.0, 4.0, 1.0, 8, min_rows=2) == 2.0


def test_controller_alternates_whole_rows_to_train_a_fractional_share() -> None:
    """A node 25% slower than the pace per row trains 6.4 rows a step on average: steps of 6
    and 7 rows, 64 rows in any 10 steps give or take one, where whole rows gave 6."""
    controller = PaceController(batch_size=8)
    rows = [_settle(controller, 1.25, 1.0)]  # 1.25 s at 8 rows
    assert controller.share == 6.4
    for _ in range(40):
        rows.append(controller.observe(1.25 * controller.rows / 8, [1.0, 1.0]))
    assert controller.share == 6.4  # each step takes rows x 1.25 / 8: on pace at 6.4
    assert set(rows[1:]) == {6, 7}
    for k in range(1, 31):
        assert abs(sum(rows[k : k + 10]) - 64) <= 1, rows


def test_controller_cut_by_a_few_slow_steps_comes_back_to_the_pace() -> None:
    """A node 4% slower than the pace at its full batch (inside the band: it keeps it), cut
    by three slow steps (its rounds' work on a shared CPU), comes back to the share of the
    pace, 8 / 1.04 rows: whole rows floored left it a row short, early, at every round (the
    run's creator at 3 nodes and 200 ms)."""
    assert next_share(8.0, 1.04, 1.0, 8) == 8.0
    controller = PaceController(batch_size=8)
    assert _settle(controller, 1.3, 1.0) == 6  # share 8 / 1.3 = 6.15
    for _ in range(3 * SETTLE_STEPS):
        controller.observe(1.04 * controller.rows / 8, [1.0, 1.0])
    assert controller.share == pytest.approx(8 / 1.04)


def _settle(controller: PaceController, seconds: float, pace: float | None) -> int:
    """``SETTLE_STEPS`` steps of ``seconds`` in a swarm whose two other nodes take ``pace``
    seconds per full batch (so the median is ``pace`` whenever this node is slower)."""
    rows = controller.rows
    for _ in range(SETTLE_STEPS):
        rows = controller.observe(seconds, None if pace is None else [pace, pace])
    return rows


def test_controller_fast_node_keeps_its_full_batch() -> None:
    controller = PaceController(batch_size=8)
    assert _settle(controller, 1.0, 1.0) == 8
    assert controller.full_seconds == 1.0
    assert controller.slower_than_pace(1.0) is None


def test_controller_without_pace_trains_the_full_batch() -> None:
    controller = PaceController(batch_size=8)
    assert _settle(controller, 3.0, None) == 8
    assert controller.pace is None


def test_controller_alone_or_at_the_median_keeps_its_batch_through_jitter() -> None:
    alone, median = PaceController(batch_size=8), PaceController(batch_size=8)
    for seconds in (1.0, 1.0, 1.0, 3.0, 3.0, 0.5, 3.0):
        assert alone.observe(seconds, []) == 8
        assert median.observe(seconds, [0.1, 100.0]) == 8  # its own figure is the median
    assert alone.pace == alone.full_seconds


def test_controller_converges_with_a_fixed_cost_per_step() -> None:
    # Step seconds = 0.2 + 0.1 * rows: 1.0 at 8 rows; pace 0.5, which 3 rows meet.
    controller = PaceController(batch_size=8)
    seconds = []
    for step in range(40):
        seconds.append(0.2 + 0.1 * controller.rows)
        controller.observe(seconds[-1], [0.5, 0.5])
        if step == SETTLE_STEPS - 1:
            assert controller.share == 4.0  # 8 x 0.5 / 1.0, as if the cost were all per row
    # The fixed cost makes 4 rows 0.6 s, not 0.5: the share moves on down to 3 rows.
    assert controller.share == pytest.approx(3.0)
    assert seconds[-10:] == pytest.approx([0.5] * 10)
    assert controller.full_seconds == pytest.approx(0.5 / 3 * 8)  # 0.5 s at 3 rows, scaled


def test_controller_goes_by_the_seconds_per_row_of_its_window_across_a_change() -> None:
    controller = PaceController(batch_size=8)
    _settle(controller, 3.0, 1.0)
    assert (controller.share, controller.rows) == (pytest.approx(8 / 3), 2)
    assert controller.full_seconds == 3.0  # 0.375 s a row
    controller.observe(1.2, [1.0, 1.0])  # 0.6 s a row at 2 rows: one step of four
    assert controller.full_seconds == 3.0
    for _ in range(3):
        controller.observe(0.6 * controller.rows, [1.0, 1.0])
    assert controller.full_seconds == pytest.approx(4.8)  # 0.6 s a row, times 8: a majority


def test_controller_waits_for_settle_steps_before_changing() -> None:
    controller = PaceController(batch_size=8)
    for _ in range(SETTLE_STEPS - 1):
        assert controller.observe(3.0, [1.0, 1.0]) == 8
    assert controller.observe(3.0, [1.0, 1.0]) == 2
    assert controller.pace == 1.0


def test_controller_grows_back_when_the_pace_slows() -> None:
    controller = PaceController(batch_size=8)
    _settle(controller, 3.0, 1.0)
    assert controller.rows == 2
    # 0.75 s at 2, 3, 3 rows: the median 0.25 s a row, 0.67 s at the share 8 / 3 against the
    # pace 3.0 (the upper median of 3.0, 3.0 and its own 2.0): 12 rows, clamped to 8.
    assert _settle(controller, 0.75, 3.0) == 8


def test_controller_median_of_recent_seconds() -> None:
    controller = PaceController(batch_size=4)
    controller.observe(1.0, None)
    controller.observe(2.0, None)
    assert controller.seconds == pytest.approx(1.5)
    for seconds in (1.0, 1.0, 1.0, 1.0):
        controller.observe(seconds, None)
    assert controller.seconds == 1.0  # 2.0 is one of them, not the median
    for _ in range(RECENT_STEPS - 1):
        controller.observe(3.0, None)
    assert controller.seconds == 3.0  # the window holds one 1.0 step
    controller.observe(3.0, None)
    assert controller.recent == [0.75] * RECENT_STEPS  # 3.0 s / 4 rows


def test_a_few_quick_steps_leave_the_published_figure_alone() -> None:
    """Five quick steps (the node had the shared cores to itself while its peers waited in a
    round) after twenty at 1.0 s: the full-batch figure it publishes stays 1.0 s. Over the
    last 5 steps it fell to 0.6, and the peers that took it for the pace cut their rows."""
    controller = PaceController(batch_size=8)
    for seconds in [1.0] * 20 + [0.6] * 5:
        controller.observe(seconds, None)
    assert controller.full_seconds == 1.0


def test_controller_one_slow_step_in_three_cuts_no_rows() -> None:
    """A node 4% slower than the pace (inside the band) with one step in three at 1.5x (its
    rounds' work on the cores it shares) keeps its full batch: a moving average weighting
    the newest step 0.3 went over the band at each slow step and cut a row."""
    controller = PaceController(batch_size=8)
    rows = [controller.observe(s, [1.0, 1.0]) for s in [1.04, 1.04, 1.56] * 6]
    assert rows == [8] * 18


def test_controller_warns_only_at_its_fewest_rows_and_far_slower() -> None:
    controller = PaceController(batch_size=2)
    _settle(controller, 10.0, 1.0)
    assert controller.rows == 1
    assert controller.slower_than_pace(1.0) == pytest.approx(5.0)  # 5 s a row, 1 row
    assert controller.slower_than_pace(4.0) is None  # 1.25 times: under WARN_RATIO
    at_two = PaceController(batch_size=2)
    _settle(at_two, 1.5, 1.0)  # 1.5 times the pace: a share of 1.33, above its fewest
    assert at_two.share == pytest.approx(4 / 3) and at_two.slower_than_pace(1.0) is None


def test_controller_rejects_min_rows_above_the_batch() -> None:
    with pytest.raises(ValueError, match="min_rows"):
        PaceController(batch_size=2, min_rows=3)
