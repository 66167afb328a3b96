"""The reducer side of one all-reduce round over streams (docs/design.md "The round").

Member ``j`` reduces part ``j``: every other member opens a PART stream to it, sends its
chunks of the part and reads the averaged chunks back on the same stream. ``PartServer``
serves those streams for one round: it reads chunks by their deadlines into the
``PartReducer`` (which decides what counts), closes the gather, averages chunk by chunk
(large chunks in an executor: ``offload``), and streams every averaged chunk, with the
counted mask, to every member.
A stream cut in transport is not an offence: the member may open it again, and the
chunks it already delivered are skipped. An invalid or late chunk excludes its sender,
which is told so (REJECT BAD_PART) and, for invalid input (not for being late), commits
an offence (``bans``); a failed part is announced the same way. As the gather closes, a
first chunk whose norm is over ``max_norm_ratio`` times the group's median norm (never
this reducer's own norm alone: docs/design.md "Aggregation bounds") is invalid input too.
Contributions that clipping scaled down (``aggregation``) are logged.

After its last chunk a sender seals its part (SEAL: its signature over the chunks'
hashes) and after the last averaged chunk the reducer seals its own. With an ``identity``
(verification on) a seal that does not verify makes the last chunk invalid (so a part is
averaged only from sealed contributions), the reducer signs its seal, and the chunks
counted are kept with their seals until the round is forgotten: ``serve_evidence`` shows
them to a member that disputes the part (``verification``), once per member.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Callable, Sequence

import torch
from hivemind.p2p import PeerID

from diloco.errors import ProtocolError
from diloco.protocol.core.assembly import Assembly
from diloco.protocol.core.budget import Deadlines
from diloco.protocol.core.group import GroupInfo, RoundTimeouts
from diloco.protocol.core.round import Chunk, PartReducer
from diloco.protocol.runtime.event_loop import wait_set
from diloco.protocol.runtime.offload import offload
from diloco.protocol.runtime.streams import (
    TRANSPORT_ERRORS,
    read_body,
    read_frame,
    read_frame_header,
    send_reject,
    stop_sending,
    write_frame,
)
from diloco.protocol.trust.bans import BanList
from diloco.protocol.trust.identity import Identity
from diloco.protocol.trust.round_signatures import sign_averaged, verify_part
from diloco.protocol.wire.check import Evidence, EvidenceRequest, Seal
from diloco.protocol.wire.frames import (
    SIGNATURE_BYTES,
    ByteCounter,
    Frame,
    Kind,
    Reject,
    RejectCode,
)
from diloco.protocol.wire.part import Averaged, PartHead

logger = logging.getLogger(__name__)

FAILED = "part failed"
"""How the REJECT of a part this reducer could not average begins (``rereduction``)."""


class PartServer:
    """Serves this member's part of one round: PART streams in, AVERAGED chunks out."""

    def __init__(
        self,
        *,
        reducer: PartReducer,
        group: GroupInfo,
        me: PeerID,
        deadlines: Deadlines,
        timeouts: RoundTimeouts,
        counter: ByteCounter,
        own_chunks: Sequence[asyncio.Future[torch.Tensor]],
        assembly: Assembly,
        identity: Identity | None,
        bans: BanList,
    ) -> None:
        self.reducer, self.group, self.me = reducer, group, me
        self.identity, self.bans = identity, bans
        self.deadlines, self.timeouts, self.counter = deadlines, timeouts, counter
        self.own_chunks, self.assembly = own_chunks, assembly
        self.plan = reducer.plan
        self._changed = asyncio.Event()
        self._live: set[int] = set()
        """Members with a PART stream open to this reducer (at most one each)."""
        self._serving = 0
        self.idle = asyncio.Event()
        """Set while no PART stream is being served."""
        self.idle.set()
        self.sealed: set[int] = set()
        """Members this reducer wrote its whole averaged part and its seal to: their PART
        streams go on with their REPORT and CHECK_REQ (``channel``)."""
        self._evidence_served: set[int] = set()

    def _touch(self) -> None:
        """Wake every ``_wait``: some state they look at changed."""
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def _wait(self, predicate: Callable[[], bool], deadline: float) -> bool:
        """Wait until ``predicate()`` holds or ``deadline`` (loop time); return it."""
        loop = asyncio.get_running_loop()
        while not predicate():
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            await wait_set(self._changed, remaining)
        return True

    async def reduce(self) -> None:
        """Fix who counts once chunk 0 is in from all (or the deadline), then average and
        publish chunk by chunk; the part joins the assembly unless a counted member
        stopped mid-part."""
        reducer, key, index = self.reducer, self.group.key, self.reducer.part
        await self._wait(reducer.gather_complete, self.deadlines.gather)
        for j, reason in reducer.exclude_oversized().items():
            logger.warning("round %s: excluding member %d: %s", key, j, reason)
            self.bans.offend(self.group.members[j], f"round {key}: invalid PART: {reason}")
        absent = reducer.close_gather()
        self._touch()
        if absent:
            logger.warning(
                "round %s part %d: averaging without members %s (%s)",
                key,
                index,
                list(absent),
                absent,
            )
        decoded: list[torch.Tensor] = []
        for c in range(reducer.num_chunks):
            await self._wait(functools.partial(reducer.chunk_ready, c), self.deadlines.part)
            stopped = reducer.stopped(c)
            if stopped:
                reducer.fail(f"members {stopped} stopped sending mid-part")
                self._touch()
                logger.warning("round %s part %d failed: %s", key, index, reducer.failed)
                return
            own = await self.own_chunks[c]
            # sized by the chunk: encoding the mean once costs more than adding the inputs
            msg, mean, clipped = await offload(own.numel(), self.average_chunk, c, own)
            if clipped:
                logger.info("round %s part %d chunk %d: clipped members %s", key, index, c, clipped)
            reducer.release(c)
            reducer.add_average(c, msg)
            self._touch()
            decoded.append(mean)
        assert reducer.mask is not None
        digest = reducer.digest()
        if self.identity is None:
            reducer.seal = bytes(SIGNATURE_BYTES)
        else:
            reducer.seal = sign_averaged(self.identity, self.plan.seal_head(index), digest)
        self._touch()
        self.assembly.add(index, reducer.mask, torch.cat(decoded), digest)

    def average_chunk(self, c: int, own: torch.Tensor) -> tuple[Averaged, torch.Tensor, list[int]]:
        """Averaged chunk ``c``, its decoded values and the members clipped (runs in an
        executor; ``PartReducer.average``)."""
        return self.reducer.average(c, own)

    async def accept_part(
        self,
        sender: PeerID,
        frame: Frame,
        head: PartHead,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> Reject | None:
        """Serve one member's PART stream (the handler already read its first frame header
        and part head): read its chunks while streaming the averaged chunks back.

        Returns the refusal to send when the sender is not served (any more).
        """
        self._serving += 1
        self.idle.clear()
        try:
            return await self._accept_part(sender, frame, head, reader, writer)
        finally:
            self._serving -= 1
            if self._serving == 0:
                self.idle.set()

    async def _accept_part(
        self,
        sender: PeerID,
        frame: Frame,
        head: PartHead,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> Reject | None:
        self.counter.received += Frame.SIZE + PartHead.SIZE
        if sender not in self.group.members or sender == self.me:
            logger.warning("round %s: PART from non-member %s", self.group.key, sender)
            return Reject(RejectCode.NOT_MEMBER, reason="not a member of this group")
        j = self.group.index(sender)
        # A stream opened again after a cut may come before its reducer saw the cut.
        if not await self._wait(lambda: j not in self._live, self.deadlines.part):
            logger.warning("round %s: second PART stream from member %d", self.group.key, j)
            return None
        if j in self.reducer.excluded:
            return _bad_part(f"excluded: {self.reducer.excluded[j]}")
        self._live.add(j)
        try:
            return await self._serve_member(j, frame, head, reader, writer)
        finally:
            self._live.discard(j)
            self._touch()

    async def _serve_member(
        self,
        j: int,
        frame: Frame,
        head: PartHead,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> Reject | None:
        loop = asyncio.get_running_loop()
        sending = asyncio.create_task(self._send_averages(j, writer))
        try:
            await self._read_chunks(j, frame, head, reader)
        except TRANSPORT_ERRORS as exc:
            # Cut in transport: the member may open the stream again (until the deadlines).
            logger.info("round %s: PART stream of member %d cut: %r", self.group.key, j, exc)
            stop_sending(sending)
            return None
        except (ProtocolError, asyncio.TimeoutError) as exc:  # bad input, or too slow
            self.exclude(j, str(exc) if isinstance(exc, ProtocolError) else repr(exc))
            if isinstance(exc, ProtocolError):
                peer = self.group.members[j]
                self.bans.offend(peer, f"round {self.group.key}: invalid PART: {exc}")
            stop_sending(sending)
            return _bad_part(f"excluded: {self.reducer.excluded[j]}")
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(sending, max(0.0, self.deadlines.report - loop.time()))
        return None

    async def _read_chunks(
        self, j: int, frame: Frame, head: PartHead, reader: asyncio.StreamReader
    ) -> None:
        """Read member ``j``'s chunks of this part into the reducer, each by its deadline.

        Raises:
            ProtocolError: an invalid chunk (the caller excludes ``j``).
            asyncio.TimeoutError: a chunk came too late (likewise).
        """
        loop = asyncio.get_running_loop()
        reducer, index = self.reducer, self.reducer.part
        last: Chunk | None = None  # counted only once the seal over it verifies
        for c, (a, b) in enumerate(reducer.chunks):
            counting = reducer.counting(j, c)
            deadline = self.deadlines.gather if c == 0 and counting else self.deadlines.part
            if c > 0:
                frame = await asyncio.wait_for(
                    read_frame_header(reader, self.counter), max(0.0, deadline - loop.time())
                )
                if frame.kind != Kind.PART or frame.body_len < PartHead.SIZE:
                    raise ProtocolError(f"{frame.kind.name} where chunk {c} was due")
                head = PartHead.parse(await read_body(reader, PartHead.SIZE, self.counter))
            if head != self.plan.head(index, c):
                raise ProtocolError(f"chunk {head.part}/{head.chunk}, expected {index}/{c}")
            size = self.plan.codec.encoded_size(b - a)
            if frame.body_len != PartHead.SIZE + size:
                raise ProtocolError(
                    f"chunk of {frame.body_len - PartHead.SIZE} bytes, expected {size}"
                )
            payload = await asyncio.wait_for(
                read_body(reader, size, self.counter), max(0.0, deadline - loop.time())
            )
            if not counting or not reducer.wants(j, c):
                continue  # late, or sent again after a cut: read to keep the stream flowing
            chunk = await offload(b - a, reducer.check_chunk, c, payload)
            if c == reducer.num_chunks - 1:
                last = chunk
            elif reducer.add_chunk(j, c, chunk):
                self._touch()
        _, body = await asyncio.wait_for(
            read_frame(reader, (Kind.SEAL,), Seal.SIZE, self.counter),
            max(0.0, self.deadlines.part - loop.time()),
        )
        seal = Seal.parse(body)
        if seal.head != self.plan.seal_head(index):
            raise ProtocolError("SEAL of another part")
        if last is not None:
            if self.identity is not None:
                hashes = [*reducer.hashes(j), last.sha256]
                sender = self.group.names[j]
                verify_part(sender, seal.head, hashes, seal.signature)  # less than a hop
                reducer.seals[j] = seal.signature
            if reducer.add_chunk(j, reducer.num_chunks - 1, last):
                self._touch()

    async def _send_averages(self, j: int, writer: asyncio.StreamWriter) -> None:
        """Stream the averaged chunks to member ``j`` as the reduction produces them."""
        reducer = self.reducer
        for c in range(reducer.num_chunks):
            ready = functools.partial(_ready_for, reducer, j, c)
            done = await self._wait(ready, self.deadlines.part)
            if j in reducer.excluded:  # by its norm, as the gather closed
                reject = _bad_part(f"excluded: {reducer.excluded[j]}")
                await send_reject(writer, reject, self.timeouts.reply_timeout)
                writer.close()
                return
            if not done or reducer.failed:
                reason = f"{FAILED}: {reducer.failed or 'deadline'}"
                await send_reject(writer, _bad_part(reason), self.timeouts.reply_timeout)
                writer.close()  # the member sees the part missing
                return
            msg = reducer.averaged[c]
            await write_frame(
                writer, Kind.AVERAGED, msg.prefix(), msg.payload, counter=self.counter
            )
        await self._wait(lambda: reducer.seal is not None, self.deadlines.part)
        if reducer.seal is None:
            return  # the member sees the part missing
        seal = Seal(self.plan.seal_head(reducer.part), reducer.seal)
        await write_frame(writer, Kind.SEAL, seal.serialize(), counter=self.counter)
        self.sealed.add(j)

    async def serve_evidence(
        self, sender: PeerID, request: EvidenceRequest, writer: asyncio.StreamWriter
    ) -> Reject | None:
        """Show a member that disputes this part the signed chunks it asks for (once per
        member and round), one EVIDENCE frame each; refuse what this reducer never counted."""
        if sender not in self.group.members or sender == self.me:
            return Reject(RejectCode.NOT_MEMBER, reason="not a member of this group")
        i = self.group.index(sender)
        reducer = self.reducer
        if request.part != reducer.part or i in self._evidence_served:
            return Reject(RejectCode.MISMATCH, reason="not this reducer's part, or asked before")
        held = [reducer.received.get(m, []) for m, _ in request.items]
        if not all(
            m in reducer.counted and c < len(h)
            for (m, c), h in zip(request.items, held, strict=True)
        ):
            return Reject(RejectCode.MISMATCH, reason="asks for chunks this reducer did not count")
        self._evidence_served.add(i)
        logger.info("round %s: member %d disputes part %d", self.group.key, i, reducer.part)
        for (m, c), chunks in zip(request.items, held, strict=True):
            hashes = tuple(chunk.sha256 for chunk in chunks)
            seal = reducer.seals.get(m, bytes(SIGNATURE_BYTES))
            prefix = Evidence(m, c, seal, hashes, chunks[c].payload).prefix()
            await write_frame(
                writer, Kind.EVIDENCE, prefix, chunks[c].payload, counter=self.counter
            )
        return None

    def exclude(self, j: int, reason: str) -> None:
        """Count nothing more from member ``j`` (logged once)."""
        if self.reducer.exclude(j, reason):
            logger.warning("round %s: excluding member %d: %s", self.group.key, j, reason)
            self._touch()


def _ready_for(reducer: PartReducer, j: int, c: int) -> bool:
    """Averaged chunk ``c`` can go to member ``j``, or never will (``j`` was excluded)."""
    return reducer.averaged_ready(c) or j in reducer.excluded


def _bad_part(reason: str) -> Reject:
    return Reject(RejectCode.BAD_PART, reason=reason[:200])
