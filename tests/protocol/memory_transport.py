"""Streams between members of one event loop over socket pairs: the wire code (frames,
routing, deadlines) without p2pd, for in-process tests of many members."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

from hivemind.p2p import PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo
from hivemind.utils.multiaddr import Multiaddr

from diloco.protocol.streams import StreamHandler


class MemoryNetwork:
    """The peers of one test: handler tables by peer id; a peer marked dead refuses."""

    def __init__(self) -> None:
        self.handlers: dict[PeerID, dict[str, StreamHandler]] = {}
        self.dead: set[PeerID] = set()
        self.tasks: set[asyncio.Task[Any]] = set()

    def transport(self, peer: PeerID) -> MemoryTransport:
        self.handlers[peer] = {}
        return MemoryTransport(self, peer)


class MemoryTransport:
    """One peer's side (``streams.StreamTransport``)."""

    def __init__(self, network: MemoryNetwork, peer: PeerID) -> None:
        self.network, self._peer = network, peer

    @property
    def peer_id(self) -> PeerID:
        return self._peer

    async def add_binary_stream_handler(self, name: str, handler: StreamHandler) -> None:
        self.network.handlers[self._peer][name] = handler

    async def call_binary_stream_handler(
        self, peer_id: PeerID, handler_name: str
    ) -> tuple[StreamInfo, asyncio.StreamReader, asyncio.StreamWriter]:
        if peer_id in self.network.dead or self._peer in self.network.dead:
            raise ConnectionRefusedError(f"{peer_id} is gone")
        handler = self.network.handlers[peer_id][handler_name]
        ours, theirs = socket.socketpair()
        reader, writer = await asyncio.open_connection(sock=ours)
        their_reader, their_writer = await asyncio.open_connection(sock=theirs)
        info = StreamInfo(self._peer, Multiaddr("/ip4/127.0.0.1/tcp/1"), handler_name)
        task = asyncio.create_task(handler(info, their_reader, their_writer))
        self.network.tasks.add(task)
        task.add_done_callback(self.network.tasks.discard)
        return StreamInfo(peer_id, info.addr, handler_name), reader, writer
