"""The arithmetic of one outer step on flat FP32 vectors (docs/design.md "Algorithm and schedule"
steps 4-5).

Kept apart from ``outer.FragmentSync`` (which decides when to run it) so that every
transport and the device link apply the very same float operations in the same order:
the bit-identity of members' outer states (docs/design.md "Algorithm and schedule") rests on these
few lines.
"""

from __future__ import annotations

import torch
from torch import nn


def nesterov_step(
    outer: torch.Tensor, momentum: torch.Tensor, delta: torch.Tensor, lr: float, mu: float
) -> None:
    """SGD with Nesterov momentum on the outer gradient, in place (docs/design.md "Algorithm and
    schedule" step 4).

    ``mom = mu * mom + delta``; ``outer = outer - lr * (delta + mu * mom)``.
    """
    momentum.mul_(mu).add_(delta)
    outer.sub_(delta.add(momentum, alpha=mu), alpha=lr)


def merge(live: torch.Tensor, new_outer: torch.Tensor, alpha: float) -> torch.Tensor:
    """``alpha * live + (1 - alpha) * new_outer`` (docs/design.md "Algorithm and schedule" step 5),
    exact at alpha 0 and 1."""
    if alpha == 0:
        return new_outer.clone()
    if alpha == 1:
        return live
    return live * alpha + new_outer * (1 - alpha)


def flatten(params: list[tuple[str, nn.Parameter]]) -> torch.Tensor:
    """The fragment's live weights as one FP32 CPU vector."""
    return torch.cat([p.detach().reshape(-1).to("cpu", torch.float32) for _, p in params])


def assign(params: list[tuple[str, nn.Parameter]], vector: torch.Tensor) -> None:
    """Write a flat FP32 vector back into the fragment's parameters."""
    offset = 0
    with torch.no_grad():
        for _, p in params:
            n = p.numel()
            p.copy_(vector[offset : offset + n].view_as(p))
            offset += n
