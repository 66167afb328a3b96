"""Bounded groups: members placed on a grid, a round run in stages. Pure.

With more members than ``max_group_size`` in a fragment round, one butterfly over all ``N``
costs every member ``N - 1`` streams and stalls on its slowest member. Moshpit SGD
(Ryabinin et al. 2021, section 3.1) places peers on a virtual ``d``-dimensional grid and
averages within groups along one dimension per stage; with a full grid, ``d`` stages give
the exact global average. This module plans that, identically on every member, from the
round's key and the declared members only.

**Cells.** Members are put in a line by ``placement_rank`` (sha256 of the round key and the
peer id: the same on every member, and no identity is placed first in every round). The
line is cut top-down into nested *cells* of consecutive positions: the whole line is the
level-``d`` cell, ``d`` the fewest stages with ``max_group_size ** d >= N``; a level-``r``
cell of ``c`` members splits into ``k = ceil(c / max_group_size ** (r - 1))`` sub-cells of
nearly equal size (sizes differ by at most one), each at most ``max_group_size ** (r - 1)``;
level-0 cells are single members. Hence ``k <= max_group_size`` at every level.

**Stages.** Stage ``s`` (0-based) runs inside each level-``s+1`` cell and combines its
level-``s`` sub-cells. After stage ``s - 1`` every member of a sub-cell holds the same
bytes (its sub-cell's mean), so one representative per sub-cell suffices: with ``m`` the
smallest sub-cell size, group ``j < m`` has as *contributors* the ``j``-th member of every
sub-cell, in sub-cell order, and as *receivers* the members beyond ``m`` (at most one per
sub-cell, as sizes differ by at most one), spread over the groups. A receiver holds the
same value as its sub-cell's contributor in that group, sends nothing and gets the result
(hivemind's client mode). On a full grid (``N = n ** d``, or any product of sides) there are
no receivers and a stage-``s`` group is exactly the members that share every coordinate but
``s`` (``GridPlan.coordinates``).

**Weights.** A contributor's weight in stage ``s`` is the carried weight of its sub-cell: the
sum of the (capped) weights of the members in it, summed in line order as Python floats, so
every member computes the same numbers from the declared weights and no weight travels as
a free value. By associativity, ``sum_i (W_i / W) * mean_i = sum_j (w_j / W) * x_j``: after
the last stage every member holds the global weighted mean, up to the codec's error added
in each stage (``staged``).

**Identical bytes.** Every group of one cell has the same number of contributors, the same
weights in the same order and the same input bytes, so a deterministic reduction (nearest
rounding) gives the same bytes in each; the last stage's cell is everyone.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

Span = tuple[int, int]
"""A cell: positions ``[start, end)`` of the line."""


def placement_rank(key: str, peer: bytes) -> bytes:
    """Where ``peer`` stands in the line of round ``key``: sha256(key | peer), lowest first."""
    return hashlib.sha256(key.encode() + b"|grid|" + peer).digest()


def num_stages(num_members: int, max_group_size: int) -> int:
    """``d``: the fewest stages with ``max_group_size ** d >= num_members`` (1 when flat)."""
    check_group_size(max_group_size)
    if num_members < 1:
        raise ValueError(f"need at least one member, got {num_members}")
    d = 1
    while max_group_size**d < num_members:
        d += 1
    return d


def check_group_size(max_group_size: int) -> None:
    if max_group_size < 2:
        raise ValueError(f"max_group_size must be >= 2, got {max_group_size}")


def split_even(span: Span, parts: int) -> list[Span]:
    """Cut ``span`` into ``parts`` consecutive spans whose sizes differ by at most one,
    the larger first."""
    start, end = span
    size, extra = divmod(end - start, parts)
    spans = []
    for i in range(parts):
        stop = start + size + (1 if i < extra else 0)
        spans.append((start, stop))
        start = stop
    return spans


@dataclass(frozen=True, slots=True)
class StageGroup:
    """One group of one stage; members are indices into the declared members."""

    stage: int
    contributors: tuple[int, ...]
    """One member per sub-cell, in sub-cell order: the order of the weighted sum."""
    weights: tuple[float, ...]
    """Carried weight of each contributor's sub-cell (sum of its members' weights)."""
    receivers: tuple[int, ...]
    """Members that get the result without contributing (their value is a contributor's)."""
    cell: Span
    """The level-``stage + 1`` cell (line positions) this group reduces in."""

    @property
    def members(self) -> tuple[int, ...]:
        return self.contributors + self.receivers


@dataclass(frozen=True, slots=True)
class GridPlan:
    """The placement and the stage plan of one round, identical on every member."""

    order: tuple[int, ...]
    """``order[position]``: the declared member at that position of the line."""
    max_group_size: int
    stages: tuple[tuple[StageGroup, ...], ...]
    """``stages[s]``: the groups of stage ``s``; every member is in exactly one."""
    coordinates: tuple[tuple[int, ...], ...]
    """Per declared member: index within its stage-``s`` sub-cell's parent, for each ``s``
    (``[0]``: its place in its stage-0 group)."""

    @property
    def num_members(self) -> int:
        return len(self.order)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def shape(self) -> tuple[int, ...]:
        """Most contributors of a group in each stage: ``(4, 3)`` for 12 members in 4s."""
        return tuple(max(len(g.contributors) for g in groups) for groups in self.stages)

    def group_of(self, member: int, stage: int) -> StageGroup:
        """The group of ``member`` in ``stage``."""
        for group in self.stages[stage]:
            if member in group.members:
                return group
        raise ValueError(f"member {member} is in no group of stage {stage}")


def _cell_levels(num_members: int, max_group_size: int, depth: int) -> list[list[Span]]:
    """``levels[r]``: the level-``r`` cells in line order, ``levels[depth]`` the whole line."""
    levels = [[(0, num_members)]]
    for r in range(depth, 0, -1):
        capacity = max_group_size ** (r - 1)
        below: list[Span] = []
        for start, end in levels[0]:
            below.extend(split_even((start, end), math.ceil((end - start) / capacity)))
        levels.insert(0, below)
    return levels


def plan_grid(
    key: str,
    peers: Sequence[bytes],
    weights: Sequence[float],
    max_group_size: int,
) -> GridPlan:
    """Place ``peers`` (declared members, with their capped weights) and plan the stages.

    Raises:
        ValueError: no members, duplicate peers, weights not one positive finite value per
            peer, or ``max_group_size < 2``.
    """
    if len(set(peers)) != len(peers):
        raise ValueError("duplicate peer ids")
    if len(weights) != len(peers) or not all(0 < w < math.inf for w in weights):
        raise ValueError("need one positive finite weight per peer")
    n = len(peers)
    depth = num_stages(n, max_group_size)
    order = tuple(sorted(range(n), key=lambda i: placement_rank(key, peers[i])))
    levels = _cell_levels(n, max_group_size, depth)
    # Carried weight of every cell, summed in line order.
    cell_weight: dict[Span, float] = {}
    for level in levels:
        for start, end in level:
            cell_weight[(start, end)] = sum(float(weights[order[p]]) for p in range(start, end))
    coordinates: list[list[int]] = [[] for _ in range(n)]
    stages: list[tuple[StageGroup, ...]] = []
    for s in range(depth):
        groups: list[StageGroup] = []
        subcells = iter(levels[s])
        for cell in levels[s + 1]:
            inside = [next(subcells)]
            while inside[-1][1] < cell[1]:
                inside.append(next(subcells))
            for index, (start, end) in enumerate(inside):
                for p in range(start, end):
                    coordinates[order[p]].append(index)
            m = min(end - start for start, end in inside)
            receivers: list[list[int]] = [[] for _ in range(m)]
            for i, (start, end) in enumerate(inside):
                for t in range(m, end - start):
                    receivers[(i + t) % m].append(order[start + t])
            weights_in = tuple(cell_weight[c] for c in inside)
            for j in range(m):
                groups.append(
                    StageGroup(
                        stage=s,
                        contributors=tuple(order[start + j] for start, _ in inside),
                        weights=weights_in,
                        receivers=tuple(receivers[j]),
                        cell=cell,
                    )
                )
        stages.append(tuple(groups))
    return GridPlan(
        order=order,
        max_group_size=max_group_size,
        stages=tuple(stages),
        coordinates=tuple(tuple(c) for c in coordinates),
    )
