"""``--checkpoint-dir`` and ``--resume`` are checked before a node starts: one line, exit 2.

``_run_node`` (which starts the swarm) is swapped for a recorder, so a refused command line
is one that never reached it. The checkpoints are real ones, written by
``CheckpointManager`` with a run configuration in their state.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from diloco.cli import main
from diloco.cli import node as cli_node
from diloco.node.config import RunConfig
from diloco.node.training.checkpoint import CheckpointManager
from diloco.node.training.outer_config import OuterConfig
from diloco.protocol.trust.identity import Identity


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    """The calls of ``_run_node``, instead of a node."""
    calls: list[tuple[Any, ...]] = []
    monkeypatch.setattr(cli_node, "_run_node", lambda *args, **kwargs: calls.append(args))
    return calls


def invoke(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.output


def refusal(output: str) -> str:
    """The error line of click's usage error (the rest is usage and a help hint)."""
    (line,) = [line for line in output.splitlines() if line.startswith("Error: ")]
    assert "Traceback" not in output
    return line


def save_run(folder: Path, run: RunConfig) -> Path:
    manager = CheckpointManager(folder)
    path = manager.save(40, {"w": torch.zeros(2)}, {"step": 40, "run": run.to_dict()})
    assert path is not None
    return path


def test_an_unwritable_checkpoint_dir_exits_2_naming_it(
    started: list[tuple[Any, ...]], tmp_path: Path
) -> None:
    """As root every folder is writable: one under a regular file is not, for anyone."""
    (tmp_path / "a-file").write_text("")
    folder = tmp_path / "a-file" / "ckpt"
    code, output = invoke("start", "--checkpoint-dir", str(folder))
    assert code == 2 and not started
    assert refusal(output) == (
        f"Error: checkpoint {folder}: cannot write checkpoints there (Not a directory)"
    )


@pytest.mark.parametrize("kind", ["empty", "mistyped"])
def test_resume_without_a_checkpoint_exits_2_naming_the_folder(
    started: list[tuple[Any, ...]], tmp_path: Path, kind: str
) -> None:
    folder = tmp_path / "ckpt"
    if kind == "empty":
        folder.mkdir()
    for command in ("start", "join"):
        peers = (
            ("--initial-peers", f"/ip4/127.0.0.1/tcp/1/p2p/{Identity.generate().peer_id}")
            if command == "join"
            else ()
        )
        code, output = invoke(command, *peers, "--resume", "--checkpoint-dir", str(folder))
        assert code == 2 and not started
        assert refusal(output) == (
            f"Error: --resume: no checkpoint in {folder} (no step_* folder): check the path, "
            "or drop --resume to start a new run"
        )
    assert folder.exists() == (kind == "empty")  # a mistyped folder is not created


def test_resume_without_a_checkpoint_dir_exits_2(started: list[tuple[Any, ...]]) -> None:
    code, output = invoke("start", "--resume")
    assert code == 2 and not started
    assert refusal(output) == (
        "Error: --resume needs --checkpoint-dir, the folder of the run's checkpoints"
    )


def test_resume_with_other_flags_names_each_difference_by_its_flag(
    started: list[tuple[Any, ...]], tmp_path: Path
) -> None:
    saved = RunConfig(steps=900, outer=dataclasses.replace(OuterConfig(), sync_every=10))
    path = save_run(tmp_path / "ckpt", saved)
    code, output = invoke("start", "--resume", "--checkpoint-dir", str(tmp_path / "ckpt"))
    assert code == 2 and not started
    assert refusal(output) == (
        f"Error: --resume: checkpoint {path} belongs to another run configuration: "
        "--H: checkpoint 10, yours 30; --steps: checkpoint 900, yours 600 "
        "(resume with the run's settings)"
    )
    args = ("--resume", "--checkpoint-dir", str(tmp_path / "ckpt"), "--H", "10", "--steps", "900")
    assert invoke("start", *args) == (0, "")
    assert len(started) == 1


def test_resume_ignores_the_creator_which_start_learns_later(
    started: list[tuple[Any, ...]], tmp_path: Path
) -> None:
    save_run(tmp_path / "ckpt", RunConfig(creator=Identity.generate().peer_id))
    assert invoke("start", "--resume", "--checkpoint-dir", str(tmp_path / "ckpt")) == (0, "")
    assert len(started) == 1
