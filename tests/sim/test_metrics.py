"""Reading a node's JSON-lines metrics, and simulating the measured run."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from diloco.sim.dag import compute_utilisation
from diloco.sim.methods import ModelSpec, SyncSettings, step_compute, sync_plan
from diloco.sim.metrics import measured_schedule, parse_metrics
from diloco.sim.sweep import bandwidth_grid

CONFIG = {
    "event": "config",
    "sync_every": 8,
    "num_fragments": 4,
    "tau": 1,
    "fragment_numel": [1_000_000] * 4,
    "codec": "none",
    "run_id": "test-run",  # fields we do not read are fine
}


def _lines(records: list[dict[str, Any]]) -> list[str]:
    return [json.dumps(record) for record in records]


def _metrics(**config: Any) -> list[str]:
    """A crafted run: 4 fragments of 1e6 FP32 values, 2 members (4e6 bytes a round)."""
    records: list[dict[str, Any]] = [{**CONFIG, **config}]
    records += [
        {"event": "step", "step": s, "step_seconds": t, "loss": 3.0}
        for s, t in enumerate([0.2, 0.2, 0.25, 0.2, 0.2], start=1)
    ]
    records.append({"event": "eval", "loss": 2.9})  # an event we ignore
    records += [
        {
            "event": "round",
            "fragment": p,
            "round": 1,
            "bytes_sent": 4_000_000,
            "bytes_received": 3_900_000,
            "seconds": 0.5,
        }
        for p in range(4)
    ]
    return [*_lines(records), ""]


def test_parse_metrics_reads_config_steps_and_rounds() -> None:
    run = parse_metrics(_metrics())
    assert (run.sync_every, run.num_fragments, run.tau, run.codec) == (8, 4, 1, "none")
    assert run.fragment_numel == (1_000_000,) * 4
    assert run.step_seconds == 0.2  # the median ignores the one slow step
    assert (run.num_steps, run.num_rounds) == (5, 4)
    assert run.wire_bytes == (4e6,) * 4  # the busier direction of each round
    assert run.observed_gbps == pytest.approx(4 * 4e6 * 8 / (4 * 0.5) / 1e9)


def test_measured_schedule_equals_method_plan_of_same_run() -> None:
    # The crafted run is streaming-overlap of a 4-layer, 4e6-parameter model with one layer
    # per fragment, FP32, 2 replicas: both routes must give the same schedule and CU.
    compute, plan = measured_schedule(parse_metrics(_metrics()))
    model = ModelSpec(name="t", num_layers=4, num_params=4e6, step_seconds=0.2)
    settings = SyncSettings(sync_every=8, fragment_size=1, tau=1, outer_bits=32)
    expected_plan = sync_plan(model, "streaming-overlap", settings)
    assert plan.fragments == expected_plan.fragments
    assert plan.wire_bits == pytest.approx(expected_plan.wire_bits)
    grid = bandwidth_grid(1e-3, 10, points_per_decade=10)
    np.testing.assert_allclose(
        compute_utilisation(compute, plan, grid),
        compute_utilisation(step_compute(model), expected_plan, grid),
        rtol=1e-12,
    )


def test_measured_schedule_splits_compute_by_fragment_size() -> None:
    lines = _metrics(fragment_numel=[3_000_000, 1_000_000, 1_000_000, 1_000_000])
    compute, _plan = measured_schedule(parse_metrics(lines))
    assert compute.step_seconds == pytest.approx(0.2)
    assert compute.forward_seconds[0] == pytest.approx(3 * compute.forward_seconds[1])
    assert compute.backward_activation_seconds[0] == 0.0


def test_parse_metrics_fragment_without_round_costs_like_the_others_per_value() -> None:
    lines = _metrics(
        fragment_numel=[1_000_000, 1_000_000, 1_000_000, 1_000_000, 500_000], num_fragments=5
    )
    run = parse_metrics(lines)
    assert run.wire_bytes[4] == pytest.approx(2e6)  # 4 bytes per value, as measured


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (_lines([{"event": "step", "step_seconds": 1.0}]), "no .*config"),
        (
            _lines(
                [
                    CONFIG,
                    {
                        "event": "round",
                        "fragment": 0,
                        "round": 1,
                        "bytes_sent": 1,
                        "bytes_received": 1,
                        "seconds": 1,
                    },
                ]
            ),
            "no .*step",
        ),
        (_lines([CONFIG, {"event": "step", "step_seconds": 1.0}]), "no .*round"),
        ([json.dumps(CONFIG), "{not json"], "line 2: not JSON"),
        (["[1, 2]"], "line 1: expected a JSON object"),
        (_lines([{**CONFIG, "tau": True}]), "line 1: .*'tau'"),
        (_lines([{**CONFIG, "fragment_numel": [1, -2]}]), "fragment_numel"),
        (_lines([{**CONFIG, "codec": 4}]), "codec"),
        (['{"event": "step", "step_seconds": NaN}'], "finite"),
        (_lines([{"event": "step", "step_seconds": 0}]), "> 0"),
        (
            _lines(
                [
                    {
                        "event": "round",
                        "fragment": 0,
                        "round": 1,
                        "bytes_sent": -1,
                        "bytes_received": 1,
                        "seconds": 1,
                    }
                ]
            ),
            ">= 0",
        ),
        (
            _lines(
                [
                    {**CONFIG, "num_fragments": 3},
                    {"event": "step", "step_seconds": 1.0},
                    {
                        "event": "round",
                        "fragment": 0,
                        "round": 1,
                        "bytes_sent": 1,
                        "bytes_received": 1,
                        "seconds": 1,
                    },
                ]
            ),
            "num_fragments=3 but 4",
        ),
        (
            _lines(
                [
                    CONFIG,
                    {"event": "step", "step_seconds": 1.0},
                    {
                        "event": "round",
                        "fragment": 4,
                        "round": 1,
                        "bytes_sent": 1,
                        "bytes_received": 1,
                        "seconds": 1,
                    },
                ]
            ),
            "fragment 4",
        ),
    ],
)
def test_parse_metrics_bad_input_is_refused(lines: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_metrics(lines)


def test_measured_schedule_tau_not_below_h_is_refused() -> None:
    with pytest.raises(ValueError, match="tau < H"):
        measured_schedule(parse_metrics(_metrics(tau=8)))
