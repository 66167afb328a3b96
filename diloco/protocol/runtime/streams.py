"""Frames over p2pd binary streams: reading and writing them, and serving a stream.

``wire`` says what a frame is; this module moves frames over asyncio streams and holds the
rules every stream of the protocol shares:

* ``TRANSPORT_ERRORS`` are the errors of a stream that was refused or cut. Only these are
  retried (and only where a module says so); anything else is a bug and surfaces.
* ``stream_handler`` wraps the body of every handler (JOIN, PART, REPORT, STATE_REQ): an
  admission check first, a deadline on the whole exchange, a ``ProtocolError`` answered with
  REJECT MALFORMED and logged with the peer id, transport errors logged at debug, an
  unexpected error logged with its traceback (never raised into p2pd's task), a
  cancellation at shutdown ended quietly, and the writer always closed: after an answer,
  only once the peer has closed its end (``close_after_peer``), for p2pd may turn our
  close into a reset that cuts the answer.

Bodies are written in ``CHUNK_BYTES`` pieces with a drain after each, which streams large
parts with bounded buffering.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

from hivemind.p2p import PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo
from hivemind.p2p.p2p_daemon_bindings.utils import ControlFailure

from diloco.errors import ProtocolError
from diloco.protocol.wire.frames import (
    MAX_SMALL_BODY,
    Buffer,
    ByteCounter,
    Frame,
    Kind,
    Reject,
    RejectCode,
)

logger = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20

TRANSPORT_ERRORS: tuple[type[Exception], ...] = (
    ConnectionError,
    asyncio.IncompleteReadError,
    ControlFailure,
)
"""A stream refused or cut: p2pd answers a refused ``stream_open`` (peer unreachable, no
handler) with ``ControlFailure``; a stream reset or closed under a read or write ends in
``IncompleteReadError`` or a ``ConnectionError`` (reset, broken pipe, refused socket)."""

_ENDED: tuple[type[Exception], ...] = (*TRANSPORT_ERRORS, asyncio.TimeoutError)
"""A stream that ended early: cut, refused, or past its deadline."""

StreamHandler = Callable[[StreamInfo, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
Serve = Callable[[PeerID, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[Reject | None]]
"""The body of a handler: serve the stream from ``PeerID``; a returned ``Reject`` is sent."""
Admission = Callable[[PeerID], Reject | None]
"""Says, before anything is read, whether a peer may open a stream at all (None: yes)."""


class StreamTransport(Protocol):
    """What the protocol needs of hivemind's ``P2P``: its peer id and binary streams."""

    @property
    def peer_id(self) -> PeerID: ...

    async def add_binary_stream_handler(self, name: str, handler: StreamHandler) -> None: ...

    async def call_binary_stream_handler(
        self, peer_id: PeerID, handler_name: str
    ) -> tuple[StreamInfo, asyncio.StreamReader, asyncio.StreamWriter]: ...


def admit_all(peer: PeerID) -> Reject | None:
    """The default admission: every peer may open a stream."""
    return None


def stream_handler(
    name: str,
    serve: Serve,
    *,
    timeout: float,
    reply_timeout: float,
    admit: Admission = admit_all,
) -> StreamHandler:
    """Wrap ``serve`` as a p2pd stream handler with the shared rules (module docstring).

    ``timeout`` bounds the whole of ``serve``; ``reply_timeout`` bounds writing a REJECT.
    ``name`` (e.g. "PART") appears in the log lines.
    """

    async def handle(
        info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        try:
            await serve_one(info, reader, writer)
        except asyncio.CancelledError:
            # The loop is shutting down. This task is the top of a connection: nothing
            # awaits it but asyncio's own callback, which on Python 3.11 logs a cancelled
            # task as an ERROR with a traceback. End it quietly; the stream dies anyway.
            logger.debug("%s stream from %s cancelled at shutdown", name, info.peer_id)
            writer.close()

    async def serve_one(
        info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        peer = info.peer_id
        answered = False  # the peer is to read what we wrote: let it close first
        try:
            refusal = admit(peer)
            if refusal is None:
                refusal = await asyncio.wait_for(serve(peer, reader, writer), timeout)
            if refusal is not None:
                logger.info("%s from %s refused: %s", name, peer, _describe(refusal))
                await asyncio.wait_for(
                    write_frame(writer, Kind.REJECT, refusal.serialize()), reply_timeout
                )
            answered = True
        except ProtocolError as exc:
            logger.warning("malformed %s stream from %s: %s", name, peer, exc)
            reject = Reject(RejectCode.MALFORMED, reason=str(exc)[:200])
            await send_reject(writer, reject, reply_timeout)
            answered = True
        except _ENDED as exc:
            logger.debug("%s stream from %s ended: %r", name, peer, exc)
        except Exception:  # a bug of ours: loud, but the daemon's task must not die of it
            logger.exception("%s stream from %s failed", name, peer)
        finally:
            if answered:
                await close_after_peer(reader, writer, reply_timeout)
            else:
                writer.close()

    return handle


async def close_after_peer(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, timeout: float
) -> None:
    """Close our end once the peer has closed its end, reading and dropping what it still
    sends; at the latest after ``timeout`` seconds.

    Why not close at once: p2pd (go-libp2p-daemon's stream pipe) answers the end of our
    unix socket with a yamux ``Close``, which wakes its other copy direction with a reset
    error before the FIN goes out; that direction then resets the stream, and on a busy
    machine the reset can win the race. A reset makes the peer's yamux drop every byte it
    has not yet read (our last frames, a REJECT). Closing with unread input does the same
    (the daemon reads ECONNRESET and resets). A peer that has closed has read what it
    wanted, so a reset then costs nothing.
    """

    async def until_eof() -> None:
        while await reader.read(CHUNK_BYTES):
            pass

    try:
        with contextlib.suppress(*_ENDED):
            await asyncio.wait_for(until_eof(), timeout)
    finally:
        writer.close()


def stop_sending(task: asyncio.Task[None]) -> None:
    """Cancel a task that writes to a stream being given up. A transport error it already
    ended with is part of that; any other error is a bug, and logged."""
    task.cancel()
    if task.done() and not task.cancelled():
        exc = task.exception()
        if exc is not None and not isinstance(exc, TRANSPORT_ERRORS):
            logger.error("writing to a stream failed", exc_info=exc)


async def send_reject(writer: asyncio.StreamWriter, reject: Reject, timeout: float) -> None:
    """Tell the peer on ``writer`` why it gets nothing more (best effort, bounded)."""
    with contextlib.suppress(*_ENDED):
        await asyncio.wait_for(write_frame(writer, Kind.REJECT, reject.serialize()), timeout)


async def open_stream(
    p2p: StreamTransport, peer: PeerID, handler_name: str, timeout: float
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Open a stream to ``peer``'s handler within ``timeout`` seconds.

    Raises:
        ControlFailure: the daemon refused (one of ``TRANSPORT_ERRORS``).
        asyncio.TimeoutError: not open in time.
    """
    _, reader, writer = await asyncio.wait_for(
        p2p.call_binary_stream_handler(peer, handler_name), timeout
    )
    return reader, writer


async def write_frame(
    writer: asyncio.StreamWriter, kind: Kind, *pieces: Buffer, counter: ByteCounter | None = None
) -> None:
    """Write one frame whose body is the concatenation of ``pieces``, in bounded chunks."""
    body_len = sum(len(p) for p in pieces)
    writer.write(Frame(kind, body_len).serialize())
    for piece in pieces:
        view = memoryview(piece)
        for offset in range(0, len(view), CHUNK_BYTES):
            writer.write(view[offset : offset + CHUNK_BYTES])
            await writer.drain()
    await writer.drain()
    if counter is not None:
        counter.sent += Frame.SIZE + body_len


async def read_frame_header(
    reader: asyncio.StreamReader, counter: ByteCounter | None = None
) -> Frame:
    """Read and check one frame header (not the body).

    Raises:
        ProtocolError: for a bad magic, version or kind.
        asyncio.IncompleteReadError: when the peer closed the stream.
    """
    raw = await reader.readexactly(Frame.SIZE)
    if counter is not None:
        counter.received += Frame.SIZE
    return Frame.parse(raw)


async def read_body(
    reader: asyncio.StreamReader, size: int, counter: ByteCounter | None = None
) -> bytearray:
    """Read exactly ``size`` body bytes in bounded chunks (the caller checked ``size``)."""
    buffer = bytearray(size)
    view = memoryview(buffer)
    offset = 0
    while offset < size:
        chunk = await reader.readexactly(min(CHUNK_BYTES, size - offset))
        view[offset : offset + len(chunk)] = chunk
        offset += len(chunk)
        if counter is not None:
            counter.received += len(chunk)
    return buffer


async def read_frame(
    reader: asyncio.StreamReader,
    expected: Sequence[Kind],
    max_body: int = MAX_SMALL_BODY,
    counter: ByteCounter | None = None,
) -> tuple[Kind, bytearray]:
    """Read one whole frame of one of the ``expected`` kinds (REJECT is always allowed).

    Raises:
        ProtocolError: for an unexpected kind or a body over ``max_body`` bytes.
        asyncio.IncompleteReadError: when the peer closed the stream.
    """
    frame = await read_frame_header(reader, counter)
    if frame.kind not in expected and frame.kind != Kind.REJECT:
        raise ProtocolError(f"unexpected {frame.kind.name}")
    limit = MAX_SMALL_BODY if frame.kind == Kind.REJECT else max_body
    if frame.body_len > limit:
        raise ProtocolError(f"{frame.kind.name} of {frame.body_len} bytes > {limit}")
    return frame.kind, await read_body(reader, frame.body_len, counter)


def _describe(reject: Reject) -> str:
    return f"{reject.code.name} {reject.reason}".rstrip()
