"""A node's curves reach W&B (offline mode, read back from its run folder) and
TensorBoard (read back from its event files), from the node's own events."""

from __future__ import annotations

import json
import struct
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from diloco.errors import ConfigError
from diloco.node.observe.trackers import TensorboardTracker, WandbTracker, check_available

PEER = "12D3KooWQYhTNQdmr3ArTeUHRYzFg94BKyTkoWBDWez9kSCVe2Xo"
EVENTS: list[dict[str, Any]] = [
    {"event": "config", "run_id": "seen-0123456789abcdef", "step": 0},
    {"event": "step", "step": 1, "loss": 5.0},
    {"event": "progress", "step": 10, "loss": 4.5, "tokens_per_s": 900.0, "cu": 0.5},
    {"event": "round", "step": 12, "fragment": 0, "round": 1, "members": 2, "seconds": 0.75},
    {"event": "round_failed", "step": 14, "fragment": 1, "round": 1},
    {"event": "eval", "step": 20, "loss_outer": 4.25},
    {"event": "summary", "step": 30, "eval_loss": 4.0, "interrupted": False},
]


def test_tensorboard_event_files_hold_the_curves(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="the [tensorboard] extra is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tracker = TensorboardTracker(tmp_path, PEER)
    for event in EVENTS:
        tracker.observe(event)
    tracker.close()
    assert tracker.log_dir == tmp_path / "kSCVe2Xo"
    events = EventAccumulator(str(tracker.log_dir))
    events.Reload()

    def curve(tag: str) -> list[tuple[int, float]]:
        return [(e.step, e.value) for e in events.Scalars(tag)]

    assert curve("train/loss") == [(10, 4.5)]
    assert curve("train/compute_utilisation") == [(10, 0.5)]
    assert curve("rounds/seconds") == [(12, 0.75)]
    assert curve("rounds/failed") == [(14, 1.0)]
    assert curve("eval/loss_outer") == [(20, 4.25)]
    assert curve("eval/loss_outer_final") == [(30, 4.0)]


def test_wandb_offline_run_holds_the_curves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("wandb", reason="the [wandb] extra is not installed")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    tracker = WandbTracker("diloco-test", "seen-0123456789abcdef", PEER, {"steps": 30})
    for event in EVENTS:
        tracker.observe(event)
    tracker.close()
    (path,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    run, history = None, []
    for record in _wandb_records(path):
        if record.WhichOneof("record_type") == "run":
            run = record.run
        elif record.WhichOneof("record_type") == "history":
            items = record.history.item
            history.append(
                {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items}
            )
    assert run is not None
    assert (run.project, run.run_group, run.display_name) == (
        "diloco-test",
        "seen-0123456789abcdef",
        "kSCVe2Xo",
    )
    config = {i.key: json.loads(i.value_json) for i in run.config.update}
    assert config["peer_id"] == PEER and config["steps"] == 30
    curves = [
        {k: v for k, v in h.items() if not k.startswith("_")} | {"step": h["_step"]}
        for h in history
    ]
    assert curves == [
        {
            "step": 10,
            "train/loss": 4.5,
            "train/tokens_per_s": 900,
            "train/compute_utilisation": 0.5,
        },
        {"step": 12, "rounds/seconds": 0.75, "rounds/members": 2},
        {"step": 14, "rounds/failed": 1},
        {"step": 20, "eval/loss_outer": 4.25},
        {"step": 30, "eval/loss_outer_final": 4},
    ]


def _wandb_records(path: Path) -> Iterator[Any]:
    """The records of an offline W&B run file: a ``:W&B`` header, then LevelDB-log blocks
    of 32 KiB, each record in chunks (header: CRC32, length, type; 1 full, 2-4 parts)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, chunks = 7, b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7]) if left >= 7 else (0, 0, 0)
        if kind == 0:  # the padding at a block's end
            pos += left
            continue
        chunks += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            chunks = b""
            yield record


def test_a_missing_package_is_one_clear_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """As without the extra: ``import`` raises ImportError (``None`` in sys.modules)."""
    for name in ("wandb", "tensorboard"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ConfigError, match=r"^--wandb-project needs the wandb package: pip"):
        check_available("p", None)
    with pytest.raises(ConfigError, match=r"^--wandb-project needs the wandb package: pip"):
        WandbTracker("p", "seen-0123456789abcdef", PEER, {})
    with pytest.raises(ConfigError, match=r"^--tensorboard-dir needs the tensorboard package"):
        check_available(None, "folder")
    with pytest.raises(ConfigError, match=r"^--tensorboard-dir needs the tensorboard package"):
        TensorboardTracker("folder", PEER)
