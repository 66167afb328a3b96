"""Routes the streams of the all-reduce to the round they belong to (``RoundRouter``).

One node serves four handlers per run: PART and REPORT for rounds in flight, CHECK and
EVIDENCE (the verification phase) for those too and, until every member's dispute is over
(``Deadlines.forget``), for rounds this node has finished: another member may still be
checking a part after this node's round returned. The router knows a round only as a
``Routed``: the runner of a flat round is its own, a staged round (``staged.runner``)
finds the runner of a stage by the stage group's id. A member's PART stream to a reducer
goes on, once its whole part went out, with the member's REPORT and CHECK_REQ to that
reducer (``channel``); the REPORT and CHECK handlers serve the members it has no such
stream with.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Protocol

from hivemind.p2p import PeerID

from diloco.errors import ProtocolError, RoundFailed
from diloco.protocol.allreduce.clock import Clock
from diloco.protocol.allreduce.member import AllReduceRunner
from diloco.protocol.allreduce.silence import StartWatch
from diloco.protocol.allreduce.transport import RoundTransport
from diloco.protocol.core.budget import RoundBudget
from diloco.protocol.core.group import RoundTimeouts
from diloco.protocol.core.reducer import RoundKey
from diloco.protocol.runtime.streams import (
    StreamTransport,
    read_body,
    read_frame,
    read_frame_header,
    stream_handler,
    write_frame,
)
from diloco.protocol.trust.bans import BanList
from diloco.protocol.wire.check import CheckRequest, EvidenceRequest
from diloco.protocol.wire.frames import (
    MAX_GROUP_SIZE,
    MAX_SMALL_BODY,
    Kind,
    Reject,
    RejectCode,
    RoundTag,
)
from diloco.protocol.wire.part import PartHead, Report


class Routed(Protocol):
    """What the router needs of a round in flight here (``AllReduceRunner``, ``StagedRunner``)."""

    @property
    def runners(self) -> Sequence[AllReduceRunner]:
        """The all-reduces this round started here: their checks outlive the round."""
        ...

    async def runner_for(self, group_id: bytes, sender: PeerID) -> AllReduceRunner | None:
        """The all-reduce of ``sender``'s stream for group ``group_id``, once it runs here;
        None when this node runs no such group."""
        ...

    def exclude(self, peer: PeerID, reason: str) -> None:
        """Stop waiting for ``peer`` in the all-reduce running now (it broke the protocol)."""
        ...

    def serving_until(self) -> float:
        """Loop time until which streams for the round must stay routed after it returned
        (a staged round's stand-ins), besides its checks."""
        ...


class RoundRouter:
    """Routes PART, REPORT, CHECK and EVIDENCE streams to the round they belong to.

    A round is registered (``expect``) before its node declares itself in matchmaking, so
    a member that formed its group first and sends early is held until this node's group is
    known (bounded by the matchmaking time), not refused.
    """

    def __init__(
        self,
        p2p: StreamTransport,
        run_id: str,
        digest: bytes,
        timeouts: RoundTimeouts,
        bans: BanList,
        clock: Clock | None = None,
    ) -> None:
        self.digest, self.timeouts, self.bans = digest, timeouts, bans
        self.transport = RoundTransport.of(p2p, run_id)
        """What every runner of this node's rounds opens its streams with."""
        self.budget = RoundBudget.of(timeouts)
        """The run's timeouts: what bounds this router's streams (``RoundBudget.streams``)."""
        self.clock = clock
        """None: the running event loop."""
        self._rounds: dict[RoundKey, asyncio.Future[Routed]] = {}
        self._finished: dict[RoundKey, Routed] = {}
        """Rounds that returned here, kept for others' checks until ``Deadlines.forget``."""
        self._watching: dict[bytes, StartWatch] = {}
        """By group id: rounds that returned here with members dropped as silent, whose
        late streams must still be noted until the sender deadline (``silence``)."""
        self._standing: dict[RoundKey, Routed] = {}
        """Rounds that returned here and may still serve streams (``Routed.serving_until``:
        a staged round standing in for a lost member of another stage group)."""

    async def start(self) -> None:
        """Register the four handlers on the shared P2P daemon (banned peers refused)."""
        bounds, names = self.budget.streams(), self.transport
        for handler_name, name, serve, timeout in (
            (names.part, "PART", self._serve_part, bounds.part),
            (names.report, "REPORT", self._serve_report, bounds.report),
            (names.check, "CHECK", self._serve_check, bounds.check),
            (names.evidence, "EVIDENCE", self._serve_evidence, bounds.check),
        ):
            handler = stream_handler(
                name, serve, timeout=timeout, reply_timeout=bounds.reply, admit=self.bans.admit
            )
            await self.transport.p2p.add_binary_stream_handler(handler_name, handler)

    def _clock(self) -> Clock:
        return self.clock if self.clock is not None else asyncio.get_running_loop()

    def expect(self, key: RoundKey) -> asyncio.Future[Routed]:
        """Open the slot of round ``key``; resolve it with the round once its group is known."""
        if key in self._rounds or key in self._finished:
            raise RoundFailed(key.fragment, key.round, "this round is already in flight")
        future: asyncio.Future[Routed] = asyncio.get_running_loop().create_future()
        self._rounds[key] = future
        return future

    def finish(self, key: RoundKey) -> None:
        """Close the slot of round ``key``: new PART and REPORT streams for it are refused from
        now on; its checks and evidence are served until ``Deadlines.forget``."""
        future = self._rounds.pop(key, None)
        if future is None:
            return
        if not future.done():
            future.cancel()
        elif not future.cancelled() and future.exception() is None:
            served = future.result()
            self._standing[key] = served
            self._stop_standing(key)
            self._watch(served.runners)
            answering = [runner for runner in served.runners if runner.own is not None]
            if answering:
                self._finished[key] = served
                clock = self._clock()
                for runner in answering:
                    answered = self.budget.answering_until(runner.deadlines)
                    clock.call_at(answered, runner.stop_answering)
                forget = max(runner.deadlines.forget for runner in answering)
                clock.call_at(forget, self._finished.pop, key, None)

    def _watch(self, runners: Sequence[AllReduceRunner]) -> None:
        """Keep noting the PART streams of members these runners dropped as silent, until
        their sender deadlines (a stream after that is charged anyway)."""
        clock = self._clock()
        for runner in runners:
            starts = runner.starts
            if starts.silent and starts.gather > clock.time():
                self._watching[runner.group.group_id] = starts
                clock.call_at(starts.gather, self._watching.pop, runner.group.group_id, None)

    def _stop_standing(self, key: RoundKey) -> None:
        """Drop round ``key`` once it may no longer serve streams (checked again then: a
        staged round's retry keeps it routed until that retry's evidence is dropped)."""
        served = self._standing.get(key)
        if served is None:
            return
        clock = self._clock()
        until = served.serving_until()
        if until <= clock.time():
            del self._standing[key]
        else:
            clock.call_at(until, self._stop_standing, key)

    async def _runner_for(
        self, tag: RoundTag, group_id: bytes, sender: PeerID, finished: bool = False
    ) -> AllReduceRunner | Reject:
        key = RoundKey(tag.fragment, tag.round)
        future = self._rounds.get(key)
        if tag.digest != self.digest:
            if (
                future is not None
                and future.done()
                and not future.cancelled()
                and future.exception() is None
            ):
                future.result().exclude(sender, "message of another run")
            return Reject(RejectCode.WRONG_RUN, reason="different run configuration")
        served: Routed
        if finished and key in self._finished:
            served = self._finished[key]
        elif future is None and key in self._standing:
            served = self._standing[key]
        else:
            if future is None:
                return Reject(RejectCode.UNKNOWN_ROUND, reason="round not in flight here")
            await asyncio.wait({future}, timeout=self.budget.group_wait)
            if not future.done() or future.cancelled() or future.exception() is not None:
                return Reject(RejectCode.UNKNOWN_ROUND, reason="no group for this round here")
            served = future.result()
        runner = await served.runner_for(group_id, sender)
        if runner is None or runner.group.group_id != group_id:
            return Reject(RejectCode.NOT_MEMBER, reason="another group")
        return runner

    async def _serve_part(
        self, peer: PeerID, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> Reject | None:
        connect = self.timeouts.connect_timeout
        frame = await asyncio.wait_for(read_frame_header(reader), connect)
        if frame.kind != Kind.PART or frame.body_len < PartHead.SIZE:
            raise ProtocolError(f"{frame.kind.name} of {frame.body_len} bytes on the part stream")
        head = PartHead.parse(await asyncio.wait_for(read_body(reader, PartHead.SIZE), connect))
        watched = self._watching.get(head.group_id)
        if watched is not None and head.part == watched.group.index(watched.me):
            watched.start(peer)  # late, after this node's round returned: not silent
        runner = await self._runner_for(head.tag, head.group_id, peer)
        if isinstance(runner, Reject):
            return runner
        if head.part == runner.index:
            runner.starts.start(peer)
            server = runner.server
            refusal = await server.accept_part(peer, frame, head, reader, writer)
            if refusal is not None or runner.group.index(peer) not in server.sealed:
                return refusal
            return await self._serve_after_part(runner, peer, reader, writer)
        deadline = runner.deadlines.rereduce
        return await runner.substitutes.accept_part(peer, frame, head, reader, writer, deadline)

    async def _serve_after_part(
        self,
        runner: AllReduceRunner,
        peer: PeerID,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> Reject | None:
        """Answer a member's REPORT and CHECK_REQ on the PART stream its whole part went out
        on (``channel``), each in turn as on their own streams, until it closes the
        stream or its checks are due."""
        loop = asyncio.get_running_loop()
        limit = max(MAX_SMALL_BODY, CheckRequest.max_size(MAX_GROUP_SIZE))
        reply = self.timeouts.reply_timeout
        while True:
            remaining = max(0.0, runner.deadlines.check - loop.time())
            try:
                kind, body = await asyncio.wait_for(
                    read_frame(reader, (Kind.REPORT, Kind.CHECK_REQ), limit), remaining
                )
            except asyncio.IncompleteReadError:
                return None  # the member closed the stream: it asked all it had to
            if kind == Kind.REPORT:
                report = Report.parse(body)
                if (report.tag, report.group_id) != (runner.plan.tag, runner.group.group_id):
                    raise ProtocolError("REPORT of another round on a PART stream")
                runner.reports.accept(peer, report)
                await asyncio.wait_for(write_frame(writer, Kind.ACK), reply)
            elif kind == Kind.CHECK_REQ:
                answer = await runner.answer_check(peer, CheckRequest.parse(body))
                if isinstance(answer, Reject):
                    return answer
                sent = write_frame(writer, Kind.CHECK_RES, answer, counter=runner.counter)
                await asyncio.wait_for(sent, reply)
            else:  # a REJECT: the member gives the stream up
                return None

    async def _serve_report(
        self, peer: PeerID, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> Reject | None:
        t = self.timeouts
        _, body = await asyncio.wait_for(read_frame(reader, (Kind.REPORT,)), t.connect_timeout)
        report = Report.parse(body)
        runner = await self._runner_for(report.tag, report.group_id, peer)
        if isinstance(runner, Reject):
            return runner
        runner.reports.accept(peer, report)
        await asyncio.wait_for(write_frame(writer, Kind.ACK), t.reply_timeout)
        return None

    async def _serve_check(
        self, peer: PeerID, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> Reject | None:
        t = self.timeouts
        limit = CheckRequest.max_size(MAX_GROUP_SIZE)
        _, body = await asyncio.wait_for(
            read_frame(reader, (Kind.CHECK_REQ,), limit), t.connect_timeout
        )
        request = CheckRequest.parse(body)
        runner = await self._runner_for(request.tag, request.group_id, peer, finished=True)
        if isinstance(runner, Reject):
            return runner
        answer = await runner.answer_check(peer, request)
        if isinstance(answer, Reject):
            return answer
        await asyncio.wait_for(
            write_frame(writer, Kind.CHECK_RES, answer, counter=runner.counter), t.reply_timeout
        )
        return None

    async def _serve_evidence(
        self, peer: PeerID, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> Reject | None:
        _, body = await asyncio.wait_for(
            read_frame(reader, (Kind.EVIDENCE_REQ,)), self.timeouts.connect_timeout
        )
        request = EvidenceRequest.parse(body)
        runner = await self._runner_for(request.tag, request.group_id, peer, finished=True)
        if isinstance(runner, Reject):
            return runner
        return await runner.server.serve_evidence(peer, request, writer)
