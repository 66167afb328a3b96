"""The REPORT exchange of one round over streams (``agreement`` decides what they mean).

Every member sends its REPORT to every other member and waits, up to the round's report
deadline, for the reports of the full contributors (``agreement.awaited_reports``). To a
reducer whose part it holds the report goes on that part's stream (``channel``), to the
others (and when that stream broke) on a REPORT stream of its own. A report stream cut in
transport is opened once more; a report not delivered is logged.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

from hivemind.p2p import PeerID

from diloco.errors import ProtocolError
from diloco.protocol.allreduce.channel import PartChannel
from diloco.protocol.core.agreement import awaited_reports, check_report
from diloco.protocol.core.group import GroupInfo, RoundTimeouts
from diloco.protocol.runtime import round_trips
from diloco.protocol.runtime.event_loop import wait_set
from diloco.protocol.runtime.streams import (
    TRANSPORT_ERRORS,
    StreamTransport,
    open_stream,
    read_frame,
    write_frame,
)
from diloco.protocol.wire.frames import Kind
from diloco.protocol.wire.part import Report

logger = logging.getLogger(__name__)

STREAM_RETRIES = 1
"""Extra attempts of a REPORT stream after it was cut in transport."""


class ReportExchange:
    """Member ``index``'s REPORTs of one round: the one it sends, those it received."""

    def __init__(
        self,
        *,
        p2p: StreamTransport,
        group: GroupInfo,
        index: int,
        handler: str,
        timeouts: RoundTimeouts,
        channels: Mapping[int, PartChannel],
    ) -> None:
        self.p2p, self.group, self.index = p2p, group, index
        self.handler, self.timeouts = handler, timeouts
        self.channels = channels
        """By member: the PART stream its part came on, once held (``channel``)."""
        self.received: dict[int, Report] = {}
        """Each member's first report, by group index."""
        self._arrived = asyncio.Event()

    @round_trips.exchange("report")
    async def exchange(self, report: Report, full: tuple[bool, ...], deadline: float) -> None:
        """Send ``report`` to everyone; wait for the reports of the full contributors
        (``full``) until ``deadline`` (loop time)."""
        loop = asyncio.get_running_loop()
        message = report.serialize()
        sends = [
            asyncio.create_task(self._send(i, message))
            for i in range(len(self.group.members))
            if i != self.index
        ]
        awaited = awaited_reports(self.index, full)
        try:
            while not awaited <= set(self.received):
                remaining = deadline - loop.time()
                if remaining <= 0:
                    missing = sorted(awaited - set(self.received))
                    logger.warning("round %s: no report from members %s", self.group.key, missing)
                    break
                self._arrived.clear()
                await wait_set(self._arrived, remaining)
            await asyncio.wait(sends, timeout=max(0.0, deadline - loop.time()))
        finally:
            for task in sends:
                task.cancel()

    async def _send(self, i: int, message: bytes) -> None:
        """Deliver a report to member ``i``: on its part's stream if there is one, else (or
        when that broke) on a stream of its own, opened once more if cut in transport."""
        peer = self.group.members[i]
        channel = self.channels.get(i)
        if channel is not None:
            try:
                await channel.ask(Kind.REPORT, message, (Kind.ACK,))
                return
            except ProtocolError as exc:
                logger.debug("round %s: report to %s not delivered: %r", self.group.key, peer, exc)
                return
            except TRANSPORT_ERRORS as exc:  # cut or given up: on a stream of its own
                logger.debug("round %s: part stream to %s: %r", self.group.key, peer, exc)
        for attempt in range(1 + STREAM_RETRIES):
            try:
                reader, writer = await open_stream(
                    self.p2p, peer, self.handler, self.timeouts.connect_timeout
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

    def accept(self, sender: PeerID, report: Report) -> None:
        """Keep a member's report (its first one; the handler checked framing and round).

        Raises:
            ProtocolError: from a non-member, or for another group.
        """
        if sender not in self.group.members or sender == self.p2p.peer_id:
            raise ProtocolError("report from a non-member")
        check_report(report, self.group.group_id, len(self.group.members))
        self.received.setdefault(self.group.index(sender), report)
        self._arrived.set()
