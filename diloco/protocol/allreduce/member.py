"""Butterfly all-reduce of one fragment round over p2pd streams (docs/design.md "The round").

Member ``j`` of a group of ``M`` reduces part ``j`` of the vector (``butterfly_parts``).
Every member opens one stream per other reducer and streams its part there as consecutive
chunks (``chunk_spans``), each encoded on its own (PART); on the same stream it reads back
the reducer's averaged chunks (AVERAGED), and later sends that reducer its REPORT and
CHECK_REQ (``channel``). A reducer decodes every contribution, combines
them (``aggregation.robust_mean``: capped weights, clipped norms, FP32 in group order, as
``InProcessReducer``), encodes each averaged chunk once with the return codec and sends
the same bytes, with the mask of members it counted and their norms, to every member; it
uses the decoded bytes itself. So all members hold bit-identical parts. Chunks pipeline the
two phases: chunk ``c`` is averaged and on its way back while chunk ``c + 1`` arrives.

Faults and agreement (the whole rule: ``docs/allreduce.md``): a member whose first chunk
is late or invalid is not counted; a part whose reducer dies, stalls or fails is
re-reduced by its substitute among the survivors (``rereduction``), or else missing, never
replaced by local values; members exchange REPORTs (``report_exchange``) and apply the
result a strict majority of the full contributors holds (``agreement.decide``), dissenters
commit an offence (``bans``); a *client* (nobody can dial it, or demoted) reduces no part;
with an ``identity`` parts are sealed and checked (``checking``, ``verification``).

This module (member side) and ``part_server`` (reducer side) move the bytes and keep the
deadlines; what the bytes mean is decided by the pure ``reduction`` and ``agreement``.
Encoding and decoding of large chunks run in the default executor so the event loop keeps
serving streams; small ones, and signatures, run on the loop (``offload``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import random

import torch
from hivemind.p2p import PeerID

from diloco.codecs import Codec
from diloco.errors import ProtocolError, RoundFailed
from diloco.protocol.allreduce.channel import PartChannel
from diloco.protocol.allreduce.checking import Checker, answer_check, blame, convict
from diloco.protocol.allreduce.clock import Clock
from diloco.protocol.allreduce.contribution import Contributor
from diloco.protocol.allreduce.part_reply import read_reply, span_len
from diloco.protocol.allreduce.part_server import PartServer
from diloco.protocol.allreduce.reports import STREAM_RETRIES, ReportExchange
from diloco.protocol.allreduce.silence import StartWatch
from diloco.protocol.allreduce.substitute import Excluded, Substitutes
from diloco.protocol.allreduce.transport import RoundTransport
from diloco.protocol.core.agreement import decide
from diloco.protocol.core.assembly import Assembled, Assembly, AveragedPart
from diloco.protocol.core.budget import Deadlines, RoundBudget
from diloco.protocol.core.demotion import own_part_missing
from diloco.protocol.core.group import GroupInfo
from diloco.protocol.core.partition import substitute
from diloco.protocol.core.reducer import RoundResult
from diloco.protocol.core.round import PartReducer, RoundPlan, part_digest
from diloco.protocol.core.verification import (
    SAMPLES_PER_PART,
    Judgement,
    OwnContribution,
    PartClaims,
    draw_samples,
    slices_alone,
)
from diloco.protocol.runtime import round_trips
from diloco.protocol.runtime.event_loop import wait_set
from diloco.protocol.runtime.offload import offload
from diloco.protocol.runtime.streams import (
    TRANSPORT_ERRORS,
    open_stream,
    stop_sending,
    write_frame,
)
from diloco.protocol.trust.bans import BanList
from diloco.protocol.trust.identity import Identity
from diloco.protocol.wire.check import CheckRequest
from diloco.protocol.wire.frames import (
    ByteCounter,
    Kind,
    Reject,
    RejectCode,
    RoundTag,
)
from diloco.protocol.wire.part import Report

logger = logging.getLogger(__name__)


class AllReduceRunner(Contributor):
    """One member's side of one round's all-reduce: sender of ``M - 1`` parts, reducer of one.

    It moves bytes and keeps time; what the bytes mean is decided by ``AveragedPart``,
    ``self.assembly`` and ``agreement.decide``; ``self.server`` serves its own part.
    ``server_type`` is the class that does (a test's ``Faults`` may pick another). Without
    an ``identity`` nothing is signed or checked (for measurements: every member of a
    group must then run without). ``rng`` picks the blocks checked: private randomness.
    ``clock`` runs its timers (``clock``; None: the running event loop).
    """

    samples: int = SAMPLES_PER_PART
    rng: random.Random = random.SystemRandom()

    def __init__(
        self,
        *,
        transport: RoundTransport,
        group: GroupInfo,
        digest: bytes,
        codec: Codec,
        return_codec: Codec,
        delta: torch.Tensor,
        budget: RoundBudget,
        max_norm_ratio: float,
        max_weight: float,
        clip_factor: float,
        bans: BanList,
        identity: Identity | None = None,
        drop_by_time: bool = True,
        server_type: type[PartServer] = PartServer,
        clock: Clock | None = None,
    ) -> None:
        if codec.codec_id != group.codec_id or return_codec.codec_id != group.return_codec_id:
            raise ValueError("codecs differ from the group's")
        p2p, timeouts = transport.p2p, budget.running
        self.p2p, self.group, self.delta, self.timeouts = p2p, group, delta, timeouts
        self.part_handler, self.report_handler = transport.part, transport.report
        self.check_handlers = transport.check, transport.evidence
        self.identity, self.bans, self.server_type = identity, bans, server_type
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
        checked = identity is not None and slices_alone(return_codec)
        self.own = OwnContribution(self.plan, delta) if checked else None
        """What this member sent, for checks; None when nothing is checked."""
        self.claims: dict[int, PartClaims] = {}
        self._sent: dict[tuple[int, int], tuple[bytes, bytes]] = {}
        """Payload and sha256 of every chunk sent, by (part, chunk)."""
        self._recorded = asyncio.Event()
        self._part_records: dict[int, asyncio.Future[None]] = {}
        self._recording: asyncio.Future[list[None]] | None = None
        self._asked: dict[int, int] = {}
        everyone = (True,) * self.num_members
        for j in range(self.num_members):
            if group.is_client(j):  # an empty part, alike on every member (module docstring)
                empty = torch.zeros(0, dtype=torch.float32)
                self.assembly.add(j, everyone, empty, part_digest([]))
        self.counter = ByteCounter()
        loop = asyncio.get_running_loop()
        self._t0 = loop.time()
        self.deadlines = budget.deadlines(self._t0)
        self.server = self._part_server(self.index, self.deadlines)
        self.starts = StartWatch(self.server, self._t0, timeouts, bans, clock)
        """Who started sending this member's part: silent ones are dropped early, on
        evidence, and by time unless ``drop_by_time`` is off (a stage of a staged round:
        its members start it as their previous stages end, not together)."""
        self.drop_by_time = drop_by_time
        self._own_chunks = list(self.server.own_chunks)
        self.substitutes = Substitutes(self.index, self.num_members, self.server, group.clients)
        self.rereduced: set[int] = set()
        """Parts held as a substitute re-reduced them (not sampled by the checks)."""
        self.not_members: set[int] = set()
        """Members that refused this group's PART streams as not theirs (NOT_MEMBER): they
        run another group (a staged round's view, ``staged_runner``)."""
        self.not_member = asyncio.Event()
        """Set whenever a member joins ``not_members``."""
        self.transfer_seconds: float | None = None  # all parts held, first try (``adaptive``)
        self.channels: dict[int, PartChannel] = {}
        """By reducer: the PART stream its part came on, kept for the REPORT and CHECK_REQ
        to it (``channel``); closed as ``run`` ends."""
        self.reports = ReportExchange(
            p2p=p2p,
            group=group,
            index=self.index,
            handler=self.report_handler,
            timeouts=timeouts,
            channels=self.channels,
        )
        self.part_missing = True
        """Whether this member's own part failed (``demotion``); True until ``run`` ends."""

    @property
    def runners(self) -> tuple[AllReduceRunner]:
        """The all-reduces of this round here: this one (``routing.Routed``)."""
        return (self,)

    async def runner_for(self, group_id: bytes, sender: PeerID) -> AllReduceRunner:
        """The runner of every stream for this round: this one (the router checks that
        ``group_id`` is its group's)."""
        return self

    def serving_until(self) -> float:
        """Nothing is served for a flat round once it returned but its checks."""
        return -math.inf

    async def run(self) -> RoundResult:
        """Exchange parts, agree by reports, and return the round's result.

        Raises:
            RoundFailed: a part is missing here or at a member that reported, or results
                differ; the caller must then leave its outer state unchanged.
        """
        try:
            return await self._run()
        finally:
            for channel in self.channels.values():
                channel.close()

    async def _run(self) -> RoundResult:
        loop = asyncio.get_running_loop()
        key = self.group.key
        client = self.group.is_client(self.index)
        reduce_task = asyncio.create_task(self._nothing() if client else self._reduce_own())
        exchanges = [
            asyncio.create_task(self._exchange(j))
            for j in range(self.num_members)
            if j != self.index and not self.group.is_client(j)
        ]
        try:
            await asyncio.sleep(0)  # the exchanges open their streams before any encoding
            own_spans = self.plan.chunks[self.index]
            for c, future in enumerate(self._own_chunks):
                own = await offload(span_len(own_spans[c]), self._own_chunk, c)
                self._touch_recorded()
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
        if all(assembled.held) and not self.rereduced:
            self.transfer_seconds = assembled_at - self._t0
        self.assembly.clear()  # what stays of the round is what its checks need
        self._own_chunks.clear()
        self._sent = {}  # the gather is over; what checks need is in the parts' records
        self._recording = asyncio.gather(*self._part_records.values())
        checks = self._start_checks(assembled)  # alongside the reports: one phase, not two
        try:
            await self._exchange_reports(assembled)
            for server in (self.server, *self.substitutes.servers):
                await wait_set(server.idle, max(0.0, self.deadlines.report - loop.time()))
            agreed = loop.time()
            # a silent member never asked for this part: its report that it lacks it is
            # no evidence that this reducer failed (``silence``)
            silent = self.starts.silent
            witnesses = {i: r for i, r in self.reports.received.items() if i not in silent}
            self.part_missing = own_part_missing(
                self.index, not assembled.held[self.index], witnesses
            )
            verdict = decide(
                self.index, assembled.held, assembled.digest, assembled.full, self.reports.received
            )
            blame(self.group, verdict.dissent, verdict.accepted, self.bans)
            if not verdict.accepted:
                raise RoundFailed(key.fragment, key.round, verdict.reason)
            judgements = await checks if checks is not None else {}
        finally:
            if checks is not None:
                checks.cancel()
        times = [t - self._t0 for t in (encoded, reduced, assembled_at, agreed, loop.time())]
        logger.info(
            "round %s: encoded %.3fs, own part averaged %.3fs, all parts %.3fs, agreed %.3fs, "
            "checked %.3fs",
            key,
            *times,
        )
        failed = convict(self.group, judgements, self.bans)
        if failed:
            raise RoundFailed(key.fragment, key.round, failed)
        names, full = self.group.names, assembled.full
        return RoundResult(
            delta=assembled.delta,
            members=tuple(n for n, ok in zip(names, full, strict=True) if ok),
            weights={n: w for n, w, ok in zip(names, self.group.weights, full, strict=True) if ok},
            bytes_sent=self.counter.sent,
            bytes_received=self.counter.received,
            seconds=loop.time() - self._t0,
        )

    @staticmethod
    async def _nothing() -> None:
        """A client's reducer side: it has no part to serve."""

    async def _reduce_own(self) -> None:
        """Reduce this member's part, dropping silent senders early (``silence``); if it
        failed, have its substitute re-reduce it."""
        dropping = asyncio.create_task(self.starts.drop_silent(self.drop_by_time))
        try:
            await self.server.reduce()
        finally:
            dropping.cancel()
        if self.server.reducer.failed is not None:
            await self._rereduce(self.index)

    async def _exchange(self, j: int) -> None:
        """Stream part ``j`` to its reducer and put the average it returns in the assembly;
        if that fails, have the part re-reduced (``rereduction``)."""
        reason = await self._fetch(j, j, self.deadlines.part)
        peer = self.group.members[j]
        if reason is None or isinstance(reason, Excluded):
            self.substitutes.decline(j)
            if reason is not None:  # this member's own doing: nothing to re-reduce
                logger.warning(
                    "round %s: part %d from %s missing: %r", self.group.key, j, peer, reason
                )
            return
        logger.warning("round %s: part %d from %s failed: %r", self.group.key, j, peer, reason)
        if isinstance(reason, TRANSPORT_ERRORS):
            self.substitutes.mark_gone(j)
        await self._rereduce(j)

    async def _rereduce(self, j: int) -> None:
        """Part ``j`` failed here: re-reduce it as its substitute, or fetch it from that one."""
        s = substitute(j, self.num_members, self.group.clients)
        if s is None:
            logger.warning(
                "round %s: part %d missing, no member may re-reduce it", self.group.key, j
            )
            return
        if s == self.index:
            make = functools.partial(self._part_server, j, self.deadlines.rereducing())
            failed = await self.substitutes.reduce(j, make, functools.partial(self._chunk_sent, j))
            reason: Exception | None = None if failed is None else ProtocolError(failed)
        else:
            reason = await self._fetch(j, s, self.deadlines.rereduce)
        if reason is not None:
            logger.warning(
                "round %s: part %d missing, not re-reduced: %r", self.group.key, j, reason
            )
            return
        self.rereduced.add(j)
        logger.info("round %s: part %d re-reduced by member %d", self.group.key, j, s)

    def _part_server(self, j: int, deadlines: Deadlines) -> PartServer:
        """The server of part ``j`` here: this member's own, or one it re-reduces."""
        loop = asyncio.get_running_loop()
        return self.server_type(
            reducer=PartReducer(self.plan, part=j),
            group=self.group,
            me=self.p2p.peer_id,
            deadlines=deadlines,
            timeouts=self.timeouts,
            counter=self.counter,
            own_chunks=[loop.create_future() for _ in self.plan.chunks[j]],
            assembly=self.assembly,
            identity=self.identity,
            bans=self.bans,
        )

    async def _fetch(self, j: int, r: int, deadline: float) -> Exception | None:
        """Stream part ``j`` to member ``r`` and put the average it returns in the assembly,
        by ``deadline``; why it failed, or None. A stream cut in transport is opened once
        more (see the module docstring)."""
        loop = asyncio.get_running_loop()
        peer = self.group.members[r]
        for attempt in range(1 + STREAM_RETRIES):
            try:
                # not wait_for: a cancel coming as the exchange fails would leave its error
                # unretrieved, printed with a traceback (``runtime.event_loop.wait_set``)
                async with asyncio.timeout(deadline - loop.time()):
                    part = await self._exchange_inner(j, peer, r)
            except (ProtocolError, TimeoutError) as exc:
                return exc
            except TRANSPORT_ERRORS as exc:
                reason: Exception = exc
                if attempt < STREAM_RETRIES and deadline - loop.time() > 0.2:
                    logger.info("round %s: part %d stream cut (%r), again", self.group.key, j, exc)
                    await asyncio.sleep(0.1)
            else:
                assert part.mask is not None
                self.assembly.add(j, part.mask, torch.cat(part.values), part.digest())
                claims = PartClaims(part.mask, tuple(part.norms), tuple(part.block_norms))
                self.claims[j] = claims
                return None
        return reason

    @round_trips.exchange("part")
    async def _exchange_inner(self, j: int, peer: PeerID, r: int) -> AveragedPart:
        loop = asyncio.get_running_loop()
        opening = loop.time()
        reader, writer = await open_stream(
            self.p2p, peer, self.part_handler, self.timeouts.connect_timeout
        )
        self.starts.opened(loop.time() - opening)  # how long a stream may take (``silence``)

        async def send() -> None:
            for c in range(len(self.plan.chunks[j])):
                frame = await offload(span_len(self.plan.chunks[j][c]), self._part_frame, j, c)
                await write_frame(writer, Kind.PART, *frame, counter=self.counter)
            await write_frame(writer, Kind.SEAL, self._seal(j), counter=self.counter)
            self._record_part(j)

        sending = asyncio.create_task(send())
        kept = False
        try:
            part = AveragedPart(self.plan, j, r)

            def serving() -> None:
                if j == r:  # it runs the round: its own stream here is due (``silence``)
                    self.starts.serving(r)

            def not_member() -> None:
                self.not_members.add(r)
                self.not_member.set()

            signer = self.group.names[r] if self.identity is not None else None
            await read_reply(
                reader,
                part,
                self.plan,
                self.counter,
                signer=signer,
                on_chunk=serving,
                on_not_member=not_member,
            )
            if j == r:  # its reducer serves the stream on (``channel``)
                self.channels[r] = PartChannel(reader, writer, self.counter)
                kept = True
            return part
        finally:
            stop_sending(sending)
            if not kept:
                writer.close()

    def _start_checks(self, assembled: Assembled) -> asyncio.Task[dict[int, Judgement]] | None:
        """Start checking the parts of the other reducers, once all are held (``checking``)."""
        if self.own is None or not all(assembled.held):
            return None
        claims = {j: c for j, c in self.claims.items() if j not in self.rereduced}
        samples = draw_samples(self.plan, claims, assembled.delta, self.samples, self.rng)
        checker = Checker(
            p2p=self.p2p,
            group=self.group,
            plan=self.plan,
            own=self.own,
            deadlines=self.deadlines,
            timeouts=self.timeouts,
            handlers=self.check_handlers,
            counter=self.counter,
            channels=self.channels,
        )
        return asyncio.create_task(checker.run(samples, self._recording))

    async def answer_check(self, sender: PeerID, request: CheckRequest) -> Reject | bytes:
        """This member's signed CHECK_RES to member ``sender`` (twice per round at most:
        once more after a cut stream), or why not."""
        if sender not in self.group.members or sender == self.p2p.peer_id:
            return Reject(RejectCode.NOT_MEMBER, reason="not a member of this group")
        i = self.group.index(sender)
        self._asked[i] = self._asked.get(i, 0) + 1
        if self.own is None or self.identity is None or self._asked[i] > 2:
            return Reject(RejectCode.MISMATCH, reason="no checks here, or asked before")
        answer = await answer_check(
            sender=i,
            request=request,
            plan=self.plan,
            own=self.own,
            identity=self.identity,
            recorded=lambda: self._recorded,
            deadline=self.deadlines.check,
        )
        return answer if isinstance(answer, Reject) else answer.serialize()

    def exclude(self, peer: PeerID, reason: str) -> None:
        """Stop waiting for ``peer``'s contribution (it broke the protocol elsewhere)."""
        if peer in self.group.members and peer != self.p2p.peer_id:
            self.server.exclude(self.group.index(peer), reason)

    async def _exchange_reports(self, assembled: Assembled) -> None:
        """Send my report to everyone; wait for the full contributors' reports (bounded)."""
        report = Report(self.plan.tag, self.group.group_id, assembled.held, assembled.digest)
        await self.reports.exchange(report, assembled.full, self.deadlines.report)
