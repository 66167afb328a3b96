"""In-memory stand-ins for hivemind's ``P2P``: binary streams between peers of one loop.

Every stream is a ``socketpair`` wrapped in asyncio streams, so a closed end, a reset and
back-pressure behave as over p2pd's unix sockets, without a daemon or a process. A stream
to a peer that is gone or has no such handler is refused with ``ControlFailure``, as
p2pd refuses it; ``MemoryP2P.kill`` drops a peer like a machine losing power (every
stream it holds is closed, its handlers stop).
"""

from __future__ import annotations

import asyncio
import hashlib
import socket

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.p2p import PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo
from hivemind.p2p.p2p_daemon_bindings.utils import ControlFailure
from hivemind.utils.multiaddr import Multiaddr

from diloco.protocol.runtime.streams import StreamHandler
from diloco.protocol.trust.identity import Identity

Stream = tuple[asyncio.StreamReader, asyncio.StreamWriter]
_ADDR = Multiaddr("/ip4/127.0.0.1/tcp/1")


async def stream_pair() -> tuple[Stream, Stream]:
    """Two connected ends of one in-memory stream (reader and writer each)."""
    a, b = socket.socketpair()
    return await asyncio.open_connection(sock=a), await asyncio.open_connection(sock=b)


def make_peer_id(i: int) -> PeerID:
    """A distinct peer id; ids sort by ``i`` (group order follows peer id bytes)."""
    return PeerID(bytes([0x00, 0x24]) + i.to_bytes(4, "big") + b"memory-peer")


def make_identity(i: int) -> Identity:
    """A distinct Ed25519 identity, the same in every run; its peer id verifies what it
    signs (ids do not sort by ``i``)."""
    seed = hashlib.sha256(f"memory-peer {i}".encode()).digest()
    return Identity.from_private_key(Ed25519PrivateKey.from_private_bytes(seed))


class MemoryNetwork:
    """The peers that can reach each other."""

    def __init__(self) -> None:
        self.peers: dict[PeerID, MemoryP2P] = {}

    def join(self, peer_id: PeerID) -> MemoryP2P:
        p2p = MemoryP2P(self, peer_id)
        self.peers[peer_id] = p2p
        return p2p

    def close(self) -> None:
        """Close every stream end still open (the tests' cleanup)."""
        for p2p in self.peers.values():
            for writer in p2p.writers:
                writer.close()


class MemoryP2P:
    """One peer: the three methods and the attribute of ``P2P`` the protocol uses."""

    def __init__(self, network: MemoryNetwork, peer_id: PeerID) -> None:
        self.network, self.peer_id = network, peer_id
        self.handlers: dict[str, StreamHandler] = {}
        self.writers: list[asyncio.StreamWriter] = []
        self.tasks: set[asyncio.Task[None]] = set()
        self.alive = True

    async def add_binary_stream_handler(self, name: str, handler: StreamHandler) -> None:
        self.handlers[name] = handler

    async def remove_binary_stream_handler(self, name: str) -> None:
        del self.handlers[name]

    async def call_binary_stream_handler(
        self, peer_id: PeerID, handler_name: str
    ) -> tuple[StreamInfo, asyncio.StreamReader, asyncio.StreamWriter]:
        target = self.network.peers.get(peer_id)
        if not self.alive or target is None or not target.alive:
            raise ControlFailure(f"Connect failed. msg=failed to dial {peer_id}")
        handler = target.handlers.get(handler_name)
        if handler is None:
            raise ControlFailure(f"Connect failed. msg=protocol not supported: {handler_name}")
        (my_reader, my_writer), (their_reader, their_writer) = await stream_pair()
        self.writers.append(my_writer)
        target.writers.append(their_writer)
        info = StreamInfo(self.peer_id, _ADDR, handler_name)
        task = asyncio.create_task(handler(info, their_reader, their_writer))
        target.tasks.add(task)
        task.add_done_callback(target.tasks.discard)
        return StreamInfo(peer_id, _ADDR, handler_name), my_reader, my_writer

    def kill(self) -> None:
        """Vanish: refuse new streams, close every stream end, stop every handler."""
        self.alive = False
        for writer in self.writers:
            writer.close()
        for task in list(self.tasks):
            task.cancel()
