"""The five methods on the paper's presets: the invariants of docs/design.md "The simulator" and the
issue."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from diloco.sim.dag import compute_utilisation
from diloco.sim.methods import (
    METHODS,
    PRESETS,
    ModelSpec,
    SyncSettings,
    step_compute,
    sync_plan,
)
from diloco.sim.sweep import bandwidth_grid, cu_curves

GRID = bandwidth_grid(1e-3, 1e5, points_per_decade=12)


@pytest.fixture(scope="module", params=sorted(PRESETS))
def preset_curves(request: pytest.FixtureRequest) -> dict[str, np.ndarray]:
    return cu_curves(PRESETS[request.param], METHODS, SyncSettings(), GRID)


def test_cu_rises_with_bandwidth_and_tends_to_one(preset_curves: dict[str, np.ndarray]) -> None:
    for method, cu in preset_curves.items():
        assert np.all(np.diff(cu) >= 0), method
        assert cu[-1] > 0.999, method
        assert cu[0] < 0.5, method


def test_cu_orders_methods_at_equal_bandwidth(preset_curves: dict[str, np.ndarray]) -> None:
    ladder = ["diloco", "streaming", "streaming-overlap", "streaming-overlap-fp4"]
    for worse, better in itertools.pairwise(ladder):
        assert np.all(preset_curves[better] >= preset_curves[worse] - 1e-12), better
        # strictly better somewhere, or the two methods would not differ at all
        assert np.any(preset_curves[better] > preset_curves[worse] + 1e-3), better


@pytest.mark.parametrize("sync_every", [1, 7, 30])
def test_streaming_one_fragment_tau_0_equals_diloco(sync_every: int) -> None:
    model = ModelSpec(name="t", num_layers=6, num_params=6e8, step_seconds=0.5)
    settings = SyncSettings(sync_every=sync_every, fragment_size=6, tau=0)
    compute = step_compute(model)
    streaming = compute_utilisation(compute, sync_plan(model, "streaming", settings), GRID)
    diloco = compute_utilisation(compute, sync_plan(model, "diloco", settings), GRID)
    np.testing.assert_array_equal(streaming, diloco)


def test_step_compute_sums_to_step_time_with_backward_twice_forward() -> None:
    model = PRESETS["10B"]
    compute = step_compute(model)
    assert compute.step_seconds == pytest.approx(model.step_seconds, rel=1e-12)
    for layer in range(1, model.num_layers):
        activations = compute.backward_activation_seconds[layer]
        weights = compute.backward_weight_seconds[layer]
        assert activations + weights == pytest.approx(2 * compute.forward_seconds[layer])
    assert compute.backward_activation_seconds[0] == 0.0


@pytest.mark.parametrize(
    ("method", "bits", "sync_every", "tau", "num_fragments"),
    [
        ("dp", 16, 1, 0, 1),
        ("diloco", 16, 100, 0, 1),
        ("streaming", 16, 100, 0, 8),
        ("streaming-overlap", 16, 100, 2, 8),
        ("streaming-overlap-fp4", 4, 100, 2, 8),
    ],
)
def test_sync_plan_follows_method(
    method: str, bits: int, sync_every: int, tau: int, num_fragments: int
) -> None:
    model = PRESETS["1B"]  # 24 layers, fragments of 3 -> 8
    plan = sync_plan(model, method, SyncSettings(tau=2, num_replicas=4))  # type: ignore[arg-type]
    assert (plan.sync_every, plan.tau, len(plan.fragments)) == (sync_every, tau, num_fragments)
    # n/L parameters per layer, b bits, all-reduce factor 2(M-1)/M = 1.5 with M = 4
    assert plan.wire_bits[0] == pytest.approx(1e9 / 24 * bits * 1.5)


@pytest.mark.parametrize(
    ("method", "bits"),
    [
        ("dp", 32),
        ("diloco", 8),
        ("streaming", 8),
        ("streaming-overlap", 8),
        ("streaming-overlap-fp4", 4.25),
    ],
)
def test_sync_plan_uses_the_bit_widths_asked(method: str, bits: float) -> None:
    settings = SyncSettings(dp_bits=32, outer_bits=8, fp4_bits=4.25)
    plan = sync_plan(PRESETS["1B"], method, settings)  # type: ignore[arg-type]
    assert plan.wire_bits[0] == pytest.approx(1e9 / 24 * bits)  # M = 2: factor 1


def test_sync_plan_strided_and_sequential_fragments() -> None:
    model = ModelSpec(name="t", num_layers=6, num_params=6e6, step_seconds=1.0)
    strided = sync_plan(model, "streaming", SyncSettings(fragment_size=2, pattern="strided"))
    sequential = sync_plan(model, "streaming", SyncSettings(fragment_size=2, pattern="sequential"))
    assert strided.fragments == ((0, 3), (1, 4), (2, 5))
    assert sequential.fragments == ((0, 1), (2, 3), (4, 5))


def test_compute_utilisation_horizon_is_long_enough() -> None:
    settings = SyncSettings(tau=5)
    model = PRESETS["100B"]
    compute = step_compute(model)
    for method in METHODS:
        plan = sync_plan(model, method, settings)
        default = compute_utilisation(compute, plan, GRID)
        longer = compute_utilisation(compute, plan, GRID, warmup_periods=4, periods=8)
        np.testing.assert_allclose(default, longer, rtol=1e-9, err_msg=method)


def test_sync_settings_bad_values_are_refused() -> None:
    with pytest.raises(ValueError, match="tau < H"):
        SyncSettings(sync_every=4, tau=4)
    with pytest.raises(ValueError, match="2 replicas"):
        SyncSettings(num_replicas=1)
    with pytest.raises(ValueError, match="bits"):
        SyncSettings(fp4_bits=0)
