"""The schedule DAG: exact hand-computed schedules, vectorisation, validation."""

from __future__ import annotations

import numpy as np
import pytest

from diloco.sim.dag import Interval, StepCompute, SyncPlan, compute_utilisation, simulate

# Two layers, every compute node 1 s: one step is F0 F1 Ba1 Bw1 Bw0 = 5 s (layer 0 has no
# activation-backward). Each reduction puts 2e9 bits on a 1 Gbit/s link: 2 s.
TWO_LAYERS = StepCompute(
    forward_seconds=(1.0, 1.0),
    backward_activation_seconds=(0.0, 1.0),
    backward_weight_seconds=(1.0, 1.0),
)


def _plan(sync_every: int, tau: int = 0) -> SyncPlan:
    return SyncPlan(fragments=((0, 1),), sync_every=sync_every, tau=tau, wire_bits=(2e9, 2e9))


def test_simulate_two_layers_two_steps_data_parallel_matches_hand_schedule() -> None:
    schedule = simulate(TWO_LAYERS, _plan(sync_every=1), 1.0, 2, record=True)
    assert list(schedule.intervals) == [
        Interval("forward", 0, 1, 0.0, 1.0),
        Interval("forward", 1, 1, 1.0, 2.0),
        Interval("backward_activation", 1, 1, 2.0, 3.0),
        Interval("backward_weight", 1, 1, 3.0, 4.0),
        Interval("backward_weight", 0, 1, 4.0, 5.0),
        # layer 1's gradient is ready first; layer 0's queues behind it on the one link
        Interval("reduction", 1, 1, 4.0, 6.0),
        Interval("reduction", 0, 1, 6.0, 8.0),
        # step 2's forward of layer 0 waits for its reduction (8 s), layer 1's was done at 6
        Interval("forward", 0, 2, 8.0, 9.0),
        Interval("forward", 1, 2, 9.0, 10.0),
        Interval("backward_activation", 1, 2, 10.0, 11.0),
        Interval("backward_weight", 1, 2, 11.0, 12.0),
        Interval("backward_weight", 0, 2, 12.0, 13.0),
        Interval("reduction", 1, 2, 12.0, 14.0),
        Interval("reduction", 0, 2, 14.0, 16.0),
    ]
    assert schedule.step_starts[:, 0].tolist() == [0.0, 8.0]
    assert schedule.end.tolist() == [16.0]


def test_simulate_two_layers_overlap_waits_only_at_receive_step() -> None:
    # H = 2, tau = 1: the round sent at the end of step 2 is needed by step 4's forward.
    schedule = simulate(TWO_LAYERS, _plan(sync_every=2, tau=1), 0.5, 4, record=True)
    reductions = [i for i in schedule.intervals if i.kind == "reduction" and i.step == 2]
    # ready at 9 (layer 1) and 10 (layer 0); 4 s each at 0.5 Gbit/s
    assert reductions == [
        Interval("reduction", 1, 2, 9.0, 13.0),
        Interval("reduction", 0, 2, 13.0, 17.0),
    ]
    # step 3 starts on time at 10; step 4 waits for layer 0 until 17, layer 1 is ready
    assert schedule.step_starts[:, 0].tolist() == [0.0, 5.0, 10.0, 17.0]
    forward_1_step_4 = next(
        i for i in schedule.intervals if i.kind == "forward" and i.step == 4 and i.layer == 1
    )
    assert (forward_1_step_4.start, forward_1_step_4.end) == (18.0, 19.0)


def test_simulate_two_layers_diloco_blocks_every_h_steps_by_hand() -> None:
    # H = 2, tau = 0 at 1 Gbit/s: step 2 (5..10 s) sends; R1 runs 9..11, R0 11..13, and
    # step 3's forward of layer 0 waits for R0. Two steps (10 s compute) every 13 s.
    schedule = simulate(TWO_LAYERS, _plan(sync_every=2), 1.0, 5, record=True)
    assert schedule.step_starts[:, 0].tolist() == [0.0, 5.0, 13.0, 18.0, 26.0]
    assert [i for i in schedule.intervals if i.kind == "reduction"] == [
        Interval("reduction", 1, 2, 9.0, 11.0),
        Interval("reduction", 0, 2, 11.0, 13.0),
        Interval("reduction", 1, 4, 22.0, 24.0),
        Interval("reduction", 0, 4, 24.0, 26.0),
    ]
    cu = compute_utilisation(TWO_LAYERS, _plan(sync_every=2), [1.0], warmup_periods=1, periods=3)
    assert cu.tolist() == [pytest.approx(10.0 / 13.0)]


def test_simulate_pre_seconds_wait_off_the_link_then_queue() -> None:
    # As above, but layer 1 waits 1.5 s and layer 0 0.5 s before the link: R1 runs
    # 10.5..12.5; R0 could start at 10.5 too (its wait overlapped R1's) but queues until 12.5.
    plan = SyncPlan(
        fragments=((0, 1),), sync_every=2, tau=0, wire_bits=(2e9, 2e9), pre_seconds=(0.5, 1.5)
    )
    schedule = simulate(TWO_LAYERS, plan, 1.0, 3, record=True)
    assert [(i.layer, i.start, i.end) for i in schedule.intervals if i.kind == "reduction"] == [
        (1, 10.5, 12.5),
        (0, 12.5, 14.5),
    ]
    assert schedule.step_starts[:, 0].tolist() == [0.0, 5.0, 14.5]


def test_simulate_counts_4l_minus_1_nodes_per_step() -> None:
    num_layers = 5
    compute = StepCompute(
        forward_seconds=(1.0,) * num_layers,
        backward_activation_seconds=(0.0,) + (1.0,) * (num_layers - 1),
        backward_weight_seconds=(1.0,) * num_layers,
    )
    plan = SyncPlan(
        fragments=(tuple(range(num_layers)),), sync_every=1, tau=0, wire_bits=(1e9,) * num_layers
    )
    intervals = simulate(compute, plan, 10.0, 3, record=True).intervals
    for step in (1, 2, 3):
        assert sum(i.step == step for i in intervals) == 4 * num_layers - 1


def test_simulate_vector_of_bandwidths_equals_one_at_a_time() -> None:
    bandwidths = np.array([0.1, 0.7, 3.0, 50.0])
    plan = _plan(sync_every=2, tau=1)
    together = simulate(TWO_LAYERS, plan, bandwidths, 9)
    for column, bandwidth in enumerate(bandwidths):
        alone = simulate(TWO_LAYERS, plan, bandwidth, 9)
        np.testing.assert_array_equal(together.step_starts[:, column], alone.step_starts[:, 0])
        assert together.end[column] == alone.end[0]


def test_compute_utilisation_equals_window_of_hand_schedule() -> None:
    # Data-parallel at 1 Gbit/s is periodic from step 1: each step starts 8 s after the last.
    cu = compute_utilisation(TWO_LAYERS, _plan(sync_every=1), [1.0], warmup_periods=1, periods=3)
    assert cu.tolist() == [5.0 / 8.0]


def test_simulate_record_with_several_bandwidths_is_refused() -> None:
    with pytest.raises(ValueError, match="one bandwidth"):
        simulate(TWO_LAYERS, _plan(sync_every=1), [1.0, 2.0], 2, record=True)


@pytest.mark.parametrize("bandwidth", [0.0, -1.0, [[1.0]]])
def test_simulate_bad_bandwidth_is_refused(bandwidth: object) -> None:
    with pytest.raises(ValueError, match="positive"):
        simulate(TWO_LAYERS, _plan(sync_every=1), bandwidth, 2)  # type: ignore[arg-type]


def test_sync_plan_uncovered_layer_is_refused() -> None:
    with pytest.raises(ValueError, match="exactly once"):
        SyncPlan(fragments=((0,),), sync_every=1, tau=0, wire_bits=(1.0, 1.0))


def test_sync_plan_tau_not_below_h_is_refused() -> None:
    with pytest.raises(ValueError, match="tau < H"):
        SyncPlan(fragments=((0, 1),), sync_every=2, tau=2, wire_bits=(1.0, 1.0))


def test_step_compute_activation_backward_of_layer_0_is_refused() -> None:
    with pytest.raises(ValueError, match="layer 0"):
        StepCompute(
            forward_seconds=(1.0, 1.0),
            backward_activation_seconds=(1.0, 1.0),
            backward_weight_seconds=(1.0, 1.0),
        )
