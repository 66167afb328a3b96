"""Stream routing: a finished round still answers checks and shows evidence for a while."""

from __future__ import annotations

import asyncio

import pytest
from inprocess import KEY, TIMEOUTS, Round, SteppedClock, deltas

from diloco.protocol.allreduce.member import AllReduceRunner
from diloco.protocol.core.reducer import RoundResult
from diloco.protocol.runtime.streams import open_stream, read_frame, write_frame
from diloco.protocol.wire.check import CheckRequest, CheckResponse
from diloco.protocol.wire.frames import Kind, Reject, RejectCode

pytestmark = pytest.mark.clocked


async def _ask(round_: Round, member: int, of: int) -> CheckResponse | Reject:
    """Member ``member`` asks member ``of`` about block 0 of part ``member`` on a stream."""
    p2p = round_.network.peers[round_.ids[member]]
    request = CheckRequest(round_.runners[of].plan.tag, round_.group.group_id, ((member, (0,)),))
    reader, writer = await open_stream(p2p, round_.ids[of], round_.routers[of].transport.check, 1)
    try:
        await write_frame(writer, Kind.CHECK_REQ, request.serialize())
        kind, body = await read_frame(reader, (Kind.CHECK_RES,), 1 << 20)
    finally:
        writer.close()
    return Reject.parse(body) if kind == Kind.REJECT else CheckResponse.parse(body)


def test_finished_round_answers_checks_until_they_are_over_then_forgets() -> None:
    async def main() -> None:
        timeouts, clock = TIMEOUTS.scaled(0.2), SteppedClock()
        runners = [AllReduceRunner] * 3
        round_ = Round(deltas(6_144, 3), [1.0] * 3, runners, timeouts=timeouts, clock=clock)
        await round_.start()
        assert all(isinstance(o, RoundResult) for o in await round_.outcomes())
        runner, router = round_.runners[0], round_.routers[0]
        router.finish(KEY)  # the round returned here; member 1 may still be checking
        first = await _ask(round_, 1, 0)  # member 1's second ask (once after a cut stream)
        assert isinstance(first, CheckResponse) and [e.part for e in first.entries] == [1]
        clock.advance(runner.deadlines.check + timeouts.matchmaking - 0.01)
        assert runner.own is not None  # not yet: member 1's checks may still come
        clock.advance(runner.deadlines.check + timeouts.matchmaking)
        assert runner.own is None  # every check is over: the delta is let go
        late = await _ask(round_, 2, 0)  # member 2's second ask, now too late
        assert isinstance(late, Reject) and late.reason == "no checks here, or asked before"
        clock.advance(runner.deadlines.forget - 0.01)
        known = await _ask(round_, 2, 0)  # still known here: refused as asked before
        assert isinstance(known, Reject) and known.code == RejectCode.MISMATCH
        clock.advance(runner.deadlines.forget)
        gone = await _ask(round_, 2, 0)
        assert isinstance(gone, Reject) and gone.code == RejectCode.UNKNOWN_ROUND

    asyncio.run(main())
