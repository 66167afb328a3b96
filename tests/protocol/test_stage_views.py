"""The views of a staged round's groups after a loss (``stage_views``), against a 3x4 plan
worked out by hand: which views may come, their weights and members, who stands in."""

from __future__ import annotations

from hivemind.p2p import PeerID

from diloco.protocol.core.group import GroupInfo
from diloco.protocol.core.reducer import RoundKey
from diloco.protocol.staged.grid import GridPlan, plan_grid
from diloco.protocol.staged.groups import stage_infos
from diloco.protocol.staged.views import (
    SlotView,
    candidate_views,
    stand_in_for,
    standing_views,
    view_group_id,
    view_info,
)

WEIGHTS = tuple(float(10 + 3 * i) for i in range(12))


def _round() -> tuple[GroupInfo, GridPlan]:
    members = tuple(
        sorted((PeerID(bytes([0, 4, 1, 2, i, 9])) for i in range(12)), key=PeerID.to_bytes)
    )
    group = GroupInfo(RoundKey(3, 7), bytes(range(16)), members, WEIGHTS, 1000, 1, 1)
    plan = plan_grid("3/7", [m.to_bytes() for m in members], WEIGHTS, 4)
    assert plan.shape == (4, 3)
    return group, plan


def test_candidate_views_by_count() -> None:
    _, plan = _round()
    me = plan.order[0]
    stage0 = candidate_views(plan, 0, me)
    assert [(v.slot, v.source, v.lost) for v in stage0] == [
        (k, None, (c,)) for k, c in enumerate(plan.group_of(me, 0).contributors) if c != me
    ]
    stage1 = candidate_views(plan, 1, me)
    # two other slots, each: its stand-in (lost in stage 1) + any one of its cell's 4 lost
    assert len(stage1) == 2 * (1 + 4)
    assert all(v.stage == 1 and v.source is not None for v in stage1)


def test_view_of_a_cell_short_of_one_member_weighs_the_other_three() -> None:
    group, plan = _round()
    infos = stage_infos(group, plan)
    me = plan.order[0]
    mine = plan.group_of(me, 1)
    info = next(i for i in infos[1] if i.members[0] == group.members[mine.contributors[0]])
    slot, contributor = 1, mine.contributors[1]
    cell = plan.order[4:8]  # the second cell of the line holds the slot's contributor
    assert contributor in cell
    lost = next(m for m in cell if m != contributor)
    seen = view_info(group, plan, WEIGHTS, info, SlotView(1, slot, contributor, (lost,)))
    assert seen.members == info.members
    assert seen.weights[slot] == sum(WEIGHTS[m] for m in cell) - WEIGHTS[lost]
    assert seen.weights[0] == info.weights[0] and seen.weights[2] == info.weights[2]
    assert seen.group_id == view_group_id(
        info.group_id, slot, group.members[contributor].to_bytes(), (lost,)
    )
    # the contributor itself lost: its stand-in takes the slot
    stand_in = stand_in_for(plan, 1, contributor)
    assert stand_in == cell[(cell.index(contributor) + 1) % 4]
    seen = view_info(group, plan, WEIGHTS, info, SlotView(1, slot, stand_in, (contributor,)))
    assert seen.members[slot] == group.members[stand_in]
    assert seen.weights[slot] == sum(WEIGHTS[m] for m in cell) - WEIGHTS[contributor]


def test_stage_0_view_drops_the_member_and_its_weight() -> None:
    group, plan = _round()
    infos = stage_infos(group, plan)
    info = infos[0][0]
    seen = view_info(group, plan, WEIGHTS, info, SlotView(0, 2, None, (99,)))
    assert seen.members == info.members[:2] + info.members[3:]
    assert seen.weights == info.weights[:2] + info.weights[3:]
    assert seen.group_id == view_group_id(info.group_id, 2, b"", (99,))


def test_a_member_stands_in_for_its_predecessor_in_the_cell() -> None:
    _, plan = _round()
    cell = plan.order[4:8]
    me = cell[0]
    predecessor = cell[3]  # wraps round
    slot = plan.group_of(predecessor, 1).contributors.index(predecessor)
    assert standing_views(plan, 1, me, ()) == [(predecessor, SlotView(1, slot, me, ()))]
    lost = (predecessor,)
    assert standing_views(plan, 1, me, lost) == [(predecessor, SlotView(1, slot, me, lost))]
    assert standing_views(plan, 1, me, (cell[1],)) == []  # not the lost one's stand-in
