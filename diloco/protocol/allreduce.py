"""Butterfly all-reduce of one fragment round over p2pd streams (SPEC 4).

Member ``j`` of a group of ``M`` reduces part ``j`` of the vector (``butterfly_parts``).
Every member opens one stream per other reducer and streams its part there as consecutive
chunks (``chunk_spans``), each encoded on its own (PART); on the same stream it reads back
the reducer's averaged chunks (AVERAGED). A reducer decodes every contribution, accumulates
the weighted mean in FP32 in group order (``weighted_mean``, the same float operations as
``InProcessReducer``), encodes each averaged chunk once with the return codec and sends the
same bytes, with the mask of members it counted, to every member; it uses the decoded bytes
itself. So all members hold bit-identical parts. Chunks pipeline the two phases: chunk
``c`` is averaged and on its way back while chunk ``c + 1`` is still arriving.

Faults and agreement (the rule every member applies):

* A reducer waits for the first chunk of every member until ``sender_timeout`` after its
  start; members whose first chunk did not arrive valid by then are not counted, for the
  whole part, and the weights are renormalised over those that were. A late member's
  chunks are read, not counted, and it still receives the averaged chunks, so a slow
  member ends with the same values as the others. A counted member that stops sending, or
  sends an invalid chunk, after that point fails the reducer's part (the average cannot be
  taken back): its part is then missing for everyone.
* Every chunk is validated (run digest, round, group, part and chunk index, exact length
  for the codec, decodes, finite, norm at most ``max_norm_ratio`` times the reducer's own
  chunk norm when that is non-zero). An invalid sender is excluded and logged and its
  stream closed. Averaged chunks are validated the same way; an invalid one makes the part
  missing.
* A member waits for averaged parts until ``reducer_timeout`` after the reducers' deadline.
  A part that did not come (dead or invalid reducer) is *missing*: never replaced by local
  values.
* A member whose part stream is cut in transport (refused, or closed before the reducer
  refused it) opens it once more and sends the part again; the reducer keeps what arrived,
  skips the repeated chunks and streams the averaged chunks again from the first. A cut
  counted member thus delays its reducer's part (up to the part deadline) instead of
  failing it. A reducer that excludes a member, or whose part failed, says so (REJECT), so
  that member does not try again.
* Then every member sends every other member a REPORT and waits, up to
  ``report_timeout``, for the reports of the full contributors (members counted in every
  part it holds); ``agreement.decide`` says whether the round succeeds for it: its result
  must be the one a strict majority holds. If not, it raises ``RoundFailed`` and its outer
  state stays unchanged. A dissenting member is logged; one that reported another result
  against the majority, like a sender excluded for invalid input, commits an offence
  (``bans``). ``RoundResult.members`` are the full contributors, identical on every
  member because the masks travel with the parts.
* A *client* (``GroupInfo.clients``: a member nobody can dial, or a demoted one) reduces
  no part: its part is empty, nobody streams to it, and every member holds that part as
  empty with every member counted (so it changes neither the result nor the full
  contributors). It streams its chunks to the reducers and reads the averages back on the
  streams it opened, so it never needs to be dialled, except for REPORTs, which arrive on
  the connections its PART streams opened (libp2p reuses a live connection to a peer).
* Otherwise every member is a reducer, so a member that dies before delivering its
  averaged part fails the round for all (SPEC 4 allows "all treat the round as failed");
  one that dies after delivering it, before its own contributions arrived, is simply not
  counted.
* Residual risk (two generals): a report that is lost while its sender stays alive can
  leave that sender with a different outcome. The fragment state version and hash that
  every node publishes in its DHT record detect this (``records.divergent_peers``); the
  node then heals by state transfer (``Swarm.fetch_state``).

This module (the member side) and ``part_server`` (the reducer side) move the bytes and
keep the deadlines; what the bytes mean (who counts, the average, the assembled result,
the verdict) is decided by the pure classes of ``reduction`` and by ``agreement.decide``.
Encoding and decoding run in the default executor so the event loop keeps serving streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping

import torch
from hivemind.p2p import PeerID

from diloco.codecs import Codec
from diloco.errors import ProtocolError, RoundFailed
from diloco.protocol.agreement import ANOTHER_RESULT, awaited_reports, check_report, decide
from diloco.protocol.bans import BanList
from diloco.protocol.demotion import own_part_missing
from diloco.protocol.group import GroupInfo, RoundTimeouts
from diloco.protocol.part_server import Deadlines, PartServer
from diloco.protocol.reducer import RoundKey, RoundResult
from diloco.protocol.reduction import (
    Assembled,
    Assembly,
    AveragedPart,
    PartReducer,
    RoundPlan,
    part_digest,
)
from diloco.protocol.streams import (
    TRANSPORT_ERRORS,
    StreamTransport,
    open_stream,
    read_body,
    read_frame,
    read_frame_header,
    stop_sending,
    stream_handler,
    write_frame,
)
from diloco.protocol.wire import (
    MAX_SMALL_BODY,
    Averaged,
    ByteCounter,
    Kind,
    PartHead,
    Reject,
    RejectCode,
    Report,
    RoundTag,
)

logger = logging.getLogger(__name__)

STREAM_RETRIES = 1
"""Extra attempts of a member's PART or REPORT stream after it was cut in transport."""


class AllReduceRunner:
    """One member's side of one round's all-reduce: sender of ``M - 1`` parts, reducer of one.

    It moves bytes and keeps time; what the bytes mean is decided by ``AveragedPart``,
    ``self.assembly`` and ``agreement.decide``; ``self.server`` serves its own part.
    ``server_type`` is the class that does (tests substitute faulty subclasses).
    """

    server_type: type[PartServer] = PartServer

    def __init__(
        self,
        *,
        p2p: StreamTransport,
        group: GroupInfo,
        digest: bytes,
        codec: Codec,
        return_codec: Codec,
        delta: torch.Tensor,
        timeouts: RoundTimeouts,
        max_norm_ratio: float,
        max_weight: float,
        clip_factor: float,
        bans: BanList,
        part_handler: str,
        report_handler: str,
    ) -> None:
        if codec.codec_id != group.codec_id or return_codec.codec_id != group.return_codec_id:
            raise ValueError("codecs differ from the group's")
        self.p2p, self.group, self.delta, self.timeouts = p2p, group, delta, timeouts
        self.part_handler, self.report_handler = part_handler, report_handler
        self.bans = bans
        self.index = group.index(p2p.peer_id)
        self.num_members = len(group.members)
        self.plan = RoundPlan.build(
            tag=RoundTag(digest, group.key.fragment, group.key.round),
            group_id=group.group_id,
            index=self.index,
            weights=group.weights,
            delta=delta,
            codec=codec,
            return_codec=return_codec,
            max_norm_ratio=max_norm_ratio,
            max_weight=max_weight,
            clip_factor=clip_factor,
            clients=group.clients,
        )
        self.assembly = Assembly(self.plan)
        everyone = (True,) * self.num_members
        for j in range(self.num_members):
            if group.is_client(j):  # an empty part, alike on every member (module docstring)
                empty = torch.zeros(0, dtype=torch.float32)
                self.assembly.add(j, everyone, empty, part_digest(everyone, []))
        self.counter = ByteCounter()
        loop = asyncio.get_running_loop()
        self._t0 = loop.time()
        self.deadlines = Deadlines.starting(self._t0, timeouts)
        self._own_chunks: list[asyncio.Future[torch.Tensor]] = [
            loop.create_future() for _ in self.plan.chunks[self.index]
        ]
        self.server = self.server_type(
            reducer=PartReducer(self.plan),
            group=group,
            me=p2p.peer_id,
            deadlines=self.deadlines,
            timeouts=timeouts,
            counter=self.counter,
            own_chunks=self._own_chunks,
            assembly=self.assembly,
            bans=bans,
        )
        self._reports: dict[int, Report] = {}
        self._report_arrived = asyncio.Event()
        self.part_missing = True
        """Whether this member's own part failed (``demotion``); True until ``run`` ends."""

    async def run(self) -> RoundResult:
        """Exchange parts, agree by reports, and return the round's result.

        Raises:
            RoundFailed: a part is missing here or at a member that reported, or results
                differ; the caller must then leave its outer state unchanged.
        """
        loop = asyncio.get_running_loop()
        key = self.group.key
        client = self.group.is_client(self.index)
        reduce_task = asyncio.create_task(self._nothing() if client else self.server.reduce())
        exchanges = [
            asyncio.create_task(self._exchange(j))
            for j in range(self.num_members)
            if j != self.index and not self.group.is_client(j)
        ]
        try:
            for c, future in enumerate(self._own_chunks):
                own = await loop.run_in_executor(
                    None, self.plan.through_codec, self.delta, self.index, c
                )
                future.set_result(own)
            encoded = loop.time()
            await reduce_task
            reduced = loop.time()
            for task in exchanges:
                await task
        finally:
            for task in (reduce_task, *exchanges):
                task.cancel()
        assembled = self.assembly.result()
        assembled_at = loop.time()
        await self._exchange_reports(assembled)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(
                self.server.idle.wait(), max(0.0, self.deadlines.report - loop.time())
            )
        logger.info(
            "round %s: encoded %.3fs, own part averaged %.3fs, all parts %.3fs, agreed %.3fs",
            key,
            encoded - self._t0,
            reduced - self._t0,
            assembled_at - self._t0,
            loop.time() - self._t0,
        )
        self.part_missing = own_part_missing(
            self.index, not assembled.held[self.index], self._reports
        )
        verdict = decide(
            self.index, assembled.held, assembled.digest, assembled.full, self._reports
        )
        self._blame(verdict.dissent, verdict.accepted)
        if not verdict.accepted:
            raise RoundFailed(key.fragment, key.round, verdict.reason)
        return RoundResult(
            delta=assembled.delta,
            members=tuple(n for n, ok in zip(self.group.names, assembled.full, strict=True) if ok),
            bytes_sent=self.counter.sent,
            bytes_received=self.counter.received,
            seconds=loop.time() - self._t0,
        )

    @staticmethod
    async def _nothing() -> None:
        """A client's reducer side: it has no part to serve."""

    def _encode_chunk(self, j: int, c: int) -> bytes:
        """Payload of chunk ``c`` of part ``j`` (sent to reducer ``j``)."""
        a, b = self.plan.chunks[j][c]
        return self.plan.codec.encode(self.delta[a:b].contiguous())

    def _part_head(self, j: int, c: int) -> PartHead:
        return self.plan.head(j, c)

    async def _exchange(self, j: int) -> None:
        """Stream part ``j`` to its reducer and put the average it returns in the assembly.

        A stream cut in transport is opened once more (see the module docstring); a part
        that does not come is missing, and logged.
        """
        loop = asyncio.get_running_loop()
        peer = self.group.members[j]
        for attempt in range(1 + STREAM_RETRIES):
            try:
                part = await asyncio.wait_for(
                    self._exchange_inner(j, peer), self.deadlines.part - loop.time()
                )
            except (ProtocolError, asyncio.TimeoutError) as exc:
                reason: Exception = exc
                break
            except TRANSPORT_ERRORS as exc:
                reason = exc
                if attempt < STREAM_RETRIES and self.deadlines.part - loop.time() > 0.2:
                    logger.info("round %s: part %d stream cut (%r), again", self.group.key, j, exc)
                    await asyncio.sleep(0.1)
            else:
                assert part.mask is not None
                self.assembly.add(j, part.mask, torch.cat(part.values), part.digest())
                return
        logger.warning("round %s: part %d from %s missing: %r", self.group.key, j, peer, reason)

    async def _exchange_inner(self, j: int, peer: PeerID) -> AveragedPart:
        loop = asyncio.get_running_loop()
        reader, writer = await open_stream(
            self.p2p, peer, self.part_handler, self.timeouts.connect_timeout
        )

        async def send() -> None:
            for c in range(len(self.plan.chunks[j])):
                payload = await loop.run_in_executor(None, self._encode_chunk, j, c)
                head = self._part_head(j, c).serialize()
                await write_frame(writer, Kind.PART, head, payload, counter=self.counter)

        sending = asyncio.create_task(send())
        try:
            part = AveragedPart(self.plan, j)
            for c in range(len(part.chunks)):
                frame = await read_frame_header(reader, self.counter)
                if frame.kind == Kind.REJECT and frame.body_len <= MAX_SMALL_BODY:
                    reject = Reject.parse(await read_body(reader, frame.body_len, self.counter))
                    raise ProtocolError(f"rejected: {reject.code.name} {reject.reason}")
                expected = part.body_size(c)
                if frame.kind != Kind.AVERAGED or frame.body_len != expected:
                    raise ProtocolError(
                        f"{frame.kind.name} of {frame.body_len} bytes, expected {expected}"
                    )
                msg = Averaged.parse(await read_body(reader, frame.body_len, self.counter))
                part.check(c, msg)
                values = await loop.run_in_executor(None, part.decode, c, msg.payload)
                part.add(c, msg, values)
            return part
        finally:
            stop_sending(sending)
            writer.close()

    def _blame(self, dissent: Mapping[int, str], accepted: bool) -> None:
        """Log each dissenting member; with the majority behind this member's result, a
        member that reported another one commits an offence."""
        for i, how in dissent.items():
            peer = self.group.members[i]
            level = logging.WARNING if how == ANOTHER_RESULT else logging.INFO
            logger.log(level, "round %s: member %d (%s) %s", self.group.key, i, peer, how)
            if accepted and how == ANOTHER_RESULT:
                self.bans.offend(peer, f"round {self.group.key}: {how}, not the majority's")

    def exclude(self, peer: PeerID, reason: str) -> None:
        """Stop waiting for ``peer``'s contribution (it broke the protocol elsewhere)."""
        if peer in self.group.members and peer != self.p2p.peer_id:
            self.server.exclude(self.group.index(peer), reason)

    async def _exchange_reports(self, assembled: Assembled) -> None:
        """Send my report to everyone; wait for the full contributors' reports (bounded)."""
        loop = asyncio.get_running_loop()
        report = Report(self.plan.tag, self.group.group_id, assembled.held, assembled.digest)
        message = report.serialize()
        sends = [
            asyncio.create_task(self._send_report(self.group.members[i], message))
            for i in range(self.num_members)
            if i != self.index
        ]
        awaited = awaited_reports(self.index, assembled.full)
        try:
            while not awaited <= set(self._reports):
                remaining = self.deadlines.report - loop.time()
                if remaining <= 0:
                    logger.warning(
                        "round %s: no report from members %s",
                        self.group.key,
                        sorted(awaited - set(self._reports)),
                    )
                    break
                self._report_arrived.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._report_arrived.wait(), remaining)
            await asyncio.wait(sends, timeout=max(0.0, self.deadlines.report - loop.time()))
        finally:
            for task in sends:
                task.cancel()

    async def _send_report(self, peer: PeerID, message: bytes) -> None:
        """Deliver my report to ``peer``; a stream cut in transport is opened once more."""
        for attempt in range(1 + STREAM_RETRIES):
            try:
                reader, writer = await open_stream(
                    self.p2p, peer, self.report_handler, self.timeouts.connect_timeout
                )
                try:
                    await write_frame(writer, Kind.REPORT, message)
                    await read_frame(reader, (Kind.ACK,))
                    return
                finally:
                    writer.close()
            except (ProtocolError, asyncio.TimeoutError) as exc:
                reason: Exception = exc
                break
            except TRANSPORT_ERRORS as exc:
                reason = exc
                if attempt < STREAM_RETRIES:
                    await asyncio.sleep(0.1)
        logger.debug("round %s: report to %s not delivered: %r", self.group.key, peer, reason)

    def accept_report(self, sender: PeerID, report: Report) -> None:
        """Keep a member's report (its first one; the handler checked framing and round)."""
        if sender not in self.group.members or sender == self.p2p.peer_id:
            raise ProtocolError("report from a non-member")
        check_report(report, self.group.group_id, self.num_members)
        self._reports.setdefault(self.group.index(sender), report)
        self._report_arrived.set()


class AllReduceService:
    """Routes PART and REPORT streams to the round they belong to.

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
    ) -> None:
        self.p2p, self.digest, self.timeouts, self.bans = p2p, digest, timeouts, bans
        self.part_handler = f"/diloco/{run_id}/part/1"
        self.report_handler = f"/diloco/{run_id}/report/1"
        self._rounds: dict[RoundKey, asyncio.Future[AllReduceRunner]] = {}

    async def start(self) -> None:
        """Register both handlers on the shared P2P daemon."""
        t = self.timeouts
        waits = t.connect_timeout + t.matchmaking  # the first frame, then this node's group
        part = stream_handler(
            "PART",
            self._serve_part,
            timeout=waits + t.allreduce,
            reply_timeout=t.reply_timeout,
            admit=self.bans.admit,
        )
        report = stream_handler(
            "REPORT",
            self._serve_report,
            timeout=waits + t.reply_timeout,
            reply_timeout=t.reply_timeout,
            admit=self.bans.admit,
        )
        await self.p2p.add_binary_stream_handler(self.part_handler, part)
        await self.p2p.add_binary_stream_handler(self.report_handler, report)

    def expect(self, key: RoundKey) -> asyncio.Future[AllReduceRunner]:
        """Open the slot of round ``key``; resolve it with the runner once the group is known."""
        if key in self._rounds:
            raise RoundFailed(key.fragment, key.round, "this round is already in flight")
        future: asyncio.Future[AllReduceRunner] = asyncio.get_running_loop().create_future()
        self._rounds[key] = future
        return future

    def finish(self, key: RoundKey) -> None:
        """Close the slot of round ``key``; new streams for it are refused from now on."""
        future = self._rounds.pop(key, None)
        if future is not None and not future.done():
            future.cancel()

    async def _runner_for(
        self, tag: RoundTag, group_id: bytes, sender: PeerID
    ) -> AllReduceRunner | Reject:
        future = self._rounds.get(RoundKey(tag.fragment, tag.round))
        if tag.digest != self.digest:
            if (
                future is not None
                and future.done()
                and not future.cancelled()
                and future.exception() is None
            ):
                future.result().exclude(sender, "message of another run")
            return Reject(RejectCode.WRONG_RUN, reason="different run configuration")
        if future is None:
            return Reject(RejectCode.UNKNOWN_ROUND, reason="round not in flight here")
        await asyncio.wait({future}, timeout=self.timeouts.matchmaking)
        if not future.done() or future.cancelled() or future.exception() is not None:
            return Reject(RejectCode.UNKNOWN_ROUND, reason="no group for this round here")
        runner = future.result()
        if runner.group.group_id != group_id:
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
        runner = await self._runner_for(head.tag, head.group_id, peer)
        if isinstance(runner, Reject):
            return runner
        return await runner.server.accept_part(peer, frame, head, reader, writer)

    async def _serve_report(
        self, peer: PeerID, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> Reject | None:
        t = self.timeouts
        _, body = await asyncio.wait_for(read_frame(reader, (Kind.REPORT,)), t.connect_timeout)
        report = Report.parse(body)
        runner = await self._runner_for(report.tag, report.group_id, peer)
        if isinstance(runner, Reject):
            return runner
        runner.accept_report(peer, report)
        await asyncio.wait_for(write_frame(writer, Kind.ACK), t.reply_timeout)
        return None


def _bad_part(reason: str) -> Reject:
    return Reject(RejectCode.BAD_PART, reason=reason[:200])
