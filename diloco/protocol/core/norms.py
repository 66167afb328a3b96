"""The norms a reducer reports in its AVERAGED chunks and members check (``verification``).

Two machines must agree on them to ``verification.NORM_TOLERANCE`` (relative) whatever
order they sum in, so squares are summed in FP64; blocks of ``BLOCK_VALUES`` values are
the unit of block norms and of sampled checks. Pure.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from diloco.protocol.core.partition import PART_ALIGN

Span = tuple[int, int]

FLOAT32_MAX = float(torch.finfo(torch.float32).max)
BLOCK_VALUES = PART_ALIGN
"""Values per block of a chunk's block norms and of verification samples: a multiple of
every codec's block, so a block encodes alone to the values it has in its chunk."""


def chunk_norm(x: torch.Tensor) -> float:
    """The L2 norm of an FP32 vector as reducers report it (AVERAGED) and members check it:
    FP32 squares (each rounded once) summed in FP64, so two machines that sum in another
    order agree to about ``1e-12`` relative (FP32 sums of ``2**18`` squares differ by up to
    ``1e-5``); all in FP64 where FP32 squares would underflow or overflow. Not finite iff a
    value is not."""
    squares = float(torch.sum(x * x, dtype=torch.float64))
    if 1e-20 < squares < math.inf:
        return math.sqrt(squares)
    return float(torch.linalg.vector_norm(x, dtype=torch.float64))


def check_reference(norms: Sequence[float]) -> float:
    """The reference of the norm checks (docs/design.md "Aggregation bounds"): the *upper*
    median of the counted members' norms, ``sorted(norms)[m // 2]`` (0 when none). One
    member cannot pull it under the others' smallest norm (with two members it is the
    larger), so a member with a tiny delta, reducer or not, gets no honest value refused;
    raising it only loosens a sanity check that clipping backs up."""
    return sorted(norms)[len(norms) // 2] if norms else 0.0


def num_blocks(span: Span) -> int:
    """Blocks of ``BLOCK_VALUES`` in a span (the last one may be short)."""
    return -(-(span[1] - span[0]) // BLOCK_VALUES)


def block_norms(x: torch.Tensor) -> tuple[float, ...]:
    """``chunk_norm`` of ``x`` over each ``BLOCK_VALUES`` values, as FP32 travels them
    (at most the largest FP32)."""
    blocks = num_blocks((0, x.numel()))
    padded = x
    if x.numel() != blocks * BLOCK_VALUES:
        padded = torch.zeros(blocks * BLOCK_VALUES)
        padded[: x.numel()] = x
    squares = (padded * padded).view(blocks, BLOCK_VALUES).sum(dim=1, dtype=torch.float64)
    exact = ~((squares > 1e-20) & (squares < math.inf))
    if bool(exact.any()):  # as chunk_norm: FP64 where FP32 squares underflow or overflow
        values = padded.reshape(blocks, BLOCK_VALUES)[exact].double()
        squares[exact] = values.square().sum(dim=1)
    return tuple(squares.sqrt_().clamp_(max=FLOAT32_MAX).tolist())
