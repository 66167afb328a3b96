"""A member's PART stream to a reducer, kept open after the part for the member's REPORT and
CHECK_REQ to that reducer (docs/design.md "The round").

Once a member has read a reducer's SEAL it holds that reducer's whole averaged part, and the
reducer serves the stream on (``routing``): each REPORT is answered with an ACK and each
CHECK_REQ with a CHECK_RES, in the order they came, until the member closes the stream; a
REJECT ends it. The bytes are those of the REPORT and CHECK streams, checked the same way,
so the last two exchanges of a round with each reducer cost no stream opens and go out
back to back. A channel that broke (cut, an answer refused, a request given up halfway) is
not read again: what was asked on it is asked again on a stream of its own.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from diloco.protocol.runtime.streams import read_frame, write_frame
from diloco.protocol.wire.frames import MAX_SMALL_BODY, Buffer, ByteCounter, Kind


class ChannelBroken(ConnectionError):
    """The channel was given up before this request: ask on a stream of its own (a
    transport error, so the callers' retries take it)."""


class PartChannel:
    """Requests to one reducer on the PART stream its part came on, answered in turn."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, counter: ByteCounter
    ) -> None:
        self._reader, self._writer, self._counter = reader, writer, counter
        self._writing = asyncio.Lock()
        self._turn: asyncio.Future[None] | None = None
        """Resolved once the answer to the request sent last has been read (or given up)."""
        self.broken = False

    async def ask(
        self, kind: Kind, body: Buffer, answers: Sequence[Kind], limit: int = MAX_SMALL_BODY
    ) -> tuple[Kind, bytearray]:
        """Send one request and read its answer, after the answers to the requests sent
        before it: the reducer answers in order. A REJECT comes back as it is (the reducer
        ends the stream after it).

        Raises:
            ChannelBroken: the channel was given up before this request was answered.
            ProtocolError, TRANSPORT_ERRORS: as ``read_frame`` (the channel is given up).
        """
        if self.broken:
            raise ChannelBroken("the part stream was given up")
        before, turn = self._turn, asyncio.get_running_loop().create_future()
        self._turn = turn
        try:
            async with self._writing:  # a frame's pieces are not interleaved with another's
                await write_frame(self._writer, kind, body, counter=self._counter)
            if before is not None:
                await asyncio.shield(before)
            if self.broken:
                raise ChannelBroken("the part stream was given up")
            answer = await read_frame(self._reader, answers, limit, self._counter)
            if answer[0] == Kind.REJECT:
                self.broken = True
            return answer
        except BaseException:
            self.broken = True  # where the stream stands is unknown: nobody reads it again
            raise
        finally:
            if not turn.done():
                turn.set_result(None)

    def close(self) -> None:
        """End the stream: the reducer stops waiting for requests on it."""
        self.broken = True
        self._writer.close()
