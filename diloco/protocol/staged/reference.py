"""The in-process reducer following a ``GridPlan``'s stages. Pure.

Every group of every stage is reduced on its own, as ``InProcessReducer`` reduces (the
reference of the wire path, docs/design.md "The round": parts encoded with the run's codec, FP32
weighted mean in group order, the mean encoded once with the return codec and decoded by every
member), with the plan's contributors and carried weights. Each group is computed separately, as
the swarm would, so that ``StagedResult.values`` shows whether every member ends with the
same bytes rather than assuming it.

**Lost members** (``lost``, the rule of ``docs/allreduce.md`` "Staged rounds"): a member
lost in stage ``s`` is counted by no reducer of that stage (it died before its first chunk
arrived anywhere, or every reducer excluded it). Its stage-``s`` group still cuts the
vector into the parts of all its contributors (the wire's partition is fixed by the
group; a dead reducer's part is re-reduced by its substitute) and counts the others,
weights renormalised over them, except in stage 0, where its cell reruns without it (the
wire's ``stage_views``: the survivors' parts). Its own delta is thus counted nowhere. From
stage 1 on, the value it would have contributed is its sub-cell's mean, which every live
member of that sub-cell holds: the next live member of the sub-cell in line order (after
the lost one, wrapping round) *stands in* for it, with the sub-cell's value, counted set
and weight (the sum of the counted members' weights, in line order: no weight travels
as a free value). A sub-cell with no live member is counted nowhere. Without losses the
weights are exactly the plan's.

Error: each stage encodes its inputs with the codec and its mean with the return codec, so
a ``d``-stage round adds up to ``d`` times the encodings of a flat one; the values entering
stage ``s >= 1`` are already means (smaller spread), and their re-encoding adds an error
relative to that stage's mean (measured in ``benchmarks/staged_error.py``). A stage-``s``
group with one contributor exchanges nothing: its members already hold that value.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from diloco.codecs import Codec
from diloco.protocol.core.aggregation import CLIP_FACTOR, check_clip_factor, robust_mean
from diloco.protocol.core.partition import butterfly_parts
from diloco.protocol.core.round import chunk_spans
from diloco.protocol.staged.grid import GridPlan, Span


@dataclass(frozen=True, slots=True)
class StagedResult:
    """What the stages left with every member, and on the way."""

    values: tuple[torch.Tensor, ...]
    """Per declared member, the decoded result its last-stage group gave it (a lost member:
    what it held when it was lost)."""
    cell_means: tuple[tuple[tuple[Span, torch.Tensor], ...], ...]
    """Per stage, per level-``s+1`` cell: the value its first group produced."""
    bytes_sent: tuple[int, ...]
    """Per stage: encoded bytes all counted contributors sent (both butterfly phases);
    receivers send nothing."""
    counted: tuple[frozenset[int], ...] = ()
    """Per declared member, the members whose deltas its value counts."""
    stand_ins: tuple[tuple[tuple[int, int], ...], ...] = ()
    """Per stage, ``(lost contributor, the member standing in for it)`` pairs."""


@dataclass(frozen=True, slots=True)
class _Slot:
    """One contributor's input to a stage group: a value, its weight, whom it counts."""

    value: torch.Tensor
    weight: float
    counted: frozenset[int]


def _masked_mean(
    slots: Sequence[_Slot | None],
    codec: Codec,
    return_codec: Codec,
    clip_factor: float,
) -> tuple[torch.Tensor, int]:
    """``InProcessReducer``'s reduction of one group whose absent contributors (None) are
    counted in no part: the parts are those of the whole group. Also the bytes sent."""
    present = [(i, s) for i, s in enumerate(slots) if s is not None]
    numel = present[0][1].value.numel()
    weights = [s.weight for _, s in present]
    result = torch.empty(numel, dtype=torch.float32)
    sent = 0
    for reducer, (lo, hi) in enumerate(butterfly_parts(numel, len(slots))):
        decoded = []
        for member, slot in present:
            payload = codec.encode(slot.value[lo:hi].contiguous())
            decoded.append(codec.decode(payload))
            sent += len(payload) if member != reducer else 0
        mean = torch.empty(hi - lo, dtype=torch.float32)
        for a, b in chunk_spans(lo, hi) if hi > lo else []:
            chunk = [d[a - lo : b - lo] for d in decoded]
            mean[a - lo : b - lo] = robust_mean(chunk, weights, clip_factor).mean
        averaged = return_codec.encode(mean)
        result[lo:hi] = return_codec.decode(averaged)
        sent += len(averaged) * sum(1 for member, _ in present if member != reducer)
    return result, sent


def _source(plan: GridPlan, stage: int, member: int, live: set[int]) -> int | None:
    """Who contributes ``member``'s slot in ``stage``: itself while live, else the next
    live member of its sub-cell in line order (wrapping round); None when there is none
    (in stage 0 a member's sub-cell is itself)."""
    if member in live:
        return member
    if stage == 0:
        return None
    start, end = plan.group_of(member, stage - 1).cell
    p = plan.order.index(member)
    for q in [*range(p + 1, end), *range(start, p)]:
        candidate: int = plan.order[q]
        if candidate in live:
            return candidate
    return None


def _slot(
    held: Sequence[torch.Tensor],
    counted: Sequence[frozenset[int]],
    weight: Mapping[int, float],
    position: Mapping[int, int],
    source: int,
) -> _Slot:
    """``source``'s input: its value, and the weights of the members it counts summed in
    line order (the plan's sub-cell weight when it counts them all)."""
    members = sorted(counted[source], key=position.__getitem__)
    return _Slot(held[source], sum(weight[m] for m in members), counted[source])


def staged_mean(
    plan: GridPlan,
    deltas: Sequence[torch.Tensor],
    codec: Codec,
    return_codec: Codec | None = None,
    *,
    clip_factor: float = CLIP_FACTOR,
    lost: Mapping[int, int] | None = None,
) -> StagedResult:
    """Reduce ``deltas`` (one FP32 1-D vector per declared member) along ``plan``.

    Weights are the plan's carried weights (capped when the plan was made); every stage
    applies the same ``clip_factor`` to its contributors, which from stage 1 on are the
    sub-cells' means. ``lost`` maps a member to the stage it is lost in (module docstring).

    Raises:
        ValueError: not one delta per member, deltas of different lengths, or a lost
            member or stage that is not in the plan.
    """
    if len(deltas) != plan.num_members:
        raise ValueError(f"{len(deltas)} deltas for {plan.num_members} members")
    if len({d.numel() for d in deltas}) != 1:
        raise ValueError("deltas of different lengths")
    lost = dict(lost or {})
    if any(not (0 <= m < plan.num_members and 0 <= s < plan.num_stages) for m, s in lost.items()):
        raise ValueError(f"lost members {lost} not in a plan of {plan.num_members} members")
    check_clip_factor(clip_factor)
    weight = {m: w for g in plan.stages[0] for m, w in zip(g.contributors, g.weights, strict=True)}
    position = {m: p for p, m in enumerate(plan.order)}
    held: list[torch.Tensor] = list(deltas)
    counted = [frozenset({m}) for m in range(plan.num_members)]
    cell_means: list[tuple[tuple[Span, torch.Tensor], ...]] = []
    bytes_sent: list[int] = []
    stand_ins: list[tuple[tuple[int, int], ...]] = []
    for s, groups in enumerate(plan.stages):
        live = {m for m in range(plan.num_members) if lost.get(m, plan.num_stages) > s}
        after, counted_after = list(held), list(counted)
        cells: dict[Span, torch.Tensor] = {}
        sent, standing = 0, []
        for group in groups:
            slots: list[_Slot | None] = []
            for member in group.contributors:
                source = _source(plan, s, member, live)
                if source is not None and source != member:
                    standing.append((member, source))
                slot = None if source is None else _slot(held, counted, weight, position, source)
                slots.append(slot)
            present = [slot for slot in slots if slot is not None]
            if not present:  # every member of its cell is lost
                continue
            if s == 0:  # the cell reruns without its lost members: the survivors' parts
                slots = list(present)
            if s > 0 and len(slots) == 1:
                value = present[0].value
            else:
                value, group_sent = _masked_mean(slots, codec, return_codec or codec, clip_factor)
                sent += group_sent
            union = frozenset().union(*(slot.counted for slot in present))
            for member in group.members:
                if member in live:
                    after[member], counted_after[member] = value, union
            cells.setdefault(group.cell, value)
        held, counted = after, counted_after
        cell_means.append(tuple(cells.items()))
        bytes_sent.append(sent)
        stand_ins.append(tuple(standing))
    return StagedResult(
        tuple(held), tuple(cell_means), tuple(bytes_sent), tuple(counted), tuple(stand_ins)
    )
