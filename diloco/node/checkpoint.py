"""Checkpoints on disk: atomic, resumable, and an export of the outer weights.

Shaped like torchtitan's ``BaseCheckpointManager``: the public methods hold the guards
(atomic rename, retention, a failed write that loses nothing), the payload is the trainer's
``state_dict``. A checkpoint is a folder ``step_000120/`` holding

- ``model.safetensors``: the live weights (theta);
- ``outer.safetensors``: per fragment ``frag{p}.outer`` and ``frag{p}.momentum`` (FP32);
- ``state.pt``: inner optimizer, data position, RNG states, step, fragment versions, configs.

A save is written into a hidden temporary folder and renamed into place, so a crash or a
full disk mid-save leaves the previous checkpoint intact.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

logger = logging.getLogger(__name__)

CHECKPOINT_PREFIX = "step_"


class CheckpointManager:
    """Saves and loads checkpoints under ``folder``, keeping the newest ``keep``."""

    def __init__(self, folder: str | Path, keep: int = 2) -> None:
        self.folder = Path(folder)
        self.keep = keep

    def save(
        self,
        step: int,
        model: dict[str, torch.Tensor],
        outer: dict[str, torch.Tensor],
        state: dict[str, Any],
    ) -> Path | None:
        """Write one checkpoint; returns its path, or None if the disk refused (logged)."""
        final = self.folder / f"{CHECKPOINT_PREFIX}{step:09d}"
        temporary = self.folder / f".tmp-{final.name}-{os.getpid()}"
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(temporary, ignore_errors=True)
            temporary.mkdir()
            save_file(
                {k: v.detach().contiguous().cpu() for k, v in model.items()},
                str(temporary / "model.safetensors"),
            )
            save_file(
                {k: v.contiguous() for k, v in outer.items()}, str(temporary / "outer.safetensors")
            )
            torch.save(state, temporary / "state.pt")
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
        """Complete checkpoints, oldest first."""
        if not self.folder.exists():
            return []
        return sorted(
            p for p in self.folder.iterdir() if p.is_dir() and p.name.startswith(CHECKPOINT_PREFIX)
        )

    def latest(self) -> Path | None:
        found = self.checkpoints()
        return found[-1] if found else None

    @staticmethod
    def load(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, Any]]:
        """Model tensors, outer tensors and the rest of a checkpoint folder."""
        model = load_file(str(path / "model.safetensors"))
        outer = load_file(str(path / "outer.safetensors"))
        state = torch.load(path / "state.pt", weights_only=False)
        return model, outer, state


def export_weights(
    tensors: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str] | None = None
) -> None:
    """A plain safetensors file of weights, usable without this package."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(path), metadata=metadata
    )
