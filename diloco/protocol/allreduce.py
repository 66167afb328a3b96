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
* Then every member sends every other member a REPORT (which parts it holds, sha256 of the
  averaged payloads and masks it assembled the result from: the same bytes give the same
  values) and waits, up to ``report_timeout``, for the reports of the *full
  contributors*: members counted in every part it holds. The round succeeds for a member
  iff it holds every part and every full contributor's report that arrived says "every
  part, same sha256"; otherwise it fails for that member (``RoundFailed``) and its outer
  state stays unchanged. One part missing at a full contributor therefore fails the round
  for everyone who hears of it, while a peer excluded for bad input (not a full
  contributor) cannot veto the others' round. ``RoundResult.members`` are the full
  contributors, identical on every member because the masks travel with the parts.
* In a butterfly every member is a reducer, so a member that dies before delivering its
  averaged part fails the round for all (SPEC 4 allows "all treat the round as failed");
  one that dies after delivering it, before its own contributions arrived, is simply not
  counted.
* Residual risk (two generals): a report that is lost while its sender stays alive can
  leave that sender with a different outcome. The fragment state version and hash that
  every node publishes in its DHT record detect this (``records.divergent_peers``); the
  node then heals by state transfer (``Swarm.fetch_state``).

Encoding and decoding run in the default executor so the event loop keeps serving streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
from collections.abc import Callable
from typing import Any

import torch
from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo

from diloco.codecs import Codec, CodecError
from diloco.errors import ProtocolError, RoundFailed
from diloco.protocol import wire
from diloco.protocol.group import GroupInfo, RoundTimeouts
from diloco.protocol.partition import PART_ALIGN, butterfly_parts
from diloco.protocol.reducer import RoundKey, RoundResult, weighted_mean
from diloco.protocol.wire import ByteCounter, Kind, PartHead, Reject, RejectCode, Report, RoundTag

logger = logging.getLogger(__name__)

_U16_BYTES = 2


def check_values(x: torch.Tensor, reference_norm: float, max_norm_ratio: float) -> None:
    """Raise ProtocolError unless ``x`` is finite and its norm is within the bound.

    The bound is ``max_norm_ratio * reference_norm``; a zero reference (this node's own
    part is all zeros) leaves only the finiteness check, since no scale is known. A finite
    FP32 norm proves every value finite, so the common case takes one pass.
    """
    norm = float(torch.linalg.vector_norm(x))
    if not math.isfinite(norm):
        if not bool(torch.isfinite(x).all()):
            raise ProtocolError("values are not all finite")
        norm = float(torch.linalg.vector_norm(x, dtype=torch.float64))  # FP32 overflowed
    if reference_norm > 0 and norm > max_norm_ratio * reference_norm:
        raise ProtocolError(f"norm {norm:.3g} > {max_norm_ratio:g} x own norm {reference_norm:.3g}")


CHUNK_VALUES = 1 << 18
"""Values per chunk of a part (a multiple of ``PART_ALIGN``): 1 MiB as FP32, 136 KiB as E3M0."""


def chunk_spans(lo: int, hi: int, chunk_values: int = CHUNK_VALUES) -> list[tuple[int, int]]:
    """Cut part ``[lo, hi)`` into consecutive chunks; an empty part is one empty chunk.

    Chunks start at multiples of ``chunk_values`` from ``lo`` (itself a multiple of
    ``PART_ALIGN``), so encoding chunk by chunk decodes to the same values as encoding the
    whole part, as the in-process reducer does.
    """
    if chunk_values % PART_ALIGN:
        raise ValueError(f"chunk_values must be a multiple of {PART_ALIGN}")
    if hi <= lo:
        return [(lo, lo)]
    return [(a, min(a + chunk_values, hi)) for a in range(lo, hi, chunk_values)]


class AllReduceRunner:
    """One member's side of one round's all-reduce: sender of ``M - 1`` parts, reducer of one."""

    def __init__(
        self,
        *,
        p2p: P2P,
        group: GroupInfo,
        digest: bytes,
        codec: Codec,
        return_codec: Codec,
        delta: torch.Tensor,
        timeouts: RoundTimeouts,
        max_norm_ratio: float,
        part_handler: str,
        report_handler: str,
    ) -> None:
        if codec.codec_id != group.codec_id or return_codec.codec_id != group.return_codec_id:
            raise ValueError("codecs differ from the group's")
        self.p2p, self.group, self.codec, self.return_codec = p2p, group, codec, return_codec
        self.delta, self.timeouts, self.max_norm_ratio = delta, timeouts, max_norm_ratio
        self.part_handler, self.report_handler = part_handler, report_handler
        self.tag = RoundTag(digest, group.key.fragment, group.key.round)
        self.index = group.index(p2p.peer_id)
        self.num_members = len(group.members)
        self.spans = butterfly_parts(group.numel, self.num_members)
        self.chunks = [chunk_spans(lo, hi) for lo, hi in self.spans]
        self.chunk_norms = [
            [float(torch.linalg.vector_norm(delta[a:b])) for a, b in part] for part in self.chunks
        ]
        self.counter = ByteCounter()
        loop = asyncio.get_running_loop()
        self._own_chunks: list[asyncio.Future[torch.Tensor]] = [
            loop.create_future() for _ in self.chunks[self.index]
        ]
        self._received: dict[int, list[torch.Tensor]] = {}
        self._started: set[int] = set()
        self._excluded: dict[int, str] = {}
        self._live: set[int] = set()
        """Members with a PART stream open to this reducer (at most one each)."""
        self._mask: tuple[bool, ...] | None = None
        self._part_digests: dict[int, bytes] = {}
        """sha256 over the mask and averaged payloads of every part held, by part."""
        self._averaged_chunks: list[bytes] = []
        self._part_failed: str | None = None
        self._changed = asyncio.Event()
        self._reports: dict[int, Report] = {}
        self._report_arrived = asyncio.Event()
        self._serving = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._gather_closed = False
        self.delivered = 0
        """Members this reducer wrote its whole averaged part to so far."""
        self._t0 = loop.time()

    @property
    def gather_deadline(self) -> float:
        return self._t0 + self.timeouts.sender_timeout

    @property
    def part_deadline(self) -> float:
        return self.gather_deadline + self.timeouts.reducer_timeout

    @property
    def report_deadline(self) -> float:
        return self.part_deadline + self.timeouts.report_timeout

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
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), remaining)
        return True

    async def run(self) -> RoundResult:
        """Exchange parts, agree by reports, and return the round's result.

        Raises:
            RoundFailed: a part is missing here or at a member that reported, or results
                differ; the caller must then leave its outer state unchanged.
        """
        loop = asyncio.get_running_loop()
        key = self.group.key
        reduce_task = asyncio.create_task(self._reduce_own_part())
        exchanges = {
            j: asyncio.create_task(self._exchange(j))
            for j in range(self.num_members)
            if j != self.index
        }
        try:
            for c, future in enumerate(self._own_chunks):
                future.set_result(await loop.run_in_executor(None, self._encode_own, c))
            encoded = loop.time()
            own = await reduce_task
            reduced = loop.time()
            others = {j: await task for j, task in exchanges.items()}
        finally:
            for task in (reduce_task, *exchanges.values()):
                task.cancel()
        parts = {j: r for j, r in others.items() if r is not None}
        if own is not None:
            parts[self.index] = own
        held = tuple(j in parts for j in range(self.num_members))
        result = torch.zeros(self.group.numel, dtype=torch.float32)
        for j, (_, values) in parts.items():
            lo, hi = self.spans[j]
            result[lo:hi] = values
        assembled = loop.time()
        digest = hashlib.sha256(b"".join(self._part_digests[j] for j in sorted(parts))).digest()
        full = tuple(all(bits[i] for bits, _ in parts.values()) for i in range(self.num_members))
        await self._exchange_reports(held, digest, full)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._idle.wait(), max(0.0, self.report_deadline - loop.time()))
        logger.info(
            "round %s: encoded %.3fs, own part averaged %.3fs, all parts %.3fs, agreed %.3fs",
            key,
            encoded - self._t0,
            reduced - self._t0,
            assembled - self._t0,
            loop.time() - self._t0,
        )

        if not all(held):
            missing = [j for j, ok in enumerate(held) if not ok]
            raise RoundFailed(key.fragment, key.round, f"parts {missing} missing here")
        for i, report in sorted(self._reports.items()):
            if not full[i]:
                continue
            if not all(report.parts):
                raise RoundFailed(key.fragment, key.round, f"member {i} is missing parts")
            if report.digest != digest:
                raise RoundFailed(key.fragment, key.round, f"member {i} assembled another result")
        return RoundResult(
            delta=result,
            members=tuple(n for n, ok in zip(self.group.names, full, strict=True) if ok),
            bytes_sent=self.counter.sent,
            bytes_received=self.counter.received,
            seconds=loop.time() - self._t0,
        )

    def _encode_own(self, c: int) -> torch.Tensor:
        """Chunk ``c`` of my own contribution to my part, through the codec like the others."""
        a, b = self.chunks[self.index][c]
        return self.codec.decode(self.codec.encode(self.delta[a:b].contiguous()))

    def _encode_chunk(self, j: int, c: int) -> bytes:
        """Payload of chunk ``c`` of part ``j`` (sent to reducer ``j``)."""
        a, b = self.chunks[j][c]
        return self.codec.encode(self.delta[a:b].contiguous())

    async def _reduce_own_part(self) -> tuple[tuple[bool, ...], torch.Tensor] | None:
        """Fix who counts once chunk 0 is in from all (or the deadline), then average and
        publish chunk by chunk; None if a counted member stopped mid-part."""
        loop = asyncio.get_running_loop()
        others = [j for j in range(self.num_members) if j != self.index]
        await self._wait(
            lambda: all(j in self._started or j in self._excluded for j in others),
            self.gather_deadline,
        )
        counted = sorted((self._started - set(self._excluded)) | {self.index})
        self._mask = tuple(i in counted for i in range(self.num_members))
        self._gather_closed = True
        self._touch()
        absent = [i for i in range(self.num_members) if i not in counted]
        if absent:
            logger.warning(
                "round %s part %d: averaging without members %s (%s)",
                self.group.key,
                self.index,
                absent,
                {i: self._excluded.get(i, "nothing sent") for i in absent},
            )
        weights = [self.group.weights[i] for i in counted]
        senders = [i for i in counted if i != self.index]
        decoded: list[torch.Tensor] = []
        for c in range(len(self.chunks[self.index])):

            def ready(c: int = c) -> bool:
                return all(len(self._received[i]) > c or i in self._excluded for i in senders)

            await self._wait(ready, self.part_deadline)
            failed = [i for i in senders if i in self._excluded or len(self._received[i]) <= c]
            if failed:
                self._part_failed = f"members {failed} stopped sending mid-part"
                self._touch()
                logger.warning(
                    "round %s part %d failed: %s", self.group.key, self.index, self._part_failed
                )
                return None
            own = await self._own_chunks[c]
            values = [own if i == self.index else self._received[i][c] for i in counted]
            encoded, mean = await loop.run_in_executor(None, self._average, values, weights)
            self._averaged_chunks.append(encoded)
            self._touch()
            decoded.append(mean)
        self._part_digests[self.index] = _part_digest(self._mask, self._averaged_chunks)
        return self._mask, torch.cat(decoded)

    def _average(
        self, values: list[torch.Tensor], weights: list[float]
    ) -> tuple[bytes, torch.Tensor]:
        encoded = self.return_codec.encode(weighted_mean(values, weights))
        return encoded, self.return_codec.decode(encoded)

    async def _exchange(self, j: int) -> tuple[tuple[bool, ...], torch.Tensor] | None:
        """Stream part ``j`` to its reducer and read the average back; None if it did not.

        A stream cut in transport is opened once more (see the module docstring).
        """
        loop = asyncio.get_running_loop()
        peer = self.group.members[j]
        for attempt in range(1 + _PART_STREAM_RETRIES):
            try:
                return await asyncio.wait_for(
                    self._exchange_inner(j, peer), self.part_deadline - loop.time()
                )
            except (ProtocolError, asyncio.TimeoutError) as exc:
                reason: Exception = exc
                break
            except Exception as exc:  # refused or cut in transport
                reason = exc
                if attempt < _PART_STREAM_RETRIES and self.part_deadline - loop.time() > 0.2:
                    logger.info("round %s: part %d stream cut (%r), again", self.group.key, j, exc)
                    await asyncio.sleep(0.1)
        logger.warning("round %s: part %d from %s missing: %r", self.group.key, j, peer, reason)
        return None

    async def _exchange_inner(self, j: int, peer: PeerID) -> tuple[tuple[bool, ...], torch.Tensor]:
        loop = asyncio.get_running_loop()
        _, reader, writer = await asyncio.wait_for(
            self.p2p.call_binary_stream_handler(peer, self.part_handler),
            self.timeouts.connect_timeout,
        )

        async def send() -> None:
            for c in range(len(self.chunks[j])):
                payload = await loop.run_in_executor(None, self._encode_chunk, j, c)
                head = self._part_head(j, c).serialize()
                await wire.write_frame(writer, Kind.PART, head, payload, counter=self.counter)

        sending = asyncio.create_task(send())
        try:
            bits: tuple[bool, ...] | None = None
            values = []
            digest = hashlib.sha256()
            mask_len = wire.mask_bytes(self.num_members)
            start = PartHead.SIZE + _U16_BYTES
            for c, (a, b) in enumerate(self.chunks[j]):
                frame = await wire.read_frame_header(reader, self.counter)
                if frame.kind == Kind.REJECT and frame.body_len <= wire.MAX_SMALL_BODY:
                    body = await wire.read_body(reader, frame.body_len, self.counter)
                    reject = Reject.parse(body)
                    raise ProtocolError(f"rejected: {reject.code.name} {reject.reason}")
                expected = start + mask_len + self.return_codec.encoded_size(b - a)
                if frame.kind != Kind.AVERAGED or frame.body_len != expected:
                    raise ProtocolError(
                        f"{frame.kind.name} of {frame.body_len} bytes, expected {expected}"
                    )
                body = await wire.read_body(reader, frame.body_len, self.counter)
                if PartHead.parse(body[: PartHead.SIZE]) != PartHead(
                    self.tag, self.group.group_id, j, c
                ):
                    raise ProtocolError("AVERAGED for another round, group, part or chunk")
                count = int.from_bytes(body[PartHead.SIZE : start], "big")
                if count != self.num_members:
                    raise ProtocolError(f"mask of {count} members")
                chunk_bits = wire.unpack_mask(body[start : start + mask_len], self.num_members)
                if not chunk_bits[j] or (bits is not None and chunk_bits != bits):
                    raise ProtocolError("counted mask without the reducer, or changed mid-part")
                bits = chunk_bits
                averaged = memoryview(body)[start + mask_len :]
                values.append(
                    await loop.run_in_executor(None, self._check_averaged, j, c, averaged)
                )
                digest.update(averaged)
            assert bits is not None  # every part has at least one chunk
            self._part_digests[j] = _part_digest(bits, [], digest)
            return bits, torch.cat(values)
        finally:
            sending.cancel()
            writer.close()

    def _part_head(self, j: int, c: int) -> PartHead:
        return PartHead(self.tag, self.group.group_id, j, c)

    def _check_averaged(self, j: int, c: int, payload: bytes | memoryview) -> torch.Tensor:
        try:
            values = self.return_codec.decode(payload)
        except CodecError as exc:
            raise ProtocolError(f"averaged part does not decode: {exc}") from exc
        check_values(values, self.chunk_norms[j][c], self.max_norm_ratio)
        return values

    async def accept_part(
        self,
        sender: PeerID,
        frame: wire.Frame,
        head: PartHead,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        prefix_bytes: int,
    ) -> None:
        """Serve one member's PART stream (the handler already read its first frame header
        and part head): read its chunks while streaming the averaged chunks back."""
        self._serving += 1
        self._idle.clear()
        try:
            await self._accept_part(sender, frame, head, reader, writer, prefix_bytes)
        finally:
            self._serving -= 1
            if self._serving == 0:
                self._idle.set()

    async def _accept_part(
        self,
        sender: PeerID,
        frame: wire.Frame,
        head: PartHead,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        prefix_bytes: int,
    ) -> None:
        self.counter.received += prefix_bytes
        if sender not in self.group.members or sender == self.p2p.peer_id:
            logger.warning("round %s: PART from non-member %s", self.group.key, sender)
            reject = Reject(RejectCode.NOT_MEMBER, reason="not a member of this group")
            await asyncio.wait_for(wire.write_frame(writer, Kind.REJECT, reject.serialize()), 1.0)
            return
        j = self.group.index(sender)
        if j in self._excluded:
            await _reject(writer, f"excluded: {self._excluded[j]}")
            return
        if j in self._live:
            logger.warning("round %s: second PART stream from member %d", self.group.key, j)
            return
        self._live.add(j)
        try:
            await self._serve_member(j, frame, head, reader, writer)
        finally:
            self._live.discard(j)

    async def _serve_member(
        self,
        j: int,
        frame: wire.Frame,
        head: PartHead,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        loop = asyncio.get_running_loop()
        sending = asyncio.create_task(self._send_averages(j, writer))
        try:
            await self._read_chunks(j, frame, head, reader)
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            # Cut in transport: the member may open the stream again (until the deadlines).
            logger.info("round %s: PART stream of member %d cut: %r", self.group.key, j, exc)
            sending.cancel()
            return
        except Exception as exc:  # any bad input or a too slow sender: exclude, never raise
            self._exclude_index(j, f"{exc!r}" if not isinstance(exc, ProtocolError) else str(exc))
            sending.cancel()
            await _reject(writer, f"excluded: {self._excluded[j]}")
            return
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(sending, max(0.0, self.report_deadline - loop.time()))

    async def _read_chunks(
        self, j: int, frame: wire.Frame, head: PartHead, reader: asyncio.StreamReader
    ) -> None:
        loop = asyncio.get_running_loop()
        have = len(self._received[j]) if j in self._started else 0  # before a cut stream
        for c, (a, b) in enumerate(self.chunks[self.index]):
            counting = j in self._started if c > 0 else not self._gather_closed
            deadline = self.gather_deadline if c == 0 and counting else self.part_deadline
            if c > 0:
                frame = await asyncio.wait_for(
                    wire.read_frame_header(reader, self.counter), max(0.0, deadline - loop.time())
                )
                if frame.kind != Kind.PART or frame.body_len < PartHead.SIZE:
                    raise ProtocolError(f"{frame.kind.name} where chunk {c} was due")
                head = PartHead.parse(await wire.read_body(reader, PartHead.SIZE, self.counter))
            if (head.tag, head.group_id, head.part, head.chunk) != (
                self.tag,
                self.group.group_id,
                self.index,
                c,
            ):
                raise ProtocolError(f"chunk {head.part}/{head.chunk}, expected {self.index}/{c}")
            size = self.codec.encoded_size(b - a)
            if frame.body_len != PartHead.SIZE + size:
                raise ProtocolError(
                    f"chunk of {frame.body_len - PartHead.SIZE} bytes, expected {size}"
                )
            payload = await asyncio.wait_for(
                wire.read_body(reader, size, self.counter), max(0.0, deadline - loop.time())
            )
            if not counting or j in self._excluded or c < have:
                continue  # late, or sent again after a cut: read to keep the stream flowing
            values = await loop.run_in_executor(
                None, self._check_contribution, payload, b - a, self.chunk_norms[self.index][c]
            )
            if c == 0:
                if self._gather_closed:
                    continue
                self._started.add(j)
                self._received[j] = [values]
            else:
                self._received[j].append(values)
            self._touch()

    async def _send_averages(self, j: int, writer: asyncio.StreamWriter) -> None:
        """Stream the averaged chunks to member ``j`` as the reduction produces them."""
        num_chunks = len(self.chunks[self.index])
        for c in range(num_chunks):

            def available(c: int = c) -> bool:
                return len(self._averaged_chunks) > c or self._part_failed is not None

            if not await self._wait(available, self.part_deadline) or self._part_failed:
                await _reject(writer, f"part failed: {self._part_failed or 'deadline'}")
                writer.close()  # the member sees the part missing
                return
            assert self._mask is not None
            head = PartHead(self.tag, self.group.group_id, self.index, c)
            await wire.write_frame(
                writer,
                Kind.AVERAGED,
                head.serialize(),
                self.num_members.to_bytes(_U16_BYTES, "big"),
                wire.pack_mask(self._mask),
                self._averaged_chunks[c],
                counter=self.counter,
            )
        self.delivered += 1

    def exclude(self, peer: PeerID, reason: str) -> None:
        """Stop waiting for ``peer``'s contribution (it broke the protocol elsewhere)."""
        if peer in self.group.members and peer != self.p2p.peer_id:
            self._exclude_index(self.group.index(peer), reason)

    def _exclude_index(self, j: int, reason: str) -> None:
        if j not in self._excluded:
            logger.warning("round %s: excluding member %d: %s", self.group.key, j, reason)
            self._excluded[j] = reason
            self._touch()

    def _check_contribution(
        self, payload: bytes | bytearray, numel: int, own_norm: float
    ) -> torch.Tensor:
        if payload[:1] != bytes([self.codec.codec_id]):
            raise ProtocolError(f"codec id {payload[:1].hex()}, expected {self.codec.codec_id}")
        try:
            values = self.codec.decode(payload)
        except CodecError as exc:
            raise ProtocolError(f"part does not decode: {exc}") from exc
        if values.numel() != numel:
            raise ProtocolError(f"{values.numel()} values, expected {numel}")
        check_values(values, own_norm, self.max_norm_ratio)
        return values

    async def _exchange_reports(
        self, held: tuple[bool, ...], digest: bytes, full: tuple[bool, ...]
    ) -> None:
        """Send my report to everyone; wait for the full contributors' reports (bounded)."""
        loop = asyncio.get_running_loop()
        message = Report(self.tag, self.group.group_id, held, digest).serialize()
        sends = [
            asyncio.create_task(self._send_report(self.group.members[i], message))
            for i in range(self.num_members)
            if i != self.index
        ]
        awaited = {i for i in range(self.num_members) if i != self.index and full[i]}
        try:
            while not awaited <= set(self._reports):
                remaining = self.report_deadline - loop.time()
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
            await asyncio.wait(sends, timeout=max(0.0, self.report_deadline - loop.time()))
        finally:
            for task in sends:
                task.cancel()

    async def _send_report(self, peer: PeerID, message: bytes) -> None:
        """Deliver my report to ``peer``; a stream cut in transport is opened once more."""
        for attempt in range(1 + _PART_STREAM_RETRIES):
            try:
                _, reader, writer = await asyncio.wait_for(
                    self.p2p.call_binary_stream_handler(peer, self.report_handler),
                    self.timeouts.connect_timeout,
                )
                try:
                    await wire.write_frame(writer, Kind.REPORT, message)
                    await wire.read_frame(reader, (Kind.ACK,))
                    return
                finally:
                    writer.close()
            except (ProtocolError, asyncio.TimeoutError) as exc:
                reason: Exception = exc
                break
            except Exception as exc:  # refused or cut in transport
                reason = exc
                if attempt < _PART_STREAM_RETRIES:
                    await asyncio.sleep(0.1)
        logger.debug("round %s: report to %s not delivered: %r", self.group.key, peer, reason)

    def accept_report(self, sender: PeerID, report: Report) -> None:
        """Store a member's report (the handler checked its framing and round)."""
        if sender not in self.group.members or sender == self.p2p.peer_id:
            raise ProtocolError("report from a non-member")
        if report.group_id != self.group.group_id or len(report.parts) != self.num_members:
            raise ProtocolError("report for another group")
        i = self.group.index(sender)
        self._reports.setdefault(i, report)
        self._report_arrived.set()


class AllReduceService:
    """Routes PART and REPORT streams to the round they belong to.

    A round is registered (``expect``) before its node declares itself in matchmaking, so
    a member that formed its group first and sends early is held until this node's group is
    known (bounded by the matchmaking time), not refused.
    """

    def __init__(self, p2p: P2P, run_id: str, digest: bytes, timeouts: RoundTimeouts) -> None:
        self.p2p, self.digest, self.timeouts = p2p, digest, timeouts
        self.part_handler = f"/diloco/{run_id}/part/1"
        self.report_handler = f"/diloco/{run_id}/report/1"
        self._rounds: dict[RoundKey, asyncio.Future[AllReduceRunner]] = {}

    async def start(self) -> None:
        """Register both handlers on the shared P2P daemon."""
        await self.p2p.add_binary_stream_handler(self.part_handler, self._handle_part)
        await self.p2p.add_binary_stream_handler(self.report_handler, self._handle_report)

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

    async def _handle_part(
        self, info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        try:
            frame = await asyncio.wait_for(
                wire.read_frame_header(reader), self.timeouts.connect_timeout
            )
            if frame.kind != Kind.PART or frame.body_len < PartHead.SIZE:
                raise ProtocolError(
                    f"{frame.kind.name} of {frame.body_len} bytes on the part stream"
                )
            raw = await asyncio.wait_for(
                wire.read_body(reader, PartHead.SIZE), self.timeouts.connect_timeout
            )
            head = PartHead.parse(raw)
            runner = await self._runner_for(head.tag, head.group_id, info.peer_id)
            if isinstance(runner, Reject):
                logger.warning("PART from %s refused: %s", info.peer_id, runner.reason)
                await asyncio.wait_for(
                    wire.write_frame(writer, Kind.REJECT, runner.serialize()), 1.0
                )
                return
            prefix = wire.FRAME_HEADER.size + PartHead.SIZE
            await runner.accept_part(info.peer_id, frame, head, reader, writer, prefix)
        except ProtocolError as exc:
            logger.warning("malformed PART stream from %s: %s", info.peer_id, exc)
            with contextlib.suppress(Exception):
                reject = Reject(RejectCode.MALFORMED, reason=str(exc)[:200]).serialize()
                await asyncio.wait_for(wire.write_frame(writer, Kind.REJECT, reject), 1.0)
        except Exception as exc:
            logger.debug("PART stream from %s ended: %r", info.peer_id, exc)
        finally:
            writer.close()

    async def _handle_report(
        self, info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        try:
            _, body = await asyncio.wait_for(
                wire.read_frame(reader, (Kind.REPORT,)), self.timeouts.connect_timeout
            )
            report = Report.parse(body)
            runner = await self._runner_for(report.tag, report.group_id, info.peer_id)
            if isinstance(runner, Reject):
                await asyncio.wait_for(
                    wire.write_frame(writer, Kind.REJECT, runner.serialize()), 1.0
                )
                return
            runner.accept_report(info.peer_id, report)
            await asyncio.wait_for(wire.write_frame(writer, Kind.ACK), 1.0)
        except ProtocolError as exc:
            logger.warning("invalid REPORT from %s: %s", info.peer_id, exc)
        except Exception as exc:
            logger.debug("REPORT stream from %s ended: %r", info.peer_id, exc)
        finally:
            writer.close()


_PART_STREAM_RETRIES = 1
"""Extra attempts of a member's PART or REPORT stream after it was cut in transport."""


async def _reject(writer: asyncio.StreamWriter, reason: str) -> None:
    """Tell the member on ``writer`` this part will not come (best effort, bounded)."""
    with contextlib.suppress(Exception):
        reject = Reject(RejectCode.BAD_PART, reason=reason[:200]).serialize()
        await asyncio.wait_for(wire.write_frame(writer, Kind.REJECT, reject), 1.0)


def _part_digest(mask: tuple[bool, ...], payloads: list[bytes], digest: Any = None) -> bytes:
    """sha256 of one part as members compare it: the averaged payloads (in ``digest`` when
    already hashed), then the counted mask."""
    digest = digest or hashlib.sha256()
    for payload in payloads:
        digest.update(payload)
    digest.update(wire.pack_mask(mask))
    return bytes(digest.digest())
