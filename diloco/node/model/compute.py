"""How one node computes its inner steps: precision, micro-batches, compilation, backends.

These are a volunteer's choices for their own hardware, not part of the run: whatever they
pick, the replica trains the same model with the same inner optimizer, its master weights
and optimizer state stay FP32, and the outer loop (outer parameters, momentum, outer
gradients) is FP32 and untouched (docs/design.md "Algorithm and schedule"), so the outer sync is
unchanged in kind.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from diloco.errors import ConfigError

logger = logging.getLogger(__name__)

Precision = Literal["fp32", "bf16"]


@dataclass(kw_only=True, slots=True)
class ComputeOptions:
    """Per-node compute settings of the inner step (none of them changes the run's math)."""

    precision: Precision = "fp32"
    """``bf16``: forward and loss under ``torch.autocast`` (bf16 matmuls; FP32 weights,
    gradients, optimizer state, norms and softmax); ``fp32``: no autocast."""
    micro_batch_size: int = 0
    """Sequences per forward/backward pass; an inner step accumulates gradients over
    ``ceil(batch_size / micro_batch_size)`` of them. 0: the whole batch in one pass."""
    compile: bool = False
    """Compile the model with ``torch.compile`` (in place: parameter names stay the same)."""
    tf32: bool = True
    """Let FP32 matmuls use TF32 tensor cores on CUDA (Ampere and newer); ignored elsewhere."""

    def __post_init__(self) -> None:
        if self.precision not in ("fp32", "bf16"):
            raise ConfigError(f"unknown precision {self.precision!r}; use fp32 or bf16")
        if self.micro_batch_size < 0:
            raise ConfigError(
                f"micro_batch_size must be >= 0 (0: no accumulation), got {self.micro_batch_size}"
            )


def autocast(
    device_type: str, precision: Precision
) -> torch.autocast | contextlib.nullcontext[None]:
    """The context of one forward pass: bf16 autocast, or nothing for FP32."""
    if precision == "bf16":
        return torch.autocast(device_type=device_type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def configure_backends(device: torch.device, tf32: bool) -> None:
    """Process-wide matmul settings for ``device``: TF32 on CUDA when asked.

    ``set_float32_matmul_precision`` is global, so it is set only for CUDA, where "high"
    means TF32; on a CPU it could select other reduced-precision kernels.
    """
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high" if tf32 else "highest")


def compile_model(model: nn.Module, backend: str = "inductor") -> None:
    """Compile ``model``'s forward in place (``nn.Module.compile``).

    In place rather than ``torch.compile(model)``, whose wrapper renames every parameter
    (``_orig_mod.``) and would break fragments, checkpoints and exports. The first steps
    are slow while the graph compiles.
    """
    logger.info("compiling the model with torch.compile (backend %s)", backend)
    model.compile(backend=backend)
