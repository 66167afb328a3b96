"""The verification phase of a round over streams: checks, answers, disputes.

``verification`` decides what the bytes mean; this module moves them. Member side
(``Checker``): once it holds every part, a member asks every other member (CHECK_REQ) for
its contribution at the sampled blocks of the parts that member is counted in (on the
stream that member's own part came on, ``channel``, else on a CHECK stream), checks every
part, and in a dispute asks the part's reducer for its evidence (EVIDENCE_REQ). Serving
side: ``answer_check`` answers a CHECK_REQ from what this member sent, signed; the reducer
side of a dispute is ``PartServer.serve_evidence``. Answers are due by ``Deadlines.check``
and evidence by ``Deadlines.dispute``; what has not come by then is missing, which
``verification`` weighs (a silent reducer is convicted, a silent sender's chunks are taken
from the evidence). Checking and decoding of a few sampled blocks run on the event loop;
of disputed evidence, in the default executor (``offload``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import Callable, Mapping

from hivemind.p2p import PeerID

from diloco.errors import ProtocolError
from diloco.protocol.allreduce.channel import PartChannel
from diloco.protocol.core.agreement import ANOTHER_RESULT
from diloco.protocol.core.budget import Deadlines
from diloco.protocol.core.group import GroupInfo, RoundTimeouts
from diloco.protocol.core.norms import BLOCK_VALUES, num_blocks
from diloco.protocol.core.round import RoundPlan
from diloco.protocol.core.verification import (
    RAW,
    Answer,
    Findings,
    Judgement,
    OwnContribution,
    Sample,
    check_part,
    judge,
    own_answers,
    read_answers,
    wanted_evidence,
)
from diloco.protocol.runtime import round_trips
from diloco.protocol.runtime.event_loop import wait_set
from diloco.protocol.runtime.offload import offload
from diloco.protocol.runtime.streams import (
    TRANSPORT_ERRORS,
    StreamTransport,
    open_stream,
    read_frame,
    write_frame,
)
from diloco.protocol.trust.bans import BanList
from diloco.protocol.trust.identity import Identity
from diloco.protocol.trust.round_signatures import sign_check, verify_check, verify_part
from diloco.protocol.wire.check import (
    CheckEntry,
    CheckRequest,
    CheckResponse,
    Evidence,
    EvidenceRequest,
)
from diloco.protocol.wire.frames import ByteCounter, Kind, Reject, RejectCode

logger = logging.getLogger(__name__)

_FAILED: tuple[type[Exception], ...] = (ProtocolError, *TRANSPORT_ERRORS)
"""What ends a peer's answer early, besides its deadline."""


def convict(group: GroupInfo, judgements: Mapping[int, Judgement], bans: BanList) -> str:
    """Ban every liar the ``judgements`` name (a reducer blamed only for silence commits an
    offence instead, ``bans``); return why the round fails here (reducers that lied), or
    an empty string."""
    failed = []
    for j, judgement in sorted(judgements.items()):
        for i, offence in sorted(judgement.senders.items()):
            logger.warning("round %s: member %s lied: %s", group.key, group.names[i], offence)
            bans.ban(group.members[i], f"round {group.key}: {offence}")
        if judgement.reducer:
            failed.append(f"reducer {group.names[j]} of part {j} lied: {judgement.reducer}")
            logger.warning("round %s: %s", group.key, failed[-1])
            why = f"round {group.key} part {j}: {judgement.reducer}"
            if judgement.silent:
                bans.offend(group.members[j], why, silence=True)
            else:
                bans.ban(group.members[j], why)
    return "; ".join(failed)


def blame(group: GroupInfo, dissent: Mapping[int, str], accepted: bool, bans: BanList) -> None:
    """Log each member that dissented from this member's result (``agreement.decide``); with
    the majority behind that result, one that reported another commits an offence."""
    for i, how in dissent.items():
        peer = group.members[i]
        level = logging.WARNING if how == ANOTHER_RESULT else logging.INFO
        logger.log(level, "round %s: member %d (%s) %s", group.key, i, peer, how)
        if accepted and how == ANOTHER_RESULT:
            bans.offend(peer, f"round {group.key}: {how}, not the majority's")


class Checker:
    """One member's checks of the parts of one round that it did not reduce."""

    def __init__(
        self,
        *,
        p2p: StreamTransport,
        group: GroupInfo,
        plan: RoundPlan,
        own: OwnContribution,
        deadlines: Deadlines,
        timeouts: RoundTimeouts,
        handlers: tuple[str, str],
        counter: ByteCounter,
        channels: Mapping[int, PartChannel],
    ) -> None:
        self.p2p, self.group, self.plan, self.own = p2p, group, plan, own
        self.deadlines, self.timeouts, self.counter = deadlines, timeouts, counter
        self.check_handler, self.evidence_handler = handlers
        self.channels = channels
        """By member: the PART stream its part came on (``channel``)."""
        self.answers: dict[int, dict[int, Answer]] = {}

    async def run(
        self, samples: Mapping[int, Sample], recording: asyncio.Future[list[None]] | None = None
    ) -> dict[int, Judgement]:
        """Check every sampled part; a part with no dispute gets an empty ``Judgement``.
        ``recording`` records this member's own chunks, which its own answers need."""
        loop = asyncio.get_running_loop()
        if recording is not None:
            await asyncio.shield(recording)
        me = self.plan.index
        self.answers = {j: {} for j in samples}
        asks = [
            asyncio.create_task(
                self._ask(i, {j: s for j, s in samples.items() if s.claims.mask[i]})
            )
            for i in range(self.plan.num_members)
            if i != me
        ]
        try:
            mine = [(j, s.blocks) for j, s in sorted(samples.items()) if s.claims.mask[me]]
            if mine:  # while the others answer
                size = sum(samples[j].size(self.plan) for j, _ in mine)
                own = await offload(size, own_answers, self.own, mine)
                for j, answer in own.items():
                    self.answers[j][me] = answer
            await asyncio.wait(asks, timeout=max(0.0, self.deadlines.check - loop.time()))
        finally:
            for task in asks:
                task.cancel()
        findings: dict[int, Findings] = {}
        for j, sample in samples.items():
            size = sample.size(self.plan) * len(sample.claims.counted)
            findings[j] = await offload(size, check_part, self.plan, sample, self.answers[j])
        disputes: dict[int, asyncio.Task[Judgement]] = {
            j: asyncio.create_task(self._dispute(samples[j], findings[j]))
            for j in samples
            if findings[j].disputed
        }
        try:
            return {
                j: await disputes[j]
                if j in disputes
                else Judgement(findings[j].reducer, silent=findings[j].silent)
                for j in samples
            }
        finally:
            for dispute in disputes.values():
                dispute.cancel()

    @round_trips.exchange("check")
    async def _ask(self, i: int, samples: Mapping[int, Sample]) -> None:
        """Ask member ``i`` about ``samples``; keep its answers if they check out."""
        if not samples:
            return
        parts = tuple((j, samples[j].blocks) for j in sorted(samples))
        request = CheckRequest(self.plan.tag, self.group.group_id, parts)
        sizes = [CheckEntry.size(len(xs), len(self.plan.chunks[j])) for j, xs in parts]
        n = sum(s.size(self.plan) for s in samples.values())
        limit = CheckResponse.size(sizes, max(self.plan.codec.encoded_size(n), RAW.encoded_size(n)))
        peer = self.group.members[i]
        channel = self.channels.get(i)
        for attempt in range(2):
            try:
                if attempt == 0 and channel is not None and not channel.broken:
                    kind, body = await channel.ask(
                        Kind.CHECK_REQ, request.serialize(), (Kind.CHECK_RES,), limit
                    )
                else:
                    kind, body = await self._ask_on_stream(peer, request, limit)
                if kind == Kind.REJECT:
                    raise ProtocolError(f"refused: {Reject.parse(body).reason}")
                answers = await offload(n, self._read_answers, i, request, body)
                for j, answer in answers.items():
                    self.answers[j][i] = answer
                return
            except (ProtocolError, asyncio.TimeoutError) as exc:
                logger.info("round %s: no check answer from %s: %r", self.group.key, peer, exc)
                return
            except TRANSPORT_ERRORS as exc:
                if attempt:
                    logger.info("round %s: check stream to %s: %r", self.group.key, peer, exc)

    async def _ask_on_stream(
        self, peer: PeerID, request: CheckRequest, limit: int
    ) -> tuple[Kind, bytearray]:
        """Send ``request`` on a CHECK stream of its own to ``peer``; its answer."""
        reader, writer = await open_stream(
            self.p2p, peer, self.check_handler, self.timeouts.connect_timeout
        )
        try:
            await write_frame(writer, Kind.CHECK_REQ, request.serialize())
            return await read_frame(reader, (Kind.CHECK_RES,), limit, self.counter)
        finally:
            writer.close()

    def _read_answers(self, i: int, request: CheckRequest, body: bytearray) -> dict[int, Answer]:
        """Member ``i``'s answers from its CHECK_RES, checked against the request."""
        response = CheckResponse.parse(body)
        verify_check(self.group.names[i], response)
        if (response.tag, response.group_id) != (request.tag, request.group_id):
            raise ProtocolError("CHECK_RES for another round")
        if [(e.part, e.blocks) for e in response.entries] != list(request.parts):
            raise ProtocolError("CHECK_RES answers other blocks than asked")
        norms = [entry.norms for entry in response.entries]
        return read_answers(self.plan, request.parts, norms, response.payload)

    async def _dispute(self, sample: Sample, findings: Findings) -> Judgement:
        """Ask the reducer of ``sample.part`` for its evidence, then judge."""
        loop = asyncio.get_running_loop()
        j = sample.part
        wanted = wanted_evidence(self.plan, sample, findings)
        logger.warning(
            "round %s: part %d disputed (blocks %s, norms %s, silent %s); asking its reducer",
            self.group.key,
            j,
            findings.blocks,
            findings.norms,
            findings.missing,
        )
        evidence: dict[tuple[int, int], bytes | str] = {}
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(
                self._evidence(j, wanted, evidence),
                max(0.0, self.deadlines.dispute - loop.time()),
            )
        args = (self.plan, sample, self.answers[j], evidence, wanted)
        return await loop.run_in_executor(None, judge, *args)

    @round_trips.exchange("evidence")
    async def _evidence(
        self, j: int, wanted: list[tuple[int, int]], evidence: dict[tuple[int, int], bytes | str]
    ) -> None:
        """Read the evidence of reducer ``j`` into ``evidence`` as it comes."""
        loop = asyncio.get_running_loop()
        request = EvidenceRequest(self.plan.tag, self.group.group_id, j, tuple(wanted))
        try:
            reader, writer = await open_stream(
                self.p2p,
                self.group.members[j],
                self.evidence_handler,
                self.timeouts.connect_timeout,
            )
            try:
                await write_frame(writer, Kind.EVIDENCE_REQ, request.serialize())
                chunks = self.plan.chunks[j]
                for i, c in wanted:
                    payload = self.plan.codec.encoded_size(chunks[c][1] - chunks[c][0])
                    limit = Evidence.size(len(chunks), payload)
                    kind, body = await read_frame(reader, (Kind.EVIDENCE,), limit, self.counter)
                    if kind == Kind.REJECT:
                        logger.warning("reducer %d refused evidence: %s", j, Reject.parse(body))
                        return
                    item = Evidence.parse(body)
                    if (item.member, item.chunk) != (i, c):
                        raise ProtocolError("EVIDENCE out of order")
                    evidence[(i, c)] = await loop.run_in_executor(None, self._signed, j, item)
            finally:
                writer.close()
        except _FAILED as exc:
            logger.info("round %s: evidence of part %d: %r", self.group.key, j, exc)

    def _signed(self, j: int, item: Evidence) -> bytes | str:
        """The payload of a PART chunk in evidence, or why its sender's seal does not cover
        it (in an executor)."""
        if len(item.hashes) != len(self.plan.chunks[j]):
            return f"a seal over {len(item.hashes)} chunks"
        if hashlib.sha256(item.payload).digest() != item.hashes[item.chunk]:
            return "not the chunk its sender sealed"
        sender, seal = self.group.names[item.member], self.plan.seal_head(j)
        try:
            verify_part(sender, seal, item.hashes, item.signature)
        except ProtocolError as exc:
            return f"not sealed by its sender: {exc}"
        return bytes(item.payload)


async def answer_check(
    *,
    sender: int,
    request: CheckRequest,
    plan: RoundPlan,
    own: OwnContribution,
    identity: Identity,
    recorded: Callable[[], asyncio.Event],
    deadline: float,
) -> CheckResponse | Reject:
    """This member's signed answer to member ``sender``'s CHECK_REQ, once every chunk of the
    parts asked was recorded (``recorded()`` is set on each record; ``deadline`` bounds the
    wait); a REJECT for parts it did not send or blocks outside them."""
    loop = asyncio.get_running_loop()
    if (request.tag, request.group_id) != (plan.tag, plan.group_id):
        return Reject(RejectCode.MISMATCH, reason="another round or group")
    for j, blocks in request.parts:
        if j >= plan.num_members or blocks[-1] >= num_blocks(plan.spans[j]):
            return Reject(RejectCode.MISMATCH, reason=f"part {j} has no block {blocks[-1]}")
    parts = [j for j, _ in request.parts]
    while not all(own.complete(j) for j in parts):
        event = recorded()
        if loop.time() >= deadline:
            return Reject(RejectCode.MISMATCH, reason=f"member {sender} asked for unsent parts")
        await wait_set(event, deadline - loop.time())
    size = BLOCK_VALUES * sum(len(blocks) for _, blocks in request.parts)  # at most
    return await offload(size, _answer, request, own, identity)


def _answer(request: CheckRequest, own: OwnContribution, identity: Identity) -> CheckResponse:
    payload, norms = own.answer(request.parts)
    entries = tuple(CheckEntry(j, xs, n) for (j, xs), n in zip(request.parts, norms, strict=True))
    return sign_check(identity, CheckResponse(request.tag, request.group_id, entries, payload, b""))
