"""REPORT and CHECK_REQ on the PART stream after the part (``channel``): a verified round
opens no other streams, answers come in turn, and a member that sends garbage on it gets a
REJECT MALFORMED while the round completes for everyone."""

from __future__ import annotations

import asyncio
import collections
from typing import Any, ClassVar

import pytest
import torch
from faults import LYING_REDUCER
from inprocess import Round, deltas, expected, member_id
from memory_p2p import MemoryP2P, stream_pair

from diloco.errors import RoundFailed
from diloco.protocol.allreduce.channel import ChannelBroken, PartChannel
from diloco.protocol.allreduce.member import AllReduceRunner
from diloco.protocol.core.assembly import Assembled
from diloco.protocol.core.reducer import RoundResult
from diloco.protocol.runtime.streams import read_frame, write_frame
from diloco.protocol.wire.frames import ByteCounter, Kind, Reject, RejectCode, RoundTag
from diloco.protocol.wire.part import Report

pytestmark = pytest.mark.clocked

Opens = collections.Counter[str]


def _opens(monkeypatch: pytest.MonkeyPatch) -> Opens:
    """Streams opened from now on, by the kind of handler (the last part of its name but
    the version: "part", "report", "check", "evidence")."""
    opened: Opens = collections.Counter()
    call = MemoryP2P.call_binary_stream_handler

    async def counted(self: MemoryP2P, peer_id: Any, handler_name: str) -> Any:
        opened[handler_name.rsplit("/", 2)[-2]] += 1
        return await call(self, peer_id, handler_name)

    monkeypatch.setattr(MemoryP2P, "call_binary_stream_handler", counted)
    return opened


def _round(
    members: list[Any], clients: tuple[bool, ...] = (), numel: int = 3 * 4_096
) -> tuple[list[Any], Round]:
    inputs = deltas(numel, len(members))

    async def main() -> tuple[list[Any], Round]:
        round_ = Round(inputs, [1.0] * len(members), members, "e3m0", clients=clients)
        await round_.start()
        return await round_.outcomes(), round_

    return asyncio.run(main())


@pytest.mark.parametrize("m", [2, 3])
def test_a_verified_round_opens_only_its_part_streams(
    monkeypatch: pytest.MonkeyPatch, m: int
) -> None:
    opened = _opens(monkeypatch)
    outcomes, round_ = _round([AllReduceRunner] * m)
    want = expected(round_.deltas, [1.0] * m, "e3m0")
    for outcome in outcomes:
        assert isinstance(outcome, RoundResult), outcome
        assert torch.equal(outcome.delta, want)
    # one PART stream per other member, each carrying the REPORT and the CHECK_REQ too
    assert opened == {"part": m * (m - 1)}
    for runner in round_.runners:  # every member's checks were answered, on those streams
        assert runner.channels.keys() == set(range(m)) - {runner.index}
        assert all(channel.broken for channel in runner.channels.values())  # closed


def test_a_client_is_reported_to_and_asked_on_streams_of_their_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    opened = _opens(monkeypatch)
    clients = (False, False, True)
    outcomes, round_ = _round([AllReduceRunner] * 3, clients)
    want = expected(round_.deltas, [1.0] * 3, "e3m0", clients)
    for outcome in outcomes:
        assert isinstance(outcome, RoundResult), outcome
        assert torch.equal(outcome.delta, want)
    # the client reduces no part: nobody has a part stream to it, so the two reducers'
    # reports to it and their checks of its contribution go on streams of their own
    assert opened == {"part": 4, "report": 2, "check": 2}
    assert [sorted(runner.channels) for runner in round_.runners] == [[1], [0], [0, 1]]


def test_a_lying_reducer_is_still_caught_with_the_checks_on_its_part_stream(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    opened = _opens(monkeypatch)
    outcomes, round_ = _round([AllReduceRunner, AllReduceRunner, LYING_REDUCER])
    for i in (0, 1):
        assert isinstance(outcomes[i], RoundFailed), outcomes[i]
        assert "reducer" in str(outcomes[i]) and "lied" in str(outcomes[i])
        assert round_.bans[i].banned(member_id(2))
    assert isinstance(outcomes[2], RoundResult)  # it alone applies its lie
    # the checks that caught it went on the part streams; the dispute on its own stream
    assert opened == {"part": 6, "evidence": 2}


class MalformedAfterPart(AllReduceRunner):
    """Holds every part, then sends each reducer on its part's stream a ``garbage`` frame
    where its report goes: the answers it got are kept."""

    garbage: ClassVar[str] = "bytes"
    answers: ClassVar[list[tuple[Kind, Reject]]] = []

    def _garbage(self) -> tuple[Kind, bytes]:
        if self.garbage == "bytes":
            return Kind.REPORT, b"\x00" * 7
        if self.garbage == "kind":
            return Kind.PART, b"\x00" * 70
        tag = self.plan.tag
        other = RoundTag(tag.digest, tag.fragment, tag.round + 1)
        return Kind.REPORT, Report(other, self.group.group_id, (True,) * 3, bytes(32)).serialize()

    async def _exchange_reports(self, assembled: Assembled) -> None:
        for channel in self.channels.values():
            answer, payload = await channel.ask(*self._garbage(), (Kind.ACK,))
            self.answers.append((answer, Reject.parse(payload)))
        await super()._exchange_reports(assembled)  # now on REPORT streams of their own


@pytest.mark.parametrize("garbage", ["bytes", "kind", "round"])
def test_garbage_on_a_part_stream_is_refused_and_the_round_completes(
    monkeypatch: pytest.MonkeyPatch, garbage: str
) -> None:
    opened = _opens(monkeypatch)
    monkeypatch.setattr(MalformedAfterPart, "garbage", garbage)
    monkeypatch.setattr(MalformedAfterPart, "answers", [])
    outcomes, round_ = _round([AllReduceRunner, AllReduceRunner, MalformedAfterPart])
    want = expected(round_.deltas, [1.0] * 3, "e3m0")
    for outcome in outcomes:  # nobody crashed, and everyone applied the mean
        assert isinstance(outcome, RoundResult), outcome
        assert torch.equal(outcome.delta, want)
    reasons = {
        "bytes": "REPORT length",
        "kind": "unexpected PART",
        "round": "REPORT of another round on a PART stream",
    }
    refused = [(kind, r.code, r.reason) for kind, r in MalformedAfterPart.answers]
    assert refused == [(Kind.REJECT, RejectCode.MALFORMED, reasons[garbage])] * 2
    assert opened["report"] == 2  # its reports then went on streams of their own


def test_answers_come_back_to_the_requests_they_answer_in_turn() -> None:
    async def main() -> None:
        (reader, writer), (their_reader, their_writer) = await stream_pair()
        channel = PartChannel(reader, writer, ByteCounter())

        async def reducer() -> None:  # answers in the order asked, the second one first
            first = await read_frame(their_reader, (Kind.REPORT, Kind.CHECK_REQ))
            second = await read_frame(their_reader, (Kind.REPORT, Kind.CHECK_REQ))
            assert [first[0], second[0]] == [Kind.REPORT, Kind.CHECK_REQ]
            await write_frame(their_writer, Kind.ACK, b"")
            await write_frame(their_writer, Kind.CHECK_RES, b"answer")
            await write_frame(their_writer, Kind.REJECT, Reject(RejectCode.MISMATCH).serialize())

        serving = asyncio.create_task(reducer())
        report = asyncio.create_task(channel.ask(Kind.REPORT, b"r", (Kind.ACK,)))
        check = asyncio.create_task(channel.ask(Kind.CHECK_REQ, b"c", (Kind.CHECK_RES,)))
        assert await check == (Kind.CHECK_RES, bytearray(b"answer"))
        assert await report == (Kind.ACK, bytearray())
        await serving
        kind, _ = await channel.ask(Kind.REPORT, b"r", (Kind.ACK,))
        assert kind == Kind.REJECT
        with pytest.raises(ChannelBroken):  # the reducer ends the stream after a REJECT
            await channel.ask(Kind.REPORT, b"r", (Kind.ACK,))
        channel.close()
        their_writer.close()

    asyncio.run(main())


def test_a_request_given_up_halfway_breaks_the_channel_for_the_next() -> None:
    async def main() -> None:
        (reader, writer), (_, their_writer) = await stream_pair()
        channel = PartChannel(reader, writer, ByteCounter())
        waiting = asyncio.create_task(channel.ask(Kind.REPORT, b"r", (Kind.ACK,)))
        queued = asyncio.create_task(channel.ask(Kind.CHECK_REQ, b"c", (Kind.CHECK_RES,)))
        await asyncio.sleep(0.01)
        waiting.cancel()  # its answer may still come: nobody could tell it from the next
        with pytest.raises(ChannelBroken):
            await queued
        assert waiting.cancelled()
        channel.close()
        their_writer.close()

    asyncio.run(main())
