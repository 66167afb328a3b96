"""A TCP proxy on loopback that delays every byte by a fixed one-way time: a wide-area link
for a swarm on one machine, without root (this kernel has no ``netem``).

Each accepted connection is forwarded to ``host:target_port``. In each direction a
reader stamps every chunk it reads with the time it may leave, ``now + delay`` (plus a
random jitter in ``[0, jitter]``, never earlier than the chunk before it, so the bytes stay
in order), and a writer sends it at that time. Both directions are delayed, so a round trip
through the proxy costs ``2 * delay``. An end that closes its side (EOF) closes the other's
after the same delay; an end that breaks drops the connection.

Memory is bounded: each direction holds at most ``window`` bytes in flight (the reader
stops reading when it is full, so TCP's flow control slows the sender), which also caps a
connection's throughput at about ``window / delay`` per direction, like a TCP window on a
long link. The proxy binds and dials one local address, ``host``: loopback by default, or a
network namespace's own address when the link itself is throttled (``diloco.bench.netns``;
the proxy then runs in that namespace, beside its node).

How a swarm uses it (``benchmarks/wan.py``, ``docs/design.md "Across the internet"``):
node X listens on ``127.0.0.1:PX`` and ``--announce``-s ``/ip4/127.0.0.1/tcp/QX``, where a
proxy listens on ``QX`` forwarding to ``PX``; peers dial the announced address, so every
connection to X crosses X's proxy. Run alone::

    python -m diloco.bench.wan_proxy --target-port PX --port QX --delay-ms 50
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import logging
import random

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
CHUNK_BYTES = 64 * 1024
WINDOW_BYTES = 8 * 1024 * 1024
"""Default bytes in flight per direction of a connection (see the module docstring)."""


class _Pipe:
    """One direction of one connection: reads, holds each chunk until its time, writes."""

    def __init__(self, proxy: DelayProxy) -> None:
        self.proxy = proxy
        self.queue: collections.deque[tuple[float, bytes]] = collections.deque()
        self.held = 0
        self.last_due = 0.0
        self.arrived = asyncio.Event()
        """Set when a chunk is queued (the writer waits for it when the queue is empty)."""
        self.drained = asyncio.Event()
        """Set when a chunk is written (the reader waits for it when the window is full)."""

    async def read(self, reader: asyncio.StreamReader) -> None:
        """Stamp and queue chunks until EOF (queued as ``b""``) or a break."""
        loop = asyncio.get_running_loop()
        try:
            while True:
                while self.held >= self.proxy.window:
                    self.drained.clear()
                    await self.drained.wait()
                chunk = await reader.read(CHUNK_BYTES)
                due = max(self.last_due, loop.time() + self.proxy.one_way())
                self.last_due = due
                self.queue.append((due, chunk))
                self.held += len(chunk)
                self.arrived.set()
                if not chunk:
                    return
        except (ConnectionError, OSError):
            self.queue.append((loop.time(), b""))
            self.arrived.set()

    async def write(self, writer: asyncio.StreamWriter) -> None:
        """Send each chunk at its time; at EOF close the writing side."""
        loop = asyncio.get_running_loop()
        while True:
            while not self.queue:
                self.arrived.clear()
                await self.arrived.wait()
            due, chunk = self.queue[0]
            if (wait := due - loop.time()) > 0:
                await asyncio.sleep(wait)
            self.queue.popleft()
            if not chunk:
                if writer.can_write_eof():
                    writer.write_eof()
                await writer.drain()
                return
            writer.write(chunk)
            await writer.drain()
            self.held -= len(chunk)
            self.proxy.bytes_forwarded += len(chunk)
            self.drained.set()


class DelayProxy:
    """Forwards connections accepted on ``host:port`` to ``host:target_port``, delaying each
    direction by ``delay`` seconds plus up to ``jitter`` seconds."""

    def __init__(
        self,
        target_port: int,
        delay: float,
        *,
        jitter: float = 0.0,
        port: int = 0,
        window: int = WINDOW_BYTES,
        seed: int | None = None,
        host: str = LOOPBACK,
    ) -> None:
        if not (delay >= 0 and jitter >= 0):
            raise ValueError(f"delay and jitter must be >= 0 s, got {delay} and {jitter}")
        if window < CHUNK_BYTES:
            raise ValueError(f"window must be at least {CHUNK_BYTES} bytes, got {window}")
        if not (0 < target_port < 65536 and 0 <= port < 65536):
            raise ValueError(f"bad ports: target {target_port}, listen {port}")
        self.target_port, self.delay, self.jitter = target_port, delay, jitter
        self.host = host
        self.port, self.window = port, window
        self.random = random.Random(seed)
        self.connections = 0
        """Connections accepted so far."""
        self.open_connections = 0
        """Connections to the target open now (``benchmarks/wan.py`` compares it with the
        target's established connections: what did not cross the proxy)."""
        self.bytes_forwarded = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def one_way(self) -> float:
        """This chunk's one-way delay in seconds."""
        return self.delay + (self.random.uniform(0.0, self.jitter) if self.jitter else 0.0)

    async def start(self) -> int:
        """Listen; returns the port (a free one when ``port`` was 0)."""
        self._server = await asyncio.start_server(self._accept, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def close(self) -> None:
        """Stop listening and drop every connection."""
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self.connections += 1
        try:
            await self._forward(reader, writer)
        finally:
            self._tasks.discard(task)

    async def _forward(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(self.host, self.target_port)
        except OSError as exc:
            logger.info("proxy %d: target %d refused: %r", self.port, self.target_port, exc)
            writer.close()
            return
        self.open_connections += 1
        there, back = _Pipe(self), _Pipe(self)
        tasks = [
            asyncio.create_task(there.read(reader)),
            asyncio.create_task(there.write(up_writer)),
            asyncio.create_task(back.read(up_reader)),
            asyncio.create_task(back.write(writer)),
        ]
        try:
            # Both writers done: both sides sent EOF and it was delivered. A writer that
            # fails (the peer is gone) ends the connection at once.
            writers = {tasks[1], tasks[3]}
            while writers:
                done, _ = await asyncio.wait(writers, return_when=asyncio.FIRST_COMPLETED)
                writers -= done
                if any(t.exception() is not None for t in done):
                    break
        finally:
            self.open_connections -= 1
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for w in (writer, up_writer):
                w.close()
                with contextlib.suppress(ConnectionError, OSError):
                    await w.wait_closed()


async def _serve(args: argparse.Namespace) -> None:
    proxy = DelayProxy(
        args.target_port, args.delay_ms / 1000, jitter=args.jitter_ms / 1000, port=args.port
    )
    port = await proxy.start()
    print(f"{LOOPBACK}:{port} -> {LOOPBACK}:{args.target_port}, {args.delay_ms} ms", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await proxy.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target-port", type=int, required=True)
    parser.add_argument("--port", type=int, default=0, help="listen port (0: a free one)")
    parser.add_argument("--delay-ms", type=float, required=True, help="one-way delay")
    parser.add_argument("--jitter-ms", type=float, default=0.0)
    args = parser.parse_args()
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(args))


if __name__ == "__main__":
    main()
