"""The inner optimizer: AdamW (or plain SGD for the data-parallel oracle), with its schedule.

docs/design.md "Algorithm and schedule": linear warm-up and cosine decay to 10% over the run; betas
(0.9, 0.95); weight decay 0.1; gradient-norm clipping at 1.0. The inner state is never averaged and
never reset by a sync. The default peak (1e-3 after 30 steps) suits the small presets that the
CLI trains on a CPU in minutes; the paper's 4e-4 suits its 35M+ models. How a step is
computed (bf16 autocast, micro-batches) is the node's choice (``diloco.node.model.compute``) and
leaves this arithmetic as it is.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from diloco.errors import ConfigError
from diloco.node.data.corpus import BatchSampler
from diloco.node.model.compute import ComputeOptions, Precision, autocast


@dataclass(kw_only=True, slots=True)
class InnerConfig:
    """Local optimisation of every replica (docs/design.md "Algorithm and schedule")."""

    optimizer: Literal["adamw", "sgd"] = "adamw"
    """``adamw`` (the paper's), or ``sgd`` (plain, no momentum: the data-parallel oracle)."""
    lr: float = 1e-3
    """Peak learning rate (the paper: 4e-4)."""
    warmup_steps: int = 30
    """Linear warm-up length, in inner steps."""
    min_lr_ratio: float = 0.1
    """The cosine decays to this share of the peak at the last step."""
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    """Maximum global gradient norm; 0 disables clipping."""

    def __post_init__(self) -> None:
        if self.optimizer not in ("adamw", "sgd"):
            raise ConfigError(f"unknown inner optimizer {self.optimizer!r}; use adamw or sgd")
        if self.lr <= 0 or self.warmup_steps < 0 or self.grad_clip < 0:
            raise ConfigError(
                f"need lr > 0, warmup_steps >= 0 and grad_clip >= 0, got {self.lr}, "
                f"{self.warmup_steps}, {self.grad_clip}"
            )
        if not (0 <= self.min_lr_ratio <= 1 and self.weight_decay >= 0):
            raise ConfigError("need 0 <= min_lr_ratio <= 1 and weight_decay >= 0")
        if not all(0 <= beta < 1 for beta in self.betas):
            raise ConfigError(f"AdamW betas must be in [0, 1), got {self.betas}")


def lr_at(step: int, total_steps: int, config: InnerConfig) -> float:
    """Learning rate of inner step ``step`` (1-based): warm-up, then cosine to the floor."""
    if config.warmup_steps and step <= config.warmup_steps:
        return config.lr * step / config.warmup_steps
    span = max(1, total_steps - config.warmup_steps)
    progress = min(1.0, (step - config.warmup_steps) / span)
    floor = config.lr * config.min_lr_ratio
    return floor + 0.5 * (config.lr - floor) * (1 + math.cos(math.pi * progress))


def build_inner_optimizer(
    params: Iterable[nn.Parameter], config: InnerConfig
) -> torch.optim.Optimizer:
    """AdamW with decay on matrices only (nanoGPT's grouping), or plain SGD.

    AdamW is the fused kernel wherever torch has one for the parameters' device (CUDA, CPU
    and others): one kernel per step instead of a loop over tensors, about 9x faster on a
    CPU for the small preset. Elsewhere it falls back to torch's default implementation.
    """
    params = list(params)
    if config.optimizer == "sgd":
        return torch.optim.SGD(params, lr=config.lr)
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": config.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    try:
        return torch.optim.AdamW(groups, lr=config.lr, betas=config.betas, fused=True)
    except RuntimeError:  # no fused kernel for this device or dtype
        return torch.optim.AdamW(groups, lr=config.lr, betas=config.betas)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def inner_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: tuple[torch.Tensor, torch.Tensor],
    lr: float,
    grad_clip: float,
    *,
    precision: Precision = "fp32",
    micro_batch_size: int = 0,
) -> float:
    """One inner step (docs/design.md "Algorithm and schedule"): loss, backward, clip, AdamW/SGD
    update; returns the loss.

    The same function trains every replica of every trainer, so the inner loop is one piece
    of code whatever the transport of the outer loop. With ``micro_batch_size`` below the
    batch's, gradients accumulate over micro-batches, each loss weighted by its share of the
    batch's sequences: the loss is a mean over equally long sequences, so the summed
    gradients are the whole batch's, and clipping and the update see the same gradient.
    ``bf16`` runs the forward pass under autocast; weights and gradients stay FP32.
    """
    inputs, targets = batch  # (B, T) each
    optimizer.zero_grad(set_to_none=True)
    rows = inputs.size(0)
    size = micro_batch_size if 0 < micro_batch_size < rows else rows
    total = torch.zeros((), device=inputs.device)
    micro_batches = zip(torch.split(inputs, size), torch.split(targets, size), strict=True)
    for micro_inputs, micro_targets in micro_batches:
        with autocast(inputs.device.type, precision):
            _, loss = model(micro_inputs, micro_targets)
        if size != rows:
            loss = loss * (micro_inputs.size(0) / rows)
        loss.backward()
        total += loss.detach()
    if grad_clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    set_lr(optimizer, lr)
    optimizer.step()
    return float(total.item())


def sampled_inner_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    sampler: BatchSampler,
    rows: int,
    lr: float,
    config: InnerConfig,
    compute: ComputeOptions,
    device: torch.device | None = None,
) -> float:
    """One inner step on the first ``rows`` sequences of ``sampler``'s next batch, moved to
    ``device`` (None: where they are); returns the loss. The one inner-step body of every
    trainer: a swarm node's and each replica of ``local``.

    The sampler draws full batches whatever the rows: the data position stays a function of
    the step (a resumed run reads what an uninterrupted one would).
    """
    inputs, targets = sampler.next_batch()  # (B, T) each
    inputs, targets = inputs[:rows], targets[:rows]
    if device is not None:
        inputs, targets = inputs.to(device), targets.to(device)
    return inner_step(
        model,
        optimizer,
        (inputs, targets),
        lr,
        config.grad_clip,
        precision=compute.precision,
        micro_batch_size=compute.micro_batch_size,
    )
