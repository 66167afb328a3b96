"""The stage groups a staged round may run besides the plan's, when members are lost (issue
16, ``docs/staged.md``). Pure: no I/O.

A *view* changes one contributor slot of one stage group:

* **Stage 0, a member lost.** Its cell reruns without it (``source`` None): the survivors'
  parts, their declared weights; their value then counts every member of the cell but the
  lost one (the cell's *lost* set).
* **Stage ``s >= 1``, a slot whose sub-cell lost a member** (``lost``): the slot's weight is
  the sum of the capped weights of the members its value counts, in line order (the plan's
  when nobody is lost), and when the slot's own contributor is the lost one, the next
  member of its sub-cell in line order (``stand_in_for``) contributes the sub-cell's value
  in its place: the *stand-in*, holding the same bytes.

Each view has its own group id (``view_group_id``: the stage group's, the slot, the source
peer and the lost members), so members that see a loss differently stream under different
ids and fail rather than mix, and a view's id tells its receiver which weights it implies.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from diloco.protocol.core.group import GroupInfo
from diloco.protocol.staged.grid import GridPlan
from diloco.protocol.wire.frames import GROUP_ID_BYTES


@dataclass(frozen=True, slots=True)
class SlotView:
    """Contributor ``slot`` of a stage-``stage`` group, contributed by ``source`` (a declared
    index; None: dropped, stage 0 only), its value counting its sub-cell but ``lost``."""

    stage: int
    slot: int
    source: int | None
    lost: tuple[int, ...]


def view_group_id(group_id: bytes, slot: int, source: bytes, lost: Sequence[int]) -> bytes:
    """The id of stage group ``group_id`` with contributor ``slot`` changed: ``source`` (a
    peer id's bytes; empty: the slot dropped) in its place, counting its sub-cell but the
    declared members ``lost``."""
    data = (
        group_id
        + b"|view|"
        + struct.pack("!IH", slot, len(source))
        + source
        + struct.pack(f"!H{len(lost)}I", len(lost), *sorted(lost))
    )
    return hashlib.sha256(data).digest()[:GROUP_ID_BYTES]


def sub_cell(plan: GridPlan, stage: int, member: int) -> tuple[int, ...]:
    """The members holding ``member``'s value when stage ``stage`` >= 1 starts (its
    level-``stage`` cell), in line order."""
    start, end = plan.group_of(member, stage - 1).cell
    return plan.order[start:end]


def stand_in_for(plan: GridPlan, stage: int, member: int) -> int | None:
    """Who stands in for ``member`` lost before or in ``stage`` >= 1: the next member of
    its sub-cell in line order, wrapping round (``staged.staged_mean``'s rule when that one
    is live); None in stage 0 or a sub-cell of one."""
    if stage == 0:
        return None
    cell = sub_cell(plan, stage, member)
    if len(cell) == 1:
        return None
    return cell[(cell.index(member) + 1) % len(cell)]


def view_id(group: GroupInfo, info: GroupInfo, view: SlotView) -> bytes:
    """The group id of stage group ``info`` (of ``group``'s round) seen through ``view``:
    cheap, for the many views that never run (``view_info`` builds the one that does)."""
    source = b"" if view.source is None else group.members[view.source].to_bytes()
    return view_group_id(info.group_id, view.slot, source, view.lost)


def view_info(
    group: GroupInfo, plan: GridPlan, capped: Sequence[float], info: GroupInfo, view: SlotView
) -> GroupInfo:
    """Stage group ``info`` (of ``group``'s round, planned by ``plan``, members' weights
    ``capped``) seen through ``view``."""
    k = view.slot
    members, weights, clients = list(info.members), list(info.weights), list(info.clients)
    if view.source is None:
        del members[k], weights[k]
        if clients:
            del clients[k]
    else:
        planned = group.index(info.members[k])
        members[k] = group.members[view.source]
        if clients:
            clients[k] = group.is_client(view.source)
        if view.lost:
            cell = sub_cell(plan, view.stage, planned)
            weights[k] = sum(float(capped[m]) for m in cell if m not in view.lost)
    return dataclasses.replace(
        info,
        group_id=view_id(group, info, view),
        members=tuple(members),
        weights=tuple(weights),
        clients=tuple(clients),
    )


def candidate_views(plan: GridPlan, stage: int, member: int) -> list[SlotView]:
    """The views of ``member``'s stage-``stage`` group that another slot's loss may lead
    it to run: in stage 0, each other member dropped; later, for each other slot, its
    contributor stood in for (lost in this stage) or its sub-cell short of any one member
    (lost in an earlier stage; a stand-in for the contributor if it is the lost one)."""
    group = plan.group_of(member, stage)
    views = []
    for k, c in enumerate(group.contributors):
        if c == member:
            continue
        if stage == 0:
            views.append(SlotView(0, k, None, (c,)))
            continue
        stand_in = stand_in_for(plan, stage, c)
        if stand_in is not None:
            views.append(SlotView(stage, k, stand_in, ()))
        for lost in sub_cell(plan, stage, c):
            source = stand_in if lost == c else c
            if source is not None:
                views.append(SlotView(stage, k, source, (lost,)))
    return views


def standing_views(
    plan: GridPlan, stage: int, member: int, lost: tuple[int, ...]
) -> list[tuple[int, SlotView]]:
    """``(member whose slot it is, view)`` for the stage-``stage`` groups ``member`` stands in
    for when its sub-cell lost ``lost`` before: each member of its sub-cell whose stand-in it
    is (with ``lost`` empty: in case that one is lost in this stage)."""
    views = []
    for other in sub_cell(plan, stage, member):
        if other != member and stand_in_for(plan, stage, other) == member:
            if lost and other not in lost:
                continue
            slot = plan.group_of(other, stage).contributors.index(other)
            views.append((other, SlotView(stage, slot, member, lost)))
    return views
