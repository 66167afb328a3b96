"""Stream routing: a finished round still answers checks and shows evidence for a while."""

from __future__ import annotations

import asyncio

from inprocess import KEY, TIMEOUTS, Round, deltas

from diloco.protocol.allreduce.member import AllReduceRunner
from diloco.protocol.core.reducer import RoundResult
from diloco.protocol.runtime.streams import open_stream, read_frame, write_frame
from diloco.protocol.wire.check import CheckRequest, CheckResponse
from diloco.protocol.wire.frames import Kind, Reject, RejectCode


async def _ask(round_: Round, member: int, of: int) -> CheckResponse | Reject:
    """Member ``member`` asks member ``of`` about block 0 of part ``member`` on a stream."""
    p2p = round_.network.peers[round_.ids[member]]
    request = CheckRequest(round_.runners[of].plan.tag, round_.group.group_id, ((member, (0,)),))
    reader, writer = await open_stream(p2p, round_.ids[of], round_.services[of].check_handler, 1)
    try:
        await write_frame(writer, Kind.CHECK_REQ, request.serialize())
        kind, body = await read_frame(reader, (Kind.CHECK_RES,), 1 << 20)
    finally:
        writer.close()
    return Reject.parse(body) if kind == Kind.REJECT else CheckResponse.parse(body)


def test_finished_round_answers_checks_until_they_are_over_then_forgets() -> None:
    async def main() -> None:
        timeouts = TIMEOUTS.scaled(0.2)
        round_ = Round(deltas(6_144, 3), [1.0] * 3, [AllReduceRunner] * 3, timeouts=timeouts)
        await round_.start()
        assert all(isinstance(o, RoundResult) for o in await round_.outcomes())
        runner, service = round_.runners[0], round_.services[0]
        service.finish(KEY)  # the round returned here; member 1 may still be checking
        first = await _ask(round_, 1, 0)  # member 1's second ask (once after a cut stream)
        assert isinstance(first, CheckResponse) and [e.part for e in first.entries] == [1]
        loop = asyncio.get_running_loop()
        await asyncio.sleep(runner.deadlines.check + timeouts.matchmaking - loop.time() + 0.05)
        assert runner.own is None  # every check is over: the delta is let go
        late = await _ask(round_, 2, 0)  # member 2's second ask, now too late
        assert isinstance(late, Reject) and late.reason == "no checks here, or asked before"
        await asyncio.sleep(runner.deadlines.forget - loop.time() + 0.05)
        gone = await _ask(round_, 2, 0)
        assert isinstance(gone, Reject) and gone.code == RejectCode.UNKNOWN_ROUND

    asyncio.run(main())
