"""``diloco-node simulate`` and ``diloco-node accounting`` through click's CliRunner."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from diloco.cli import main
from diloco.sim.methods import METHODS, PRESETS, SyncSettings
from diloco.sim.sweep import bandwidth_grid, cu_curves, required_bandwidth


def _invoke(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.output


def test_simulate_targets_json_matches_sweep(tmp_path: Path) -> None:
    path = tmp_path / "table.json"
    code, output = _invoke(
        "simulate", "--model", "10B", "--targets", "0.5,0.95", "--json", str(path)
    )
    assert code == 0, output
    data = json.loads(path.read_text())
    assert data["targets"] == [0.5, 0.95]
    assert list(data["required_gbps"]) == list(METHODS)
    grid = bandwidth_grid(1e-4, 1e5)
    curves = cu_curves(PRESETS["10B"], METHODS, SyncSettings(), grid)
    for method, cu in curves.items():
        assert data["required_gbps"][method] == required_bandwidth(grid, cu, [0.5, 0.95])
    assert "95%" in output


def test_simulate_bandwidth_one_method(tmp_path: Path) -> None:
    code, output = _invoke("simulate", "--method", "streaming-overlap-fp4", "--bandwidth", "1000")
    assert code == 0, output
    row = next(line.split() for line in output.splitlines() if "streaming-overlap-fp4" in line)
    assert float(row[1]) == pytest.approx(1.0, abs=1e-4)
    assert "dp" not in output.split()


def test_simulate_writes_plot_and_timeline(tmp_path: Path) -> None:
    plot, gantt = tmp_path / "cu.png", tmp_path / "timeline.png"
    code, output = _invoke(
        "simulate",
        "--model",
        "custom",
        "--layers",
        "4",
        "--params",
        "4e8",
        "--step-time",
        "1",
        "--H",
        "4",
        "--fragment-size",
        "2",
        "--bandwidth",
        "2",
        "--plot",
        str(plot),
        "--timeline",
        str(gantt),
    )
    assert code == 0, output
    for path in (plot, gantt):
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_simulate_from_metrics(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    records = [
        {
            "event": "config",
            "sync_every": 10,
            "num_fragments": 2,
            "tau": 1,
            "fragment_numel": [1000, 1000],
            "codec": "e3m0",
        },
        {"event": "step", "step": 1, "step_seconds": 0.1},
        {"event": "step", "step": 2, "step_seconds": 0.1},
        {
            "event": "round",
            "step": 1,
            "fragment": 0,
            "round": 1,
            "members": 2,
            "bytes_sent": 600,
            "bytes_received": 500,
            "seconds": 0.01,
            "blocked_seconds": 0.05,
        },
    ]
    metrics.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    code, output = _invoke("simulate", "--from-metrics", str(metrics), "--bandwidth", "1")
    assert code == 0, output
    assert "observed link rate: 0.00048 Gbit/s" in output  # 600 bytes in 0.01 s
    # 0.2 s of compute, 0.05 s blocked; the steady state (after step 1) has no round.
    rows = [line.split() for line in output.splitlines()]
    assert ["measured", "0.8000", "1.0000"] in rows
    row = output.splitlines()[-1].split()
    assert row[0] == "measured"
    assert float(row[1]) == pytest.approx(1.0, abs=1e-4)  # 600 bytes at 1 Gbit/s: hidden


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "custom", "--layers", "4"], "--layers, --params and --step-time"),
        (["--json", "x.json"], "give --targets"),
        (["--timeline", "x.png"], "give --bandwidth"),
        (["--targets", "0.5,high"], "expected CU values"),
        (["--targets", "1.5"], "CU targets"),
        (["--tau", "100"], "tau < H"),
    ],
)
def test_simulate_bad_options_exit_2(args: list[str], message: str) -> None:
    code, output = _invoke("simulate", *args)
    assert code == 2
    assert message in output


def test_simulate_bad_metrics_exit_2(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"event": "step", "step_seconds": 1}\n')
    code, output = _invoke("simulate", "--from-metrics", str(metrics))
    assert code == 2
    assert "config" in output


def test_accounting_prints_ratio_to_dp() -> None:
    code, output = _invoke("accounting", "--model", "1B", "--tokens", "2.5e10", "--replicas", "4")
    assert code == 0, output
    lines = [line.split() for line in output.splitlines() if line.strip()]
    rows = {cells[0]: cells for cells in lines if cells[0] in METHODS}
    assert set(rows) == set(METHODS)
    assert float(rows["dp"][-2]) == 1.0
    # 16 bits every H = 100 steps instead of bf16 every step: 100 times fewer bytes
    # (23,842 steps hold 238 syncs, hence not exactly 100)
    assert float(rows["diloco"][-2]) == pytest.approx(100, rel=1e-2)
    assert "M = 4" in output  # the data-parallel assumption is printed


def test_accounting_unknown_codec_exit_2() -> None:
    code, output = _invoke("accounting", "--codec", "fp3")
    assert code == 2
    assert "unknown codec" in output
