"""Checkpoints: data only (safetensors + JSON), and a damaged one falls back to the previous."""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from pathlib import Path
from typing import Any

import forked_commands
import pytest
import torch

from diloco.errors import CheckpointError
from diloco.node.training.checkpoint import Checkpoint, CheckpointManager, check_folder, saved_run

MODEL = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}


def state(step: int) -> dict[str, Any]:
    """A state with every shape a trainer's ``state_dict`` has."""
    return {
        "step": step,
        "rng": torch.tensor([1, 2, 255], dtype=torch.uint8),
        "optimizer": {
            "state": {0: {"step": torch.tensor(float(step)), "exp_avg": torch.ones(3)}},
            "param_groups": [{"betas": (0.9, 0.95), "lr": 1e-3, "foreach": None, "params": [0]}],
        },
        "pending": [{"failed": "nobody came", "weight": math.inf}],
        "versions": [step, 0],
        "flag": True,
    }


def saved(tmp_path: Path, *steps: int) -> CheckpointManager:
    manager = CheckpointManager(tmp_path, keep=5)
    for step in steps:
        assert manager.save(step, MODEL, state(step)) is not None
    return manager


def assert_same(a: Any, b: Any) -> None:
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            assert_same(a[key], b[key])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    else:
        assert a == b


def test_state_round_trips_with_tensors_tuples_and_int_keys(tmp_path: Path) -> None:
    manager = saved(tmp_path, 3)
    path = manager.latest()
    assert path is not None
    assert sorted(f.name for f in path.iterdir()) == [
        "model.safetensors",
        "state.json",
        "state.safetensors",
    ]
    loaded = CheckpointManager.load(path)
    assert_same(loaded.state, state(3))
    assert_same(loaded.model, MODEL)
    tree = json.loads((path / "state.json").read_text())
    assert tree["dict"]["rng"] == {"tensor": "/rng"}  # tensors are references in the JSON


class _OpenOnUnpickle:
    """A pickle payload: unpickling it creates ``marker`` (stands for any code)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.marker), "w"))


def test_a_pickled_state_pt_executes_nothing(tmp_path: Path, caplog: Any) -> None:
    control = tmp_path / "control-marker"
    torch.save(_OpenOnUnpickle(control), tmp_path / "control.pt")
    torch.load(tmp_path / "control.pt", weights_only=False)
    assert control.exists()  # the payload is live: unpickling it runs code

    marker = tmp_path / "marker"
    manager = saved(tmp_path / "ckpt", 10, 20)
    older, newer = manager.checkpoints()
    torch.save(_OpenOnUnpickle(marker), newer / "state.pt")  # beside a good checkpoint
    assert manager.load_latest(lambda path, checkpoint: None) == newer
    (newer / "state.json").write_bytes((newer / "state.pt").read_bytes())  # in its place
    old_format = manager.folder / "step_000000030"
    old_format.mkdir()
    torch.save(_OpenOnUnpickle(marker), old_format / "state.pt")
    (old_format / "model.safetensors").write_bytes((older / "model.safetensors").read_bytes())
    restored: list[Path] = []
    with caplog.at_level(logging.WARNING, logger="diloco.node.training.checkpoint"):
        found = manager.load_latest(lambda path, checkpoint: restored.append(path))
    assert found == older and restored == [older]
    assert not marker.exists()
    assert len(caplog.records) == 2


@pytest.mark.parametrize(
    "damage,file",
    [
        ("garbage", "state.json"),
        ("truncate", "state.json"),
        ("garbage", "state.safetensors"),
        ("truncate", "state.safetensors"),
        ("truncate", "model.safetensors"),
        ("remove", "state.json"),
        ("remove", "state.safetensors"),
        ("remove", "model.safetensors"),
        ("dangling", "state.json"),
    ],
)
def test_damaged_checkpoint_falls_back_with_one_line(
    tmp_path: Path, caplog: Any, damage: str, file: str
) -> None:
    manager = saved(tmp_path, 10, 20)
    older, newer = manager.checkpoints()
    target = newer / file
    if damage == "garbage":
        target.write_bytes(os.urandom(300))
    elif damage == "truncate":
        data = target.read_bytes()
        target.write_bytes(data[: len(data) - 7])
    elif damage == "remove":
        target.unlink()
    else:  # a reference to a tensor that is not there
        target.write_text(target.read_text().replace('"/rng"', '"/gone"'))
    restored: list[tuple[Path, Checkpoint]] = []
    with caplog.at_level(logging.WARNING, logger="diloco.node.training.checkpoint"):
        found = manager.load_latest(lambda path, checkpoint: restored.append((path, checkpoint)))
    assert found == older
    ((path, checkpoint),) = restored
    assert path == older and checkpoint.state["step"] == 10
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith(f"skipping checkpoint {newer}") and "\n" not in line
    assert file in line


def test_a_checkpoint_the_trainer_refuses_falls_back_too(tmp_path: Path) -> None:
    manager = saved(tmp_path, 10, 20)
    older = manager.checkpoints()[0]

    def restore(path: Path, checkpoint: Checkpoint) -> None:
        if checkpoint.state["step"] == 20:
            raise CheckpointError(path, "does not fit this node")

    assert manager.load_latest(restore) == older


def test_no_usable_checkpoint_is_one_clear_error(tmp_path: Path) -> None:
    manager = saved(tmp_path, 10)
    assert CheckpointManager(tmp_path / "empty").load_latest(lambda p, c: None) is None
    (manager.checkpoints()[0] / "state.json").write_text("{")
    with pytest.raises(CheckpointError, match="none of its 1 checkpoints is usable") as caught:
        manager.load_latest(lambda path, checkpoint: None)
    assert caught.value.path == tmp_path


@pytest.mark.swarm
def test_cli_resume_without_a_usable_checkpoint_exits_1_without_traceback(
    tmp_path: Path,
) -> None:
    manager = saved(tmp_path / "ckpt", 10)
    (manager.checkpoints()[0] / "state.safetensors").write_bytes(b"\x00" * 20)
    command = ["start", "--steps", "20", "--checkpoint-dir", str(manager.folder), "--resume"]
    done = forked_commands.run([sys.executable, "-m", "diloco", *command], timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode == 1, output
    assert "Traceback" not in output
    assert f"skipping checkpoint {manager.checkpoints()[0] / 'state.safetensors'}" in output
    assert "none of its 1 checkpoints is usable" in output


@pytest.mark.parametrize("depth", [990, 40_000])
def test_a_deeply_nested_state_json_is_one_line_not_a_traceback(
    tmp_path: Path, caplog: Any, depth: int
) -> None:
    """40,000 levels are beyond json's recursion; 990 parse but nest the decoder as deep."""
    manager = saved(tmp_path, 10)
    (path,) = manager.checkpoints()
    (path / "state.json").write_text('{"dict": {"x": ' + "[" * depth + "]" * depth + "}}")
    with (
        caplog.at_level(logging.WARNING, logger="diloco.node.training.checkpoint"),
        pytest.raises(CheckpointError, match="none of its 1 checkpoints is usable"),
    ):
        manager.load_latest(lambda path, checkpoint: None)
    (line,) = [r.getMessage() for r in caplog.records]
    assert line == f"skipping checkpoint {path / 'state.json'}: malformed: nested too deeply"
    assert saved_run(tmp_path) is None


def test_a_folder_where_nothing_can_be_written_is_one_clear_error(tmp_path: Path) -> None:
    """Tests run as root, who may write anywhere: a folder under a regular file is
    unwritable for anyone."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(CheckpointError, match="cannot write checkpoints there") as caught:
        check_folder(blocker / "ckpt")
    assert caught.value.path == blocker / "ckpt"
    check_folder(tmp_path / "new" / "ckpt")  # a missing one is created
    assert (tmp_path / "new" / "ckpt").is_dir()
    assert list((tmp_path / "new" / "ckpt").iterdir()) == []


def test_saved_run_reads_the_newest_readable_run(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, keep=5)
    for step, name in ((10, "old"), (20, "new"), (30, "broken")):
        manager.save(step, MODEL, state(step) | {"run": {"name": name, "outer": {"H": step}}})
    (manager.checkpoints()[-1] / "state.json").write_text("{")
    assert saved_run(tmp_path) == (manager.checkpoints()[1], {"name": "new", "outer": {"H": 20}})
    assert saved_run(tmp_path / "missing") is None
