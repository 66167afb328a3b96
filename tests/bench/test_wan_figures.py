"""``benchmarks/wan.py``'s figures from metrics records written by hand: where the steady
state starts, CU as the trainer counts it, failures before and in it, round trips."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any


def _wan() -> ModuleType:
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "wan.py"
    spec = importlib.util.spec_from_file_location("benchmark_wan", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _round(step: int, members: int, seconds: float, path: list[str]) -> dict[str, Any]:
    return {
        "event": "round",
        "step": step,
        "members": members,
        "seconds": seconds,
        "matchmaking_seconds": seconds / 2,
        "blocked_seconds": 0.5,
        "round_trips": len(path),
        "critical_path": [[kind, 0.1] for kind in path],
    }


def test_steady_state_starts_when_all_met_and_counts_what_follows() -> None:
    wan = _wan()
    steps = [{"event": "step", "step": s, "step_seconds": 1.0, "rows": 4} for s in range(1, 21)]
    creator = [
        *steps,
        {"event": "round_failed", "step": 4, "blocked_seconds": 2.0, "error": "no group"},
        _round(6, 2, 9.0, ["declare", "read"]),  # before the joiner: not steady
        _round(10, 3, 1.0, ["declare", "read", "part", "check"]),
        _round(14, 3, 2.0, ["declare", "read", "part", "check"]),
        _round(18, 3, 3.0, ["declare", "read", "read", "part", "check"]),
        {"event": "round_failed", "step": 19, "blocked_seconds": 1.5, "error": "late"},
        # The run's end waits for a round before its receive step: not the steady state's.
        {**_round(20, 3, 1.0, ["join", "part", "check"]), "blocked_seconds": 4.0, "final": True},
        {"event": "healed", "step": 3},
        {"event": "summary", "eval_loss": 2.5, "cu": 0.7, "step": 20},
    ]
    joiner = [
        {"event": "joined", "step": 2},
        *steps[2:],
        _round(12, 3, 1.0, ["declare", "read", "join", "part", "check"]),
    ]
    out = wan.figures([creator, joiner, joiner], warmup=0)
    assert out["first_full_round_step"] == [10, 12, 12]
    assert out["steady_from_step"] == 12
    node = out["nodes"][0]
    assert node["steady_steps"] == 8  # steps 13..20
    # compute 8 s; blocked: two rounds (0.5 s each) and the failed one (1.5 s)
    assert node["cu"] == 8.0 / (8.0 + 2.5)
    assert node["final_blocked_seconds"] == 4.0
    assert (node["rounds_ok"], node["rounds_failed"], node["startup_failed"]) == (2, 1, 1)
    assert node["round_seconds_median"] == 2.5
    assert node["round_trips_median"] == 4.5 and node["round_trips_range"] == [4, 5]
    assert (node["heals"], node["heals_whole_run"]) == (0, 1)
    assert node["eval_loss"] == 2.5
    # every step's rows, the steps before the steady state too (a later joiner trains fewer)
    assert (node["rows_trained"], out["nodes"][1]["rows_trained"]) == (80, 72)
    assert out["nodes"][1]["rounds_ok"] == 0  # its only round is at the start step
