"""The delay proxy of the WAN harness: bytes intact and in order both ways, delayed in both
directions, EOF passed on, and a bounded amount held (no p2pd: plain asyncio sockets).

Delays are checked by order (a byte sent through the proxy arrives after one sent directly
later) and by lower bounds only, which a slow machine cannot break."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import pytest

from diloco.bench.wan_proxy import CHUNK_BYTES, LOOPBACK, DelayProxy

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _serve(handler: Handler) -> tuple[asyncio.Server, int]:
    server = await asyncio.start_server(handler, LOOPBACK, 0)
    return server, server.sockets[0].getsockname()[1]


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Send back every byte; at EOF close."""
    while chunk := await reader.read(1 << 16):
        writer.write(chunk)
        await writer.drain()
    writer.close()


class _Through:
    """A target server behind a proxy, closed together."""

    def __init__(self, server: asyncio.Server, proxy: DelayProxy) -> None:
        self.server, self.proxy = server, proxy

    async def connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection(LOOPBACK, self.proxy.port)

    async def close(self) -> None:
        await self.proxy.close()
        self.server.close()


async def _through(handler: Handler, delay: float, **kwargs: float | int) -> _Through:
    server, port = await _serve(handler)
    proxy = DelayProxy(port, delay, **kwargs)  # type: ignore[arg-type]
    await proxy.start()
    return _Through(server, proxy)


async def _pump(writer: asyncio.StreamWriter, data: bytes, piece: int) -> None:
    for offset in range(0, len(data), piece):
        writer.write(data[offset : offset + piece])
        await writer.drain()
    writer.write_eof()


async def _read_all(reader: asyncio.StreamReader) -> bytes:
    return await reader.read()


def run(main: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Run one test's coroutine, bounded so that a hang fails instead of blocking."""

    async def bounded() -> None:
        await asyncio.wait_for(main(), 60)

    asyncio.run(bounded())


@pytest.mark.parametrize("jitter", [0.0, 0.02])
def test_bytes_arrive_intact_and_in_order_both_ways(jitter: float) -> None:
    """3 MiB in odd-sized writes to an echo server and back, through 10 ms each way (with
    jitter larger than the gap between chunks: order must hold anyway)."""
    data = os.urandom(3 * 1024 * 1024 + 12345)

    async def main() -> None:
        link = await _through(_echo, 0.01, jitter=jitter, seed=1, window=4 * CHUNK_BYTES)
        try:
            reader, writer = await link.connect()
            got, _ = await asyncio.gather(_read_all(reader), _pump(writer, data, 7919))
            writer.close()
            assert got == data
            assert link.proxy.bytes_forwarded == 2 * len(data)
            assert link.proxy.connections == 1
        finally:
            await link.close()

    run(main)


def test_several_connections_are_separate() -> None:
    """Each connection gets its own upstream connection and its own bytes back."""

    async def main() -> None:
        link = await _through(_echo, 0.005)
        try:
            conns = [await link.connect() for _ in range(5)]
            for i, (_, writer) in enumerate(conns):
                writer.write(bytes([i]) * (1000 + i))
                writer.write_eof()
            answers = await asyncio.gather(*(_read_all(r) for r, _ in conns))
            assert answers == [bytes([i]) * (1000 + i) for i in range(5)]
            assert link.proxy.connections == 5
        finally:
            await link.close()

    run(main)


def test_a_byte_through_the_delay_arrives_after_one_written_later_around_it() -> None:
    """Causality: two warm connections to one target, one through a 0.5 s proxy, one through
    a proxy without delay (the same hops); a byte written to the first, then one to the
    second in the same instant: the target gets the second first."""

    async def main() -> None:
        order: list[bytes] = []
        warm, both = asyncio.Event(), asyncio.Event()

        async def record(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            order.append(await reader.readexactly(1))
            if len(order) == 2:
                warm.set()
            order.append(await reader.readexactly(1))
            if len(order) == 4:
                both.set()
            writer.close()

        server, port = await _serve(record)
        slow, fast = DelayProxy(port, 0.5), DelayProxy(port, 0.0)
        try:
            writers = []
            for proxy in (slow, fast):
                await proxy.start()
                _, writer = await asyncio.open_connection(LOOPBACK, proxy.port)
                writer.write(b"w")
                writers.append(writer)
            await warm.wait()
            writers[0].write(b"S")
            writers[1].write(b"F")
            await both.wait()
            assert order[2:] == [b"F", b"S"]
            for writer in writers:
                writer.close()
        finally:
            await slow.close()
            await fast.close()
            server.close()

    run(main)


def test_a_round_trip_takes_at_least_twice_the_delay() -> None:
    """Both directions are delayed: a request and its echo take at least 2 x 50 ms, each
    of several times (a lower bound only)."""

    async def main() -> None:
        link = await _through(_echo, 0.05)
        try:
            reader, writer = await link.connect()
            for i in range(3):
                start = time.monotonic()
                writer.write(bytes([i]))
                assert await reader.readexactly(1) == bytes([i])
                assert time.monotonic() - start >= 0.1
            writer.close()
        finally:
            await link.close()

    run(main)


def test_eof_and_the_answer_after_it_pass_through() -> None:
    """A request half-closed by the client reaches the target whole; the target's answer,
    sent after it read EOF, reaches the client, then EOF."""

    async def main() -> None:
        async def count(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            n = len(await reader.read())  # up to EOF
            writer.write(str(n).encode())
            writer.close()

        link = await _through(count, 0.01)
        try:
            reader, writer = await link.connect()
            await _pump(writer, b"x" * 200_000, 10_000)
            assert await reader.read() == b"200000"
            writer.close()
        finally:
            await link.close()

    run(main)


def test_holds_at_most_a_window_when_the_target_stops_reading() -> None:
    """A target that never reads: the proxy stops reading too, so the client cannot hand
    over 64 MiB (it would, into an unbounded proxy: in under 1 s here, beside a CPU burner)."""

    async def main() -> None:
        stalled = asyncio.Event()

        async def sink(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await stalled.wait()  # never reads
            writer.close()

        link = await _through(sink, 0.0, window=2 * CHUNK_BYTES)
        try:
            _, writer = await link.connect()
            writer.write(bytes(64 * 1024 * 1024))
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(writer.drain(), 1.5)
            writer.transport.abort()
            stalled.set()
        finally:
            await link.close()

    run(main)


def test_an_unreachable_target_closes_the_connection() -> None:
    async def main() -> None:
        server, port = await _serve(_echo)
        server.close()
        await server.wait_closed()
        proxy = DelayProxy(port, 0.0)
        await proxy.start()
        try:
            reader, writer = await asyncio.open_connection(LOOPBACK, proxy.port)
            assert await reader.read() == b""
            writer.close()
        finally:
            await proxy.close()

    run(main)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"target_port": 1, "delay": -0.1},
        {"target_port": 1, "delay": 0.1, "jitter": -1.0},
        {"target_port": 0, "delay": 0.1},
        {"target_port": 1, "delay": 0.1, "window": 100},
    ],
)
def test_bad_settings_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        DelayProxy(**kwargs)  # type: ignore[arg-type]
