"""The in-process reducer following a ``GridPlan``'s stages (issue 16). Pure.

Every group of every stage is reduced on its own by ``InProcessReducer``, the reference of
the wire path (SPEC 4: parts encoded with the run's codec, FP32 weighted mean in group
order, the mean encoded once with the return codec and decoded by every member), with the
plan's contributors and carried weights. Each group is computed separately, as the swarm
would, so that ``StagedResult.values`` shows whether every member ends with the same bytes
rather than assuming it.

Error: each stage encodes its inputs with the codec and its mean with the return codec, so
a ``d``-stage round adds up to ``d`` times the encodings of a flat one; the values entering
stage ``s >= 1`` are already means (smaller spread), and their re-encoding adds an error
relative to that stage's mean (measured in ``benchmarks/staged_error.py``). A stage-``s``
group with one contributor exchanges nothing: its members already hold that value.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from diloco.codecs import Codec
from diloco.protocol.aggregation import CLIP_FACTOR
from diloco.protocol.grid import GridPlan, Span
from diloco.protocol.reducer import Contribution, InProcessReducer, RoundKey


@dataclass(frozen=True, slots=True)
class StagedResult:
    """What the stages left with every member, and on the way."""

    values: tuple[torch.Tensor, ...]
    """Per declared member, the decoded result its last-stage group gave it."""
    cell_means: tuple[tuple[tuple[Span, torch.Tensor], ...], ...]
    """Per stage, per level-``s+1`` cell: the value its first group produced."""
    bytes_sent: tuple[int, ...]
    """Per stage: encoded bytes all contributors sent (both butterfly phases); receivers
    send nothing."""


def staged_mean(
    plan: GridPlan,
    deltas: Sequence[torch.Tensor],
    codec: Codec,
    return_codec: Codec | None = None,
    *,
    clip_factor: float = CLIP_FACTOR,
) -> StagedResult:
    """Reduce ``deltas`` (one FP32 1-D vector per declared member) along ``plan``.

    Weights are the plan's carried weights (capped when the plan was made); every stage
    applies the same ``clip_factor`` to its contributors, which from stage 1 on are the
    sub-cells' means.

    Raises:
        ValueError: not one delta per member, or deltas of different lengths.
    """
    if len(deltas) != plan.num_members:
        raise ValueError(f"{len(deltas)} deltas for {plan.num_members} members")
    if len({d.numel() for d in deltas}) != 1:
        raise ValueError("deltas of different lengths")
    reducer = InProcessReducer(codec, return_codec, max_weight=math.inf, clip_factor=clip_factor)
    held: list[torch.Tensor] = list(deltas)
    cell_means: list[tuple[tuple[Span, torch.Tensor], ...]] = []
    bytes_sent: list[int] = []
    for s, groups in enumerate(plan.stages):
        after = list(held)
        cells: dict[Span, torch.Tensor] = {}
        sent = 0
        for group in groups:
            if s > 0 and len(group.contributors) == 1:
                value = held[group.contributors[0]]
            else:
                contributions = [
                    Contribution(str(i), held[i], w)
                    for i, w in zip(group.contributors, group.weights, strict=True)
                ]
                result = reducer.reduce(RoundKey(0, s), contributions).result()
                value = result.delta
                sent += result.bytes_sent * len(contributions)
            for member in group.members:
                after[member] = value
            cells.setdefault(group.cell, value)
        held = after
        cell_means.append(tuple(cells.items()))
        bytes_sent.append(sent)
    return StagedResult(tuple(held), tuple(cell_means), tuple(bytes_sent))
