"""A member that joins the group and sends no PART (``faults.SilentSender``): every honest
reducer drops it once it served its own part (with two members too, where no majority
bounds the wait), or once most of its part's contributions have started; charges it an offence
once the sender deadline passed without it, and after repeated offences bans it, so no
group admits it any more; a member that is only late is dropped too but not charged
(docs/design.md "Liveness"). Production runners over in-memory streams (``inprocess``),
then production matchmakers over an in-memory DHT with the ban lists those rounds left."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch
from faults import SilentSender
from hivemind.p2p import PeerID
from inprocess import (
    TIMEOUTS,
    Outcome,
    RecordingBans,
    Round,
    SteppedClock,
    delta_of,
    deltas,
    expected,
    member_id,
    names,
)
from memory_dht import MemoryDHT, Table
from memory_p2p import MemoryNetwork, make_identity

from diloco.errors import RoundFailed
from diloco.protocol.allreduce.member import AllReduceRunner
from diloco.protocol.core.adaptive import start_bound
from diloco.protocol.core.group import GroupInfo, RoundTimeouts
from diloco.protocol.core.partition import butterfly_parts
from diloco.protocol.core.reducer import RoundKey
from diloco.protocol.matchmaking.matchmaker import Matchmaker
from diloco.protocol.trust.bans import BAN_OFFENCES, SILENCE_SPAN

pytestmark = pytest.mark.clocked

MEMBERS, SILENT = 3, 2
WEIGHTS = [1.0, 2.0, 1.0]
FAST = dataclasses.replace(TIMEOUTS, sender_timeout=2.0, connect_timeout=1.0)
"""A short sender window: silent members are charged at its end, which the tests' clock
(``SteppedClock``) passes at once before they read the offences."""


class LateSender(AllReduceRunner):
    """Honest but late: sends its contributions once the other reducers closed their
    gathers (without it)."""

    async def _exchange(self, j: int) -> None:
        others = [r for r in self.round.runners if r is not self]  # type: ignore[attr-defined]
        while not all(r.server.reducer.gather_closed for r in others):
            await asyncio.sleep(0.01)
        await super()._exchange(j)


def _round(
    inputs: list[torch.Tensor], types: list[type[AllReduceRunner]], bans: list[RecordingBans]
) -> tuple[list[Outcome], Round]:
    """One round, and then its clock moved past its sender window (offences are charged
    then)."""

    async def main() -> tuple[list[Outcome], Round]:
        clock = SteppedClock()
        round_ = Round(inputs, WEIGHTS, types, timeouts=FAST, bans=bans, clip_factor=0, clock=clock)
        await round_.start()
        outcomes = await round_.outcomes()
        clock.advance(max(r.deadlines.gather for r in round_.runners))
        return outcomes, round_

    return asyncio.run(main())


def _without_silent(inputs: list[torch.Tensor]) -> torch.Tensor:
    """What the honest members must get: the silent member counted only in its own part
    (codec ``none``, one chunk per part, no clipping: each value depends only on who is
    averaged, as the plain weighted mean)."""
    honest = [i for i in range(MEMBERS) if i != SILENT]
    result = expected([inputs[i] for i in honest], [WEIGHTS[i] for i in honest], clip_factor=0)
    result = result.clone()
    lo, hi = butterfly_parts(inputs[0].numel(), MEMBERS)[SILENT]
    result[lo:hi] = expected(inputs, WEIGHTS, clip_factor=0)[lo:hi]
    return result


def test_start_bound_is_a_multiple_of_the_majority_between_floor_and_sender_timeout() -> None:
    t = RoundTimeouts(sender_timeout=2.0, connect_timeout=1.0)
    assert start_bound(0.0, t) == 1.0  # the default floor
    assert start_bound(0.1, t) == 1.0  # the floor, by hand
    assert start_bound(0.4, t) == pytest.approx(1.6)  # START_FACTOR 4, by hand
    assert start_bound(5.0, t) == 2.0
    wider = RoundTimeouts(sender_timeout=8.0, start_floor=3.0).scaled(0.5)  # 4 s, 1.5 s
    assert start_bound(0.1, wider) == 1.5 and start_bound(0.5, wider) == 2.0
    with pytest.raises(ValueError):
        start_bound(float("nan"), t)


def test_silent_member_dropped_and_charged_by_every_reducer_then_refused() -> None:
    inputs = deltas(3_000, MEMBERS)
    types: list[type[AllReduceRunner]] = [AllReduceRunner] * MEMBERS
    types[SILENT] = SilentSender
    ids = [member_id(i) for i in range(MEMBERS)]
    now = [1000.0]  # the ban lists' clock: the rounds a silence span apart
    bans = [RecordingBans(ids, clock=lambda: now[0]) for _ in range(MEMBERS)]
    want = _without_silent(inputs)
    for _ in range(BAN_OFFENCES):
        now[0] += SILENCE_SPAN
        outcomes, round_ = _round(inputs, types, bans)
        for i in range(SILENT):
            assert torch.equal(delta_of(outcomes[i]), want)
            assert outcomes[i].members == names(MEMBERS, left_out=SILENT)  # type: ignore[union-attr]
            assert round_.runners[i].starts.dropped == {SILENT}  # early, not at the deadline
        # its report that it lacks their parts (it never asked) demotes no honest reducer
        assert [round_.runners[i].part_missing for i in range(SILENT)] == [False] * SILENT
    # each honest reducer charged it once a round, for its own part; nobody else was charged
    charged = [[who for who, why in b.log if "no PART" in why] for b in bans]
    assert charged[:SILENT] == [[SILENT] * BAN_OFFENCES] * SILENT
    assert all(who == SILENT for b in bans[:SILENT] for who, _ in b.log)
    assert [b.banned(ids[SILENT]) for b in bans[:SILENT]] == [True] * SILENT

    # refused: matchmaking with the ban lists those rounds left forms no group with it
    network, table = MemoryNetwork(), Table()
    makers = [
        Matchmaker(
            network.join(ids[i]),
            MemoryDHT(make_identity(i), table),
            "silence-0123456789abcdef",
            bytes(range(16)),
            RoundTimeouts(matchmaking_window=0.5, join_timeout=0.5),
            bans[i],
            target_group_size=MEMBERS,
        )
        for i in range(MEMBERS)
    ]

    async def matchmake() -> list[GroupInfo | BaseException]:
        for maker in makers:
            await maker.start()
        forming = [m.form_group(RoundKey(5, 1), 3_000, 0, 0, 1.0) for m in makers]
        return await asyncio.gather(*forming, return_exceptions=True)

    groups = asyncio.run(matchmake())
    network.close()
    honest: set[PeerID] = set(ids[:SILENT])
    for i in range(SILENT):
        group = groups[i]
        assert isinstance(group, GroupInfo), groups
        assert set(group.members) == honest
    assert isinstance(groups[SILENT], RoundFailed)


def test_late_member_dropped_early_but_not_charged() -> None:
    """Its streams arrive once the others stopped waiting for it: not counted, yet it
    started well within the sender window, so nobody charges it."""
    inputs = deltas(3_000, MEMBERS)
    types: list[type[AllReduceRunner]] = [AllReduceRunner] * MEMBERS
    types[SILENT] = LateSender
    ids = [member_id(i) for i in range(MEMBERS)]
    bans = [RecordingBans(ids) for _ in range(MEMBERS)]
    outcomes, round_ = _round(inputs, types, bans)
    for i in range(SILENT):
        assert outcomes[i].members == names(MEMBERS, left_out=SILENT)  # type: ignore[union-attr]
        assert round_.runners[i].starts.dropped == {SILENT}
        assert SILENT in round_.runners[i].starts.started
    assert [b.log for b in bans] == [[]] * MEMBERS


def test_silent_member_of_two_dropped_once_it_served_its_part_and_charged() -> None:
    """Two members: no majority without the other, so nothing bounds the wait by time;
    but the silent member's averaged part came back, so it runs the round and its stream
    is overdue: the honest reducer drops it from its part (it counts only itself there),
    and charges it once the sender window passed."""
    weights = WEIGHTS[:2]
    inputs = deltas(3_000, 2)
    ids = [member_id(i) for i in range(2)]
    bans = [RecordingBans(ids) for _ in range(2)]

    async def main() -> tuple[list[Outcome], Round]:
        clock = SteppedClock()
        round_ = Round(
            inputs,
            weights,
            [AllReduceRunner, SilentSender],
            timeouts=FAST,
            bans=bans,
            clip_factor=0,
            clock=clock,
        )
        await round_.start()
        outcomes = await round_.outcomes()
        clock.advance(round_.runners[0].deadlines.gather)
        return outcomes, round_

    (outcome, silent), round_ = asyncio.run(main())
    assert isinstance(silent, RoundFailed)  # it holds no part but its own
    assert round_.runners[0].starts.dropped == {1}
    assert 1 in round_.runners[0].starts.served
    # part 0 averages member 0 alone, part 1 both (codec none, one chunk per part)
    want = expected(inputs, weights, clip_factor=0).clone()
    lo, hi = butterfly_parts(inputs[0].numel(), 2)[0]
    want[lo:hi] = inputs[0][lo:hi]
    assert torch.equal(delta_of(outcome), want)
    assert outcome.members == names(2, left_out=1)  # type: ignore[union-attr]
    assert [who for who, why in bans[0].log if "served its own part" in why] == [1]
