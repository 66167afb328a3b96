"""The stage groups of a staged round: their ids and ``GroupInfo`` from the round's GROUP
and its grid plan, the same on every member (``runner`` runs them, ``views`` derives the
groups run when a member is lost)."""

from __future__ import annotations

import hashlib
import struct

from diloco.protocol.core.aggregation import cap_weights
from diloco.protocol.core.group import GroupInfo
from diloco.protocol.core.reducer import RoundKey
from diloco.protocol.staged.grid import GridPlan, plan_grid
from diloco.protocol.wire.frames import GROUP_ID_BYTES


def stage_group_id(group_id: bytes, stage: int, index: int) -> bytes:
    """The id of group ``index`` of stage ``stage`` of the round whose GROUP id is
    ``group_id``: what the PART, REPORT and CHECK heads of that stage group carry."""
    data = group_id + b"|stage|" + struct.pack("!II", stage, index)
    return hashlib.sha256(data).digest()[:GROUP_ID_BYTES]


def round_text(key: RoundKey) -> str:
    """The key a round's grid is placed by: its fragment and round, known to every member
    before the GROUP, so no leader can draw group ids until colluders share a cell."""
    return f"{key.fragment}/{key.round}"


def grid_for(group: GroupInfo, max_group_size: int | None, max_weight: float) -> GridPlan | None:
    """The grid of ``group``'s round, or None when it runs flat: no ``max_group_size``, a
    group within it, or a plan the wire does not follow yet (a receiver, a single-member
    stage-0 cell, a stage group of clients only)."""
    if max_group_size is None or len(group.members) <= max_group_size:
        return None
    weights = cap_weights(group.weights, max_weight)
    peers = [peer.to_bytes() for peer in group.members]
    plan = plan_grid(round_text(group.key), peers, weights, max_group_size)
    for s, groups in enumerate(plan.stages):
        for g in groups:
            lone = s == 0 and len(g.contributors) == 1
            clients = len(g.contributors) > 1 and all(map(group.is_client, g.contributors))
            if g.receivers or lone or clients:
                return None
    return plan


def stage_infos(group: GroupInfo, plan: GridPlan) -> tuple[tuple[GroupInfo, ...], ...]:
    """Per stage, per group of the plan: its ``GroupInfo`` (members in the plan's
    contributor order, the order of the weighted sum; weights the carried ones)."""
    return tuple(
        tuple(
            GroupInfo(
                key=group.key,
                group_id=stage_group_id(group.group_id, s, g),
                members=tuple(group.members[i] for i in sg.contributors),
                weights=sg.weights,
                numel=group.numel,
                codec_id=group.codec_id,
                return_codec_id=group.return_codec_id,
                clients=tuple(group.is_client(i) for i in sg.contributors) if group.clients else (),
            )
            for g, sg in enumerate(groups)
        )
        for s, groups in enumerate(plan.stages)
    )
