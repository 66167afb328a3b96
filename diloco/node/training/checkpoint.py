"""Checkpoints on disk: atomic, resumable, read without pickle, and an export of the weights.

Shaped like torchtitan's ``BaseCheckpointManager``: the public methods hold the guards
(atomic rename, retention, a failed write that loses nothing, a broken checkpoint that falls
back to the previous one), the payload is the trainer's ``state_dict``. A checkpoint is a
folder ``step_000120/`` holding

- ``model.safetensors``: the live weights (theta);
- ``state.safetensors``: every tensor of the state (outer parameters and momentum, inner
  optimizer, RNG states, results of rounds in flight), named by its path in the state;
- ``state.json``: the rest (step, fragment versions, data position, configs), each tensor
  replaced by a reference to its name.

Safetensors and JSON hold data only: loading a checkpoint, even one written by someone else,
runs no code. ``torch.load`` unpickles, and even with ``weights_only=True`` it trusts a
restricted unpickler that has had bypasses; this format also reads without torch. JSON
keeps the few non-JSON shapes of a ``state_dict`` through tagged objects: ``{"tensor":
name}``, ``{"tuple": [...]}``, ``{"dict": {...}}`` and, for integer keys (an optimizer's
per-parameter state), ``{"items": [[key, value], ...]}``.

A save is written into a hidden temporary folder and renamed into place, so a crash or a
full disk mid-save leaves the previous checkpoint intact.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from diloco.errors import CheckpointError

logger = logging.getLogger(__name__)
T = TypeVar("T")

CHECKPOINT_PREFIX = "step_"
MODEL_FILE = "model.safetensors"
TENSORS_FILE = "state.safetensors"
STATE_FILE = "state.json"


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """One checkpoint as read from disk: the live weights and the trainer's state."""

    model: dict[str, torch.Tensor]
    state: dict[str, Any]


class CheckpointManager:
    """Saves and loads checkpoints under ``folder``, keeping the newest ``keep``."""

    def __init__(self, folder: str | Path, keep: int = 2) -> None:
        self.folder = Path(folder)
        self.keep = keep

    def save(self, step: int, model: dict[str, torch.Tensor], state: dict[str, Any]) -> Path | None:
        """Write one checkpoint; returns its path, or None if the disk refused (logged)."""
        final = self.folder / f"{CHECKPOINT_PREFIX}{step:09d}"
        temporary = self.folder / f".tmp-{final.name}-{os.getpid()}"
        tensors: dict[str, torch.Tensor] = {}
        tree = _encode(state, "", tensors)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(temporary, ignore_errors=True)
            temporary.mkdir()
            save_file(_unshared(model), str(temporary / MODEL_FILE))
            save_file(_unshared(tensors), str(temporary / TENSORS_FILE))
            (temporary / STATE_FILE).write_text(json.dumps(tree))
            if final.exists():
                shutil.rmtree(final)
            temporary.rename(final)
        except OSError as error:
            logger.error(
                "could not save checkpoint %s (%s); the previous one is kept", final, error
            )
            shutil.rmtree(temporary, ignore_errors=True)
            return None
        self._prune()
        return final

    def _prune(self) -> None:
        for old in self.checkpoints()[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)

    def checkpoints(self) -> list[Path]:
        """Checkpoint folders (complete as written; maybe damaged since), oldest first."""
        if not self.folder.exists():
            return []
        return sorted(
            p for p in self.folder.iterdir() if p.is_dir() and p.name.startswith(CHECKPOINT_PREFIX)
        )

    def latest(self) -> Path | None:
        found = self.checkpoints()
        return found[-1] if found else None

    @staticmethod
    def load(path: Path) -> Checkpoint:
        """Read a checkpoint folder; no code in it runs.

        Raises:
            CheckpointError: a file is missing, truncated or malformed.
        """
        model = _read(path / MODEL_FILE, lambda f: load_file(str(f)))
        tensors = _read(path / TENSORS_FILE, lambda f: load_file(str(f)))
        tree = _read(path / STATE_FILE, lambda f: json.loads(f.read_text()))
        used: set[str] = set()
        state = _read(path / STATE_FILE, lambda f: _decode(tree, tensors, used, f))
        if not isinstance(state, dict):
            raise CheckpointError(path / STATE_FILE, "holds no state dict")
        if used != set(tensors):
            raise CheckpointError(path / TENSORS_FILE, f"its tensors do not match {STATE_FILE}")
        return Checkpoint(model, state)

    def load_latest(self, restore: Callable[[Path, Checkpoint], None]) -> Path | None:
        """Hand the newest usable checkpoint to ``restore``; returns its path (None: none
        saved yet). A checkpoint that cannot be read, or that ``restore`` refuses with a
        ``CheckpointError``, is skipped with one warning naming it and why.

        Raises:
            CheckpointError: there are checkpoints and none is usable.
        """
        found = self.checkpoints()
        for path in reversed(found):
            try:
                restore(path, self.load(path))
            except CheckpointError as error:
                logger.warning("skipping checkpoint %s: %s", error.path, error.reason)
                continue
            return path
        if found:
            raise CheckpointError(self.folder, f"none of its {len(found)} checkpoints is usable")
        return None


def check_folder(folder: str | Path) -> None:
    """Make sure checkpoints can be written in ``folder`` (created if missing): a node
    learns it before it trains, not at its first save.

    Raises:
        CheckpointError: the folder cannot be created or written (says why).
    """
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder, prefix=".write-check-"):
            pass
    except OSError as error:
        reason = error.strerror or _one_line(error)
        raise CheckpointError(folder, f"cannot write checkpoints there ({reason})") from error


def saved_run(folder: str | Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint in ``folder`` whose run configuration (``RunConfig.to_dict``
    as saved) can be read, with that configuration; None when no checkpoint has one.
    Reads ``state.json`` only: how a resume learns early which run a folder belongs to."""
    for path in reversed(CheckpointManager(folder).checkpoints()):
        try:
            tree = _read(path / STATE_FILE, lambda f: json.loads(f.read_text()))
            run = _read(path / STATE_FILE, functools.partial(_decode_run, tree))
        except (CheckpointError, KeyError, TypeError):
            continue
        if isinstance(run, dict):
            return path, run
    return None


def _decode_run(tree: Any, file: Path) -> Any:
    """The run configuration in a checkpoint's JSON tree (it holds no tensor)."""
    return _decode(tree["dict"]["run"], {}, set(), file)


def _encode(value: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    """``value`` as JSON data, its tensors moved into ``tensors`` under their path."""
    if isinstance(value, torch.Tensor):
        if path in tensors:
            raise TypeError(f"checkpoint state: two tensors at {path!r}")
        tensors[path] = value
        return {"tensor": path}
    if isinstance(value, tuple):
        return {"tuple": [_encode(v, f"{path}/{i}", tensors) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_encode(v, f"{path}/{i}", tensors) for i, v in enumerate(value)]
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value):
            return {"dict": {k: _encode(v, f"{path}/{k}", tensors) for k, v in value.items()}}
        if all(isinstance(k, int) and not isinstance(k, bool) for k in value):
            return {"items": [[k, _encode(v, f"{path}/{k}", tensors)] for k, v in value.items()]}
        raise TypeError(f"checkpoint state at {path!r}: keys must be all str or all int")
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise TypeError(f"checkpoint state at {path!r}: cannot store {type(value).__name__}")


def _read(file: Path, reader: Callable[[Path], T]) -> T:
    try:
        return reader(file)
    except RecursionError as error:  # JSON nested deeper than Python recurses
        raise CheckpointError(file, "malformed: nested too deeply") from error
    except (OSError, SafetensorError, ValueError) as error:
        raise CheckpointError(file, _one_line(error)) from error


def _decode(node: Any, tensors: dict[str, torch.Tensor], used: set[str], file: Path) -> Any:
    """Inverse of ``_encode``; anything else in the JSON is a damaged checkpoint."""
    if isinstance(node, list):
        return [_decode(v, tensors, used, file) for v in node]
    if not isinstance(node, dict):
        return node
    if len(node) != 1:
        raise CheckpointError(file, f"malformed: an object with keys {sorted(node)!r:.60}")
    ((tag, body),) = node.items()
    if tag == "tensor" and isinstance(body, str) and body in tensors:
        used.add(body)
        return tensors[body]
    if tag == "tuple" and isinstance(body, list):
        return tuple(_decode(v, tensors, used, file) for v in body)
    if tag == "dict" and isinstance(body, dict):
        return {k: _decode(v, tensors, used, file) for k, v in body.items()}
    if tag == "items" and isinstance(body, list):
        items = {}
        for item in body:
            if not (isinstance(item, list) and len(item) == 2 and type(item[0]) is int):
                raise CheckpointError(file, f"malformed: item {item!r:.60}")
            items[item[0]] = _decode(item[1], tensors, used, file)
        return items
    raise CheckpointError(file, f"malformed: a {tag!r:.30} entry")


def _unshared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors on the CPU, a copy of any that shares storage with an earlier one
    (safetensors refuses shared storage; a loaded checkpoint never shares anyway)."""
    seen: set[int] = set()
    out = {}
    for name, tensor in tensors.items():
        tensor = tensor.detach().cpu().contiguous()
        storage = tensor.untyped_storage().data_ptr()
        if storage in seen:
            tensor = tensor.clone()
        seen.add(storage)
        out[name] = tensor
    return out


def _one_line(error: BaseException) -> str:
    """The error's message on one line (safetensors' can span several)."""
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def export_weights(
    tensors: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str] | None = None
) -> None:
    """A plain safetensors file of weights, usable without this package."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(path), metadata=metadata
    )
