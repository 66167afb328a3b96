"""The staged runner's pure parts: which rounds are staged, the stage groups' records."""

from __future__ import annotations

import pytest
from hivemind.p2p import PeerID

from diloco.protocol.core.group import GroupInfo
from diloco.protocol.core.reducer import RoundKey
from diloco.protocol.staged.groups import grid_for, stage_group_id, stage_infos


def _group(n: int, clients: tuple[bool, ...] = ()) -> GroupInfo:
    members = tuple(
        sorted((PeerID(bytes([0, 4, 1, 2, i, 9])) for i in range(n)), key=PeerID.to_bytes)
    )
    return GroupInfo(
        key=RoundKey(3, 7),
        group_id=bytes(range(16)),
        members=members,
        weights=tuple(float(10 + i) for i in range(n)),
        numel=1000,
        codec_id=1,
        return_codec_id=1,
        clients=clients,
    )


def test_twelve_in_fours_are_three_cells_then_four_groups_of_three() -> None:
    group = _group(12)
    plan = grid_for(group, 4, max_weight=15.0)
    assert plan is not None and plan.shape == (4, 3)
    infos = stage_infos(group, plan)
    assert [len(stage) for stage in infos] == [3, 4]
    ids = {info.group_id for stage in infos for info in stage}
    assert len(ids) == 7 and group.group_id not in ids
    for stage in infos:  # every member in exactly one group per stage
        members = [m for info in stage for m in info.members]
        assert sorted(members, key=PeerID.to_bytes) == list(group.members)
    capped = [min(w, 15.0) for w in group.weights]
    for info in infos[0]:  # stage 0: each member's own capped weight
        assert info.weights == tuple(capped[group.index(m)] for m in info.members)
    cells = [[group.index(m) for m in info.members] for info in infos[0]]
    cell_weight = [sum(capped[i] for i in sorted(c, key=plan.order.index)) for c in cells]
    for info in infos[1]:  # stage 1: one member per cell, weighted by its cell's sum
        order = [next(k for k, c in enumerate(cells) if group.index(m) in c) for m in info.members]
        assert order == [0, 1, 2]
        assert info.weights == tuple(cell_weight)


@pytest.mark.parametrize(("n", "size"), [(4, 4), (3, 4), (10, 4), (5, 4)])
def test_small_or_uneven_groups_run_flat(n: int, size: int) -> None:
    assert grid_for(_group(n), size, max_weight=1e9) is None


def test_no_max_runs_flat_and_stage_ids_differ() -> None:
    assert grid_for(_group(12), None, max_weight=1e9) is None
    gid = bytes(16)
    assert len({stage_group_id(gid, s, g) for s in range(3) for g in range(4)}) == 12
    assert stage_group_id(gid, 0, 0) != stage_group_id(bytes([1]) + bytes(15), 0, 0)
