"""The entry points behind ``diloco-node simulate`` and ``diloco-node accounting``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from diloco.sim.commands import (
    SimulateRequest,
    accounting_report,
    resolve_model,
    simulate_report,
    timeline,
    timeline_steps,
)
from diloco.sim.dag import compute_utilisation
from diloco.sim.methods import PRESETS, SyncSettings, step_compute, sync_plan


def test_resolve_model_presets_overrides_and_custom() -> None:
    assert resolve_model("10B") == PRESETS["10B"]
    assert resolve_model("10B", step_seconds=2.0).step_seconds == 2.0
    custom = resolve_model("custom", num_layers=4, num_params=1e6, step_seconds=0.1)
    assert (custom.num_layers, custom.num_params, custom.step_seconds) == (4, 1e6, 0.1)
    with pytest.raises(ValueError, match="--layers, --params and --step-time"):
        resolve_model("custom", num_layers=4)
    with pytest.raises(ValueError, match="unknown model"):
        resolve_model("7B")


def test_simulate_report_at_one_bandwidth_matches_simulator() -> None:
    report = simulate_report(SimulateRequest(model="1B", methods=("dp",), bandwidth_gbps=200.0))
    cu = compute_utilisation(
        step_compute(PRESETS["1B"]), sync_plan(PRESETS["1B"], "dp", SyncSettings()), [200.0]
    )[0]
    row = next(line.split() for line in report.text.splitlines() if line.split()[:1] == ["dp"])
    assert float(row[1]) == pytest.approx(cu, abs=5e-5)
    assert report.required is None  # no table asked for


def test_simulate_report_default_is_the_target_table() -> None:
    report = simulate_report(SimulateRequest(model="1B"))
    assert report.required is not None
    assert report.required["targets"] == [0.5, 0.8, 0.9, 0.95, 0.99]
    table = report.required["required_gbps"]
    assert list(table) == [
        "dp",
        "diloco",
        "streaming",
        "streaming-overlap",
        "streaming-overlap-fp4",
    ]
    assert all(len(values) == 5 for values in table.values())
    assert "dp / fp4" in report.text
    json.dumps(report.required)  # serialisable as it is


def test_timeline_covers_steps_around_first_round() -> None:
    model = resolve_model("custom", num_layers=3, num_params=3e8, step_seconds=1.0)
    plan = sync_plan(model, "streaming-overlap", SyncSettings(sync_every=4, fragment_size=1))
    assert timeline_steps(plan) == range(3, 8)  # sent at 4, received at 5, two steps after
    intervals = timeline(step_compute(model), plan, 1.0)
    assert {i.step for i in intervals} == set(range(3, 8))
    assert min(i.start for i in intervals) == 0.0
    assert sum(i.kind == "reduction" for i in intervals) >= 1


def test_simulate_report_timeline_without_bandwidth_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="give --bandwidth"):
        simulate_report(SimulateRequest(timeline_path=str(tmp_path / "t.png")))
    assert not (tmp_path / "t.png").exists()


def test_accounting_report_lists_every_method() -> None:
    text = accounting_report(
        model="1B",
        num_tokens=None,
        batch_size=256,
        seq_len=1024,
        num_replicas=2,
        sync_every=100,
        fragment_size=3,
        tau=1,
        codec="e3m0",
    )
    assert "2e+10 tokens" in text  # 20 tokens per parameter by default
    for method in ("dp ", "diloco ", "streaming ", "streaming-overlap ", "streaming-overlap-fp4 "):
        assert any(line.startswith(method) for line in text.splitlines()), method
