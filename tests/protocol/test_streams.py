"""Frames over streams, and the handler wrapper every stream of the protocol shares."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import pytest
from hivemind.p2p import PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo
from hivemind.utils.multiaddr import Multiaddr
from memory_p2p import make_peer_id, stream_pair

from diloco.errors import ProtocolError
from diloco.protocol.runtime import streams
from diloco.protocol.wire.frames import FRAME_HEADER, ByteCounter, Kind, Reject, RejectCode

pytestmark = pytest.mark.clocked

PEER = make_peer_id(7)


class _Sink:
    """An asyncio.StreamWriter stand-in that feeds a StreamReader (same process)."""

    def __init__(self, reader: asyncio.StreamReader) -> None:
        self.reader = reader

    def write(self, data: bytes | memoryview) -> None:
        self.reader.feed_data(bytes(data))

    async def drain(self) -> None:
        return None


def test_frame_round_trip_counts_bytes() -> None:
    async def main() -> None:
        reader = asyncio.StreamReader()
        sent, received = ByteCounter(), ByteCounter()
        body = bytes(range(256)) * 9000  # over one chunk
        await streams.write_frame(_Sink(reader), Kind.PART, body[:10], body[10:], counter=sent)  # type: ignore[arg-type]
        kind, got = await streams.read_frame(reader, (Kind.PART,), len(body), received)
        assert (kind, got) == (Kind.PART, body)
        assert sent.sent == received.received == 12 + len(body)

    asyncio.run(main())


@pytest.mark.parametrize(
    ("header", "match"),
    [
        (FRAME_HEADER.pack(b"XX", 1, 1, 0), "magic"),
        (FRAME_HEADER.pack(b"DL", 9, 1, 0), "version"),
        (FRAME_HEADER.pack(b"DL", 1, 99, 0), "kind"),
        (FRAME_HEADER.pack(b"DL", 1, Kind.GROUP, 0), "unexpected"),
        (FRAME_HEADER.pack(b"DL", 1, Kind.JOIN, 1 << 40), "bytes"),
    ],
)
def test_read_frame_bad_header_rejected_before_body(header: bytes, match: str) -> None:
    async def main() -> None:
        reader = asyncio.StreamReader()
        reader.feed_data(header)  # no body: the check must not wait for one
        with pytest.raises(ProtocolError, match=match):
            await streams.read_frame(reader, (Kind.JOIN,))

    asyncio.run(main())


Serve = Callable[[PeerID, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[Reject | None]]


async def _exchange(
    serve: Serve, request: bytes = b"", timeout: float = 5.0, **kwargs: object
) -> bytes:
    """Run the wrapped ``serve`` on one in-memory stream; return the one frame the client
    read (it then closes, as clients do), or b"" when the wrapper closed without one."""
    (reader, writer), (their_reader, their_writer) = await stream_pair()
    handler = streams.stream_handler("TEST", serve, timeout=timeout, reply_timeout=5.0, **kwargs)  # type: ignore[arg-type]
    info = StreamInfo(PEER, Multiaddr("/ip4/127.0.0.1/tcp/1"), "test")
    writer.write(request)
    handling = asyncio.create_task(handler(info, their_reader, their_writer))
    try:
        header = await reader.readexactly(12)
        received = header + await reader.readexactly(int.from_bytes(header[8:], "big"))
    except asyncio.IncompleteReadError as exc:
        assert exc.partial == b"", exc.partial
        received = b""
    writer.close()
    await handling
    assert their_writer.is_closing()
    return received


def _reject_of(received: bytes) -> Reject:
    assert received[:4] == b"DL\x01" + bytes([Kind.REJECT]), received[:4]
    return Reject.parse(received[12:])


def test_stream_handler_protocol_error_answered_malformed_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def serve(
        peer: PeerID, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> Reject | None:
        await streams.read_frame(reader, (Kind.JOIN,))
        return None

    bad_magic = FRAME_HEADER.pack(b"XX", 1, Kind.JOIN, 0)
    with caplog.at_level(logging.WARNING, logger="diloco.protocol.runtime.streams"):
        received = asyncio.run(_exchange(serve, bad_magic))
    reject = _reject_of(received)
    assert reject.code == RejectCode.MALFORMED and "magic" in reject.reason
    assert str(PEER) in caplog.text and "malformed TEST" in caplog.text


def test_stream_handler_returned_reject_is_sent() -> None:
    async def serve(
        peer: PeerID, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> Reject | None:
        return Reject(RejectCode.NO_STATE, reason="nothing here")

    assert _reject_of(asyncio.run(_exchange(serve))) == Reject(
        RejectCode.NO_STATE, reason="nothing here"
    )


def test_stream_handler_admission_refuses_before_serving() -> None:
    served: list[PeerID] = []

    async def serve(
        peer: PeerID, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> Reject | None:
        served.append(peer)
        return None

    def admit(peer: PeerID) -> Reject | None:
        return Reject(RejectCode.WRONG_RUN, reason=f"not {peer}") if peer == PEER else None

    received = asyncio.run(_exchange(serve, admit=admit))
    assert _reject_of(received).code == RejectCode.WRONG_RUN
    assert served == []


def test_stream_handler_deadline_closes_the_stream_quietly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def serve(
        peer: PeerID, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> Reject | None:
        await reader.readexactly(1)  # the client never sends it
        return None

    with caplog.at_level(logging.DEBUG, logger="diloco.protocol.runtime.streams"):
        assert asyncio.run(_exchange(serve, timeout=0.05)) == b""
    assert [r.levelno for r in caplog.records] == [logging.DEBUG]


def test_stream_handler_cut_stream_logged_at_debug(caplog: pytest.LogCaptureFixture) -> None:
    async def serve(
        peer: PeerID, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> Reject | None:
        raise ConnectionResetError("cut")

    with caplog.at_level(logging.DEBUG, logger="diloco.protocol.runtime.streams"):
        assert asyncio.run(_exchange(serve)) == b""
    assert [r.levelno for r in caplog.records] == [logging.DEBUG]


def test_stream_handler_bug_logged_with_traceback_not_raised(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def serve(
        peer: PeerID, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> Reject | None:
        raise KeyError("a bug of ours")

    with caplog.at_level(logging.ERROR, logger="diloco.protocol.runtime.streams"):
        assert asyncio.run(_exchange(serve)) == b""
    (record,) = caplog.records
    assert record.exc_info is not None and record.exc_info[0] is KeyError


def test_transport_errors_name_refused_and_cut_streams_only() -> None:
    from hivemind.p2p.p2p_daemon_bindings.utils import ControlFailure

    for error in (
        ControlFailure("refused"),
        ConnectionResetError(),
        BrokenPipeError(),
        asyncio.IncompleteReadError(b"", 4),
    ):
        assert isinstance(error, streams.TRANSPORT_ERRORS)
    for bug in (ValueError(), KeyError(), RuntimeError(), ProtocolError("bad")):
        assert not isinstance(bug, streams.TRANSPORT_ERRORS)


async def _answered_stream(
    answer: bytes, reply_timeout: float
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, asyncio.Task[None]]:
    """A handler that writes ``answer`` and returns, running on one in-memory stream."""
    (reader, writer), (their_reader, their_writer) = await stream_pair()

    async def serve(
        peer: PeerID, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> Reject | None:
        writer.write(answer)
        await writer.drain()
        return None

    handler = streams.stream_handler("TEST", serve, timeout=5.0, reply_timeout=reply_timeout)
    info = StreamInfo(PEER, Multiaddr("/ip4/127.0.0.1/tcp/1"), "test")
    return reader, writer, asyncio.create_task(handler(info, their_reader, their_writer))


def test_stream_handler_closes_after_an_answer_only_once_the_peer_closed() -> None:
    """p2pd may turn our close into a reset that drops the answer's unread bytes: the
    handler keeps its end open until the client has read the answer and closed."""

    async def main() -> None:
        reader, writer, handling = await _answered_stream(b"answer", reply_timeout=30.0)
        assert await reader.readexactly(6) == b"answer"
        writer.write(b"late bytes the handler never reads")  # dropped, not left unread
        await writer.drain()
        for _ in range(20):  # the handler gets every chance to run
            await asyncio.sleep(0)
        assert not handling.done()
        writer.close()
        await asyncio.wait_for(handling, 5.0)
        assert await reader.read() == b""

    asyncio.run(main())


def test_stream_handler_closes_after_reply_timeout_when_the_peer_never_closes() -> None:
    async def main() -> None:
        reader, writer, handling = await _answered_stream(b"answer", reply_timeout=0.05)
        await asyncio.wait_for(handling, 5.0)  # the client never closes
        assert await reader.read() == b"answer"  # then EOF: the handler closed
        writer.close()

    asyncio.run(main())


def test_stream_handler_cancelled_at_shutdown_ends_quietly_not_cancelled(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """asyncio's connection callback (Python 3.11) calls ``task.exception()``, which raises
    for a cancelled task and is logged as an ERROR with a traceback by every node that
    stops while a peer's stream is open; the handler's task must end normally instead."""

    async def serve(
        peer: PeerID, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> Reject | None:
        await reader.readexactly(1)  # the client never sends it
        return None

    async def main() -> asyncio.Task[None]:
        (_reader, _writer), (their_reader, their_writer) = await stream_pair()
        handler = streams.stream_handler("TEST", serve, timeout=5.0, reply_timeout=5.0)
        info = StreamInfo(PEER, Multiaddr("/ip4/127.0.0.1/tcp/1"), "test")
        handling = asyncio.create_task(handler(info, their_reader, their_writer))
        await asyncio.sleep(0.05)
        handling.cancel()
        await asyncio.wait([handling])
        assert their_writer.is_closing()
        return handling

    with caplog.at_level(logging.DEBUG, logger="diloco.protocol.runtime.streams"):
        task = asyncio.run(main())
    assert not task.cancelled()
    assert task.exception() is None
    assert [r.levelno for r in caplog.records] == [logging.DEBUG]
