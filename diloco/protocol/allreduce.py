"""Butterfly all-reduce of one fragment round over p2pd streams (SPEC 4).

Member ``j`` of a group of ``M`` reduces part ``j`` of the vector (``butterfly_parts``).
Every member opens one stream per other reducer, writes its encoded part (PART) and reads
back, on the same stream, the reducer's averaged part (AVERAGED). A reducer decodes every
contribution, accumulates the weighted mean in FP32 in group order (``weighted_mean``, the
same float operations as ``InProcessReducer``), encodes it once with the return codec and
sends the same bytes, with the mask of members it counted, to every member; it uses the
decoded bytes itself. So all members hold bit-identical parts.

Faults and agreement (the rule every member applies):

* A reducer waits for contributions until ``sender_timeout`` after its start; members that
  sent nothing valid by then are not counted and the weights are renormalised over those
  that were. A late contribution is read, not counted, and still answered with the average,
  so a slow member ends with the same values as the others.
* Every contribution is validated (run digest, round, group, part index, exact length for
  the codec, decodes, finite, norm at most ``max_norm_ratio`` times the reducer's own part
  norm when that is non-zero). An invalid sender is answered REJECT, excluded and logged.
  Averaged parts are validated the same way; an invalid one counts as missing.
* A member waits for averaged parts until ``reducer_timeout`` after the reducers' deadline.
  A part that did not come (dead or invalid reducer) is *missing*: never replaced by local
  values.
* Then every member sends every other member a REPORT (which parts it holds, sha256 of the
  assembled result) and waits, up to ``report_timeout``, for the reports of the *full
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
  every node publishes in its DHT record detect this; the node then heals by state
  transfer (``state_transfer.fetch_state``).

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
from diloco.protocol.partition import butterfly_parts
from diloco.protocol.reducer import RoundKey, RoundResult, weighted_mean
from diloco.protocol.wire import ByteCounter, Kind, PartHead, Reject, RejectCode, Report, RoundTag

logger = logging.getLogger(__name__)

_U16_BYTES = 2


def tensor_sha256(x: torch.Tensor) -> bytes:
    """sha256 of a float32 tensor's little-endian bytes (what every member compares)."""
    return hashlib.sha256(x.contiguous().numpy().data).digest()


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
        self.part_norms = [
            float(torch.linalg.vector_norm(delta[lo:hi], dtype=torch.float64))
            for lo, hi in self.spans
        ]
        self.counter = ByteCounter()
        loop = asyncio.get_running_loop()
        self._own_part: asyncio.Future[torch.Tensor] = loop.create_future()
        self._averaged: asyncio.Future[tuple[tuple[bool, ...], bytes]] = loop.create_future()
        self._contributions: dict[int, torch.Tensor] = {}
        self._excluded: dict[int, str] = {}
        self._arrived = asyncio.Event()
        self._reports: dict[int, Report] = {}
        self._report_arrived = asyncio.Event()
        self._serving = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._gather_closed = False
        self.delivered = 0
        """Averaged parts this reducer wrote to members so far."""
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

    async def run(self) -> RoundResult:
        """Exchange parts, agree by reports, and return the round's result.

        Raises:
            RoundFailed: a part is missing here or at a member that reported, or results
                differ; the caller must then leave its outer state unchanged.
        """
        loop = asyncio.get_running_loop()
        key = self.group.key
        payloads = await loop.run_in_executor(None, self._encode_parts)
        reduce_task = asyncio.create_task(self._reduce_own_part(payloads[self.index]))
        exchanges = {
            j: asyncio.create_task(self._exchange(j, payloads[j]))
            for j in range(self.num_members)
            if j != self.index
        }
        try:
            own = await reduce_task
            others = {j: await task for j, task in exchanges.items()}
        finally:
            for task in (reduce_task, *exchanges.values()):
                task.cancel()
        parts = {**{j: r for j, r in others.items() if r is not None}, self.index: own}
        held = tuple(j in parts for j in range(self.num_members))
        result = torch.zeros(self.group.numel, dtype=torch.float32)
        for j, (_, values) in parts.items():
            lo, hi = self.spans[j]
            result[lo:hi] = values
        digest = await loop.run_in_executor(None, tensor_sha256, result)
        full = tuple(all(bits[i] for bits, _ in parts.values()) for i in range(self.num_members))
        await self._exchange_reports(held, digest, full)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._idle.wait(), max(0.0, self.report_deadline - loop.time()))

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

    def _encode_parts(self) -> list[bytes]:
        payloads = [self.codec.encode(self.delta[lo:hi].contiguous()) for lo, hi in self.spans]
        own = self.codec.decode(payloads[self.index])
        self._set_from_thread(self._own_part, own)
        return payloads

    def _set_from_thread(self, future: asyncio.Future[Any], value: object) -> None:
        """Resolve a loop future from an executor thread."""
        future.get_loop().call_soon_threadsafe(_set_if_pending, future, value)

    async def _reduce_own_part(self, payload: bytes) -> tuple[tuple[bool, ...], torch.Tensor]:
        """Gather contributions until all resolved or the deadline; average; publish."""
        loop = asyncio.get_running_loop()
        own = await self._own_part
        while len(self._contributions) + len(self._excluded) < self.num_members - 1:
            remaining = self.gather_deadline - loop.time()
            if remaining <= 0:
                break
            self._arrived.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._arrived.wait(), remaining)
        self._gather_closed = True
        counted = {**self._contributions, self.index: own}
        order = sorted(counted)
        bits = tuple(i in counted for i in range(self.num_members))
        absent = [i for i in range(self.num_members) if i not in counted]
        if absent:
            logger.warning(
                "round %s part %d: averaging without members %s (%s)",
                self.group.key,
                self.index,
                absent,
                {i: self._excluded.get(i, "nothing sent") for i in absent},
            )

        def average() -> tuple[bytes, torch.Tensor]:
            mean = weighted_mean(
                [counted[i] for i in order], [self.group.weights[i] for i in order]
            )
            encoded = self.return_codec.encode(mean)
            return encoded, self.return_codec.decode(encoded)

        encoded, decoded = await loop.run_in_executor(None, average)
        self._averaged.set_result((bits, encoded))
        return bits, decoded

    async def _exchange(
        self, j: int, payload: bytes
    ) -> tuple[tuple[bool, ...], torch.Tensor] | None:
        """Send part ``j`` to its reducer and read the average back; None if it did not come."""
        loop = asyncio.get_running_loop()
        peer = self.group.members[j]
        try:
            return await asyncio.wait_for(
                self._exchange_inner(j, peer, payload), self.part_deadline - loop.time()
            )
        except Exception as exc:
            logger.warning("round %s: part %d from %s missing: %r", self.group.key, j, peer, exc)
            return None

    async def _exchange_inner(
        self, j: int, peer: PeerID, payload: bytes
    ) -> tuple[tuple[bool, ...], torch.Tensor]:
        _, reader, writer = await asyncio.wait_for(
            self.p2p.call_binary_stream_handler(peer, self.part_handler),
            self.timeouts.connect_timeout,
        )
        try:
            head = self._part_head(j)
            await wire.write_frame(
                writer, Kind.PART, head.serialize(), payload, counter=self.counter
            )
            frame = await wire.read_frame_header(reader, self.counter)
            if frame.kind == Kind.REJECT and frame.body_len <= wire.MAX_SMALL_BODY:
                reject = Reject.parse(await wire.read_body(reader, frame.body_len, self.counter))
                raise ProtocolError(f"rejected: {reject.code.name} {reject.reason}")
            lo, hi = self.spans[j]
            mask_len = wire.mask_bytes(self.num_members)
            expected = (
                PartHead.SIZE + _U16_BYTES + mask_len + self.return_codec.encoded_size(hi - lo)
            )
            if frame.kind != Kind.AVERAGED or frame.body_len != expected:
                raise ProtocolError(
                    f"{frame.kind.name} of {frame.body_len} bytes, expected {expected}"
                )
            body = await wire.read_body(reader, frame.body_len, self.counter)
            if PartHead.parse(body[: PartHead.SIZE]) != head:
                raise ProtocolError("AVERAGED for another round, group or part")
            count = int.from_bytes(body[PartHead.SIZE : PartHead.SIZE + _U16_BYTES], "big")
            if count != self.num_members:
                raise ProtocolError(f"mask of {count} members")
            start = PartHead.SIZE + _U16_BYTES
            bits = wire.unpack_mask(body[start : start + mask_len], self.num_members)
            if not bits[j]:
                raise ProtocolError("reducer did not count itself")
            averaged = memoryview(body)[start + mask_len :]
            loop = asyncio.get_running_loop()
            values = await loop.run_in_executor(None, self._check_averaged, j, averaged)
            return bits, values
        finally:
            writer.close()

    def _part_head(self, j: int) -> PartHead:
        return PartHead(self.tag, self.group.group_id, j)

    def _check_averaged(self, j: int, payload: bytes | memoryview) -> torch.Tensor:
        try:
            values = self.return_codec.decode(payload)
        except CodecError as exc:
            raise ProtocolError(f"averaged part does not decode: {exc}") from exc
        check_values(values, self.part_norms[j], self.max_norm_ratio)
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
        """Serve one member's PART stream (the handler already read frame header and head)."""
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
        loop = asyncio.get_running_loop()
        self.counter.received += prefix_bytes

        async def reject(code: RejectCode, reason: str) -> None:
            logger.warning("round %s: excluding %s: %s", self.group.key, sender, reason)
            message = Reject(code, reason=reason[:200]).serialize()
            await asyncio.wait_for(wire.write_frame(writer, Kind.REJECT, message), 1.0)

        if sender not in self.group.members or sender == self.p2p.peer_id:
            return await reject(RejectCode.NOT_MEMBER, "not a member of this group")
        j = self.group.index(sender)
        if head.part != self.index:
            return await self._exclude(
                j, reject, RejectCode.BAD_PART, f"part {head.part} sent to reducer {self.index}"
            )
        lo, hi = self.spans[self.index]
        expected = self.codec.encoded_size(hi - lo)
        if frame.body_len != PartHead.SIZE + expected:
            return await self._exclude(
                j,
                reject,
                RejectCode.BAD_PART,
                f"part of {frame.body_len - PartHead.SIZE} bytes, expected {expected}",
            )
        if j in self._contributions or j in self._excluded:
            return await reject(RejectCode.BAD_PART, "second contribution")
        late = self._gather_closed
        deadline = self.part_deadline if late else self.gather_deadline
        try:
            payload = await asyncio.wait_for(
                wire.read_body(reader, expected, self.counter), max(0.0, deadline - loop.time())
            )
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, OSError) as exc:
            self._mark_excluded(j, f"transfer did not finish: {exc!r}")
            return None
        if not late:
            own = await self._own_part
            try:
                values = await loop.run_in_executor(None, self._check_contribution, payload, own)
            except ProtocolError as exc:
                return await self._exclude(j, reject, RejectCode.BAD_PART, str(exc))
            if self._gather_closed:
                late = True
            else:
                self._contributions[j] = values
                self._arrived.set()
        if late:
            logger.info("round %s: late part from member %d not counted", self.group.key, j)
        remaining = max(0.0, self.part_deadline - loop.time())
        bits, encoded = await asyncio.wait_for(asyncio.shield(self._averaged), remaining)
        mask = wire.pack_mask(bits)
        await asyncio.wait_for(
            wire.write_frame(
                writer,
                Kind.AVERAGED,
                PartHead(self.tag, self.group.group_id, self.index).serialize(),
                self.num_members.to_bytes(_U16_BYTES, "big"),
                mask,
                encoded,
                counter=self.counter,
            ),
            max(0.0, self.report_deadline - loop.time()),
        )
        self.delivered += 1
        return None

    async def _exclude(
        self, j: int, reject: Callable[[RejectCode, str], Any], code: RejectCode, reason: str
    ) -> None:
        self._mark_excluded(j, reason)
        await reject(code, reason)

    def exclude(self, peer: PeerID, reason: str) -> None:
        """Stop waiting for ``peer``'s contribution (it broke the protocol elsewhere)."""
        if peer in self.group.members and peer != self.p2p.peer_id:
            logger.warning("round %s: excluding %s: %s", self.group.key, peer, reason)
            self._mark_excluded(self.group.index(peer), reason)

    def _mark_excluded(self, j: int, reason: str) -> None:
        if j not in self._contributions:
            self._excluded.setdefault(j, reason)
            self._arrived.set()

    def _check_contribution(self, payload: bytes | bytearray, own: torch.Tensor) -> torch.Tensor:
        if payload[:1] != bytes([self.codec.codec_id]):
            raise ProtocolError(f"codec id {payload[:1].hex()}, expected {self.codec.codec_id}")
        try:
            values = self.codec.decode(payload)
        except CodecError as exc:
            raise ProtocolError(f"part does not decode: {exc}") from exc
        if values.numel() != own.numel():
            raise ProtocolError(f"{values.numel()} values, expected {own.numel()}")
        reference = float(torch.linalg.vector_norm(own, dtype=torch.float64))
        check_values(values, reference, self.max_norm_ratio)
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
        try:
            _, reader, writer = await asyncio.wait_for(
                self.p2p.call_binary_stream_handler(peer, self.report_handler),
                self.timeouts.connect_timeout,
            )
            try:
                await wire.write_frame(writer, Kind.REPORT, message)
                await wire.read_frame(reader, (Kind.ACK,))
            finally:
                writer.close()
        except Exception as exc:
            logger.debug("round %s: report to %s not delivered: %r", self.group.key, peer, exc)

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


def _set_if_pending(future: asyncio.Future[Any], value: object) -> None:
    if not future.done():
        future.set_result(value)
