"""A node waiting for peers that do not come reads the round less and less often: the wait
between two reads doubles from ``poll`` up to a quarter window (``Follower.max_poll``). In
one process, ``Matchmaker`` over ``memory_p2p`` streams and a DHT held in a dict."""

from __future__ import annotations

import asyncio

import pytest
from hivemind.p2p import PeerID
from memory_dht import MemoryDHT, Table
from memory_p2p import MemoryNetwork, make_identity

from diloco.errors import RoundFailed
from diloco.protocol.core.group import RoundTimeouts
from diloco.protocol.core.reducer import RoundKey
from diloco.protocol.matchmaking.lobby import Lobby
from diloco.protocol.matchmaking.matchmaker import Matchmaker
from diloco.protocol.trust.bans import BanList

pytestmark = pytest.mark.clocked

RUN_ID = "poll-0123456789abcdef"
DIGEST = bytes(range(16))


class Counting(Matchmaker):
    """A matchmaker that counts its reads of the round."""

    reads = 0

    async def _read_view(self, lobby: Lobby) -> None:
        self.reads += 1
        await super()._read_view(lobby)


def test_a_node_waiting_for_a_peer_that_never_comes_reads_less_and_less_often() -> None:
    timeouts = RoundTimeouts(matchmaking_window=2.0, join_timeout=0.5)
    identity = make_identity(0)
    me = PeerID.from_base58(identity.peer_id)
    dht = MemoryDHT(identity, Table())
    node = Counting(MemoryNetwork().join(me), dht, RUN_ID, DIGEST, timeouts, BanList(), 2, 2)

    async def main() -> None:
        await node.start()
        with pytest.raises(RoundFailed, match="no group"):
            await node.form_group(RoundKey(0, 1), 1000, 0, 0, 1.0, "a" * 64)

    asyncio.run(main())
    # Waits of 0.05, 0.1, 0.2, 0.4, then 0.5 s fill the 2 s window in 7 reads and the
    # first; at a steady 0.05 s it was 40.
    assert 3 <= node.reads <= 10, node.reads
