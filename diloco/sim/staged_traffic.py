"""Bytes and streams per peer of a staged all-reduce, from the stage plan. Pure.

Cost model per stage group (``diloco.protocol.staged.grid``: ``M`` contributors, ``R`` receivers,
a vector of ``n`` values at ``b`` bits, equal butterfly parts of ``S = n * b / 8 / M``
bytes): a contributor opens one stream to each of the other ``M - 1`` reducers, sends its
``M - 1`` parts there, and as a reducer sends its averaged part to ``M - 1 + R`` members, so
it sends ``(2M - 2 + R) * S`` and receives ``(M - 1) * S`` twice (parts in, averages back);
a receiver opens ``M`` streams, sends nothing and receives ``M * S``. A one-contributor group
of a later stage exchanges nothing. A flat round is one stage: ``2(M - 1)/M * n * b / 8``,
``diloco.node.observe.traffic.all_reduce_bytes``. ``d`` stages cost about ``d`` times a flat round's
bytes, for ``sum_s (M_s - 1)`` streams instead of ``N - 1`` and latency terms per stage.
"""

from __future__ import annotations

from dataclasses import dataclass

from diloco.protocol.staged.grid import GridPlan, plan_grid


@dataclass(frozen=True, kw_only=True, slots=True)
class StagedTraffic:
    """Per-peer cost of one round, averaged over the members (and the busiest member)."""

    num_stages: int
    shape: tuple[int, ...]
    bytes_sent: float
    """Mean bytes a member sends in one round, all stages."""
    bytes_received: float
    max_bytes_sent: float
    streams: float
    """Mean streams a member opens in one round (each carries parts out and averages back)."""
    max_streams: int
    stage_bytes_sent: tuple[float, ...]
    """Mean bytes a member sends in each stage."""


def plan_traffic(plan: GridPlan, num_values: float, bits: float) -> StagedTraffic:
    """What each member of ``plan`` sends, receives and opens, per the module's model."""
    n = plan.num_members
    sent = [0.0] * n
    received = [0.0] * n
    streams = [0] * n
    stage_sent = []
    for s, groups in enumerate(plan.stages):
        before = sum(sent)
        for group in groups:
            m, r = len(group.contributors), len(group.receivers)
            if s > 0 and m == 1:
                continue
            part = num_values * bits / 8 / m
            for i in group.contributors:
                sent[i] += (2 * m - 2 + r) * part
                received[i] += 2 * (m - 1) * part
                streams[i] += m - 1
            for i in group.receivers:
                received[i] += m * part
                streams[i] += m
        stage_sent.append((sum(sent) - before) / n)
    return StagedTraffic(
        num_stages=plan.num_stages,
        shape=plan.shape,
        bytes_sent=sum(sent) / n,
        bytes_received=sum(received) / n,
        max_bytes_sent=max(sent),
        streams=sum(streams) / n,
        max_streams=max(streams),
        stage_bytes_sent=tuple(stage_sent),
    )


def staged_traffic(
    num_values: float, bits: float, num_members: int, max_group_size: int | None
) -> StagedTraffic:
    """``plan_traffic`` for ``num_members`` equal-weight members (``None``: one flat group)."""
    peers = [i.to_bytes(4, "big") for i in range(num_members)]
    size = max(num_members, 2) if max_group_size is None else max_group_size
    return plan_traffic(plan_grid("traffic", peers, [1.0] * num_members, size), num_values, bits)
