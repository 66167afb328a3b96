"""The example run configuration that examples/ ships: ``start --config`` takes it as it is,
and a typed flag overrides its value."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from diloco.cli import main
from diloco.cli import node as cli_node
from diloco.node.config import RunConfig

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "run.toml"


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[RunConfig]:
    """The run each ``start`` would train, instead of a node."""
    runs: list[RunConfig] = []

    def record(run: RunConfig, *args: Any, **kwargs: Any) -> None:
        runs.append(run)

    monkeypatch.setattr(cli_node, "_run_node", record)
    return runs


def test_start_takes_the_example_file(started: list[RunConfig]) -> None:
    result = CliRunner().invoke(main, ["start", "--config", str(EXAMPLE)])
    assert result.exit_code == 0, result.output
    (run,) = started
    assert (run.name, run.preset, run.seq_len, run.steps) == ("my-run", "small", 256, 3000)
    assert (run.outer.sync_every, run.outer.fragment_sync_delay) == (30, 1)
    assert (run.inner.lr, run.inner.warmup_steps) == (0.001, 100)
    assert run.dataset == "embedded"


def test_a_typed_flag_overrides_the_example_file(started: list[RunConfig]) -> None:
    result = CliRunner().invoke(main, ["start", "--config", str(EXAMPLE), "--steps", "5000"])
    assert result.exit_code == 0, result.output
    assert started[0].steps == 5000 and started[0].name == "my-run"
