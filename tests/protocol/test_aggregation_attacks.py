"""Aggregation attacks over the production runners, part servers and streams (in memory):
a member at the weight cap sending -50 times its delta, and a reducer whose own delta is
tiny (docs/design.md "Aggregation bounds"). Expected values come from
``InProcessReducer`` and projections worked out here in FP64."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from inprocess import Outcome, Round, delta_of, expected, names, run_round

from diloco.protocol.allreduce.member import AllReduceRunner

pytestmark = pytest.mark.clocked

NUMEL = 4_096
CAP = 2.0


class ReversingMember(AllReduceRunner):
    """Contributes -50 times its delta, everywhere (its own part included)."""

    def __init__(self, *, delta: torch.Tensor, **kwargs: Any) -> None:
        super().__init__(delta=delta * -50.0, **kwargs)


def _honest(m: int) -> list[torch.Tensor]:
    """``m - 1`` honest deltas: a shared direction plus noise of half its size per value."""
    generator = torch.Generator().manual_seed(m)
    base = torch.randn(NUMEL, generator=generator)
    return [(base + 0.5 * torch.randn(NUMEL, generator=generator)) * 1e-2 for _ in range(m - 1)]


@pytest.mark.parametrize("m", [2, 3, 5])
def test_member_at_the_cap_sending_minus_50x_does_not_reverse_the_honest_mean(m: int) -> None:
    honest = _honest(m)
    honest_mean = sum(d.double() for d in honest) / (m - 1)
    liar_delta = honest_mean.float()  # sent as -50 times it
    inputs, weights = [*honest, liar_delta], [1.0] * (m - 1) + [CAP]

    async def main() -> tuple[list[Outcome], Round]:
        types = [AllReduceRunner] * (m - 1) + [ReversingMember]
        round_ = Round(inputs, weights, types, max_weight=CAP)
        await round_.start()
        return await round_.outcomes(), round_

    outcomes, round_ = asyncio.run(main())
    result = delta_of(outcomes[0])
    for outcome in outcomes:  # the liar too: it gets what the group agreed
        assert torch.equal(delta_of(outcome), result)
        assert outcome.members == names(m)  # type: ignore[union-attr]
    sent = [*honest, liar_delta * -50.0]
    assert torch.equal(result, expected(sent, weights))
    projection = float(result.double() @ honest_mean / (honest_mean @ honest_mean))
    assert projection > 0 if m >= 3 else projection >= -1e-6, projection
    honest_members = set(range(m - 1))
    charged = {j for log in round_.offences[: m - 1] for j, _ in log}
    assert not charged & honest_members, round_.offences


def test_reducer_with_a_tiny_own_delta_counts_every_honest_chunk_and_charges_nobody() -> None:
    inputs = _honest(4)
    inputs[0] = inputs[0] * 1e-6  # a billion times under max_norm_ratio x the others
    weights = [1.0, 1.0, 1.0]
    outcomes, round_ = run_round(inputs, weights, [AllReduceRunner] * 3)
    want = expected(inputs, weights)
    for outcome in outcomes:
        assert torch.equal(delta_of(outcome), want)
        assert outcome.members == names(3)  # type: ignore[union-attr]
    assert round_.offences == [[], [], []]
