"""A node waiting for peers that do not come reads the round less and less often: in its
window and while its JOIN waits for the leader's GROUP, the wait between two reads doubles
from ``poll`` up to a quarter window (``Follower.max_poll``); before its send step, from
``AHEAD_POLL_S`` up to a window. Each read asks every peer of the DHT, which answers it. In
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
from diloco.protocol.matchmaking.lobby import Lobby, leader_rank, round_key
from diloco.protocol.matchmaking.matchmaker import Matchmaker
from diloco.protocol.trust.bans import BanList

pytestmark = pytest.mark.clocked

RUN_ID = "poll-0123456789abcdef"
DIGEST = bytes(range(16))


KEY = RoundKey(0, 1)
PRIOR = "a" * 64


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


def _counting(count: int, timeouts: RoundTimeouts) -> list[Counting]:
    """``count`` matchmakers of one swarm (each waits for ``count`` peers), the one to lead
    the round first."""
    network, table = MemoryNetwork(), Table()
    identities = [make_identity(i) for i in range(count)]
    key = round_key(RUN_ID, KEY)
    identities.sort(key=lambda i: leader_rank(key, PeerID.from_base58(i.peer_id)))
    peers = []
    for identity in identities:
        p2p = network.join(PeerID.from_base58(identity.peer_id))
        dht = MemoryDHT(identity, table)
        peers.append(Counting(p2p, dht, RUN_ID, DIGEST, timeouts, BanList(), 2, count))
    return peers


def test_a_round_announced_ahead_is_read_less_and_less_often_while_a_peer_is_missing() -> None:
    """Before the send step nobody waits on the reads: a peer that never declares (gone, or
    a key that never works) is not looked for every quarter second of the lead."""
    timeouts = RoundTimeouts(matchmaking_window=1.0, join_timeout=0.5)
    node, _ = _counting(2, timeouts)  # the other never declares

    async def main() -> None:
        await node.start()
        node.open_ahead(KEY, node.join_request(KEY, 1000, 0, 0, 1.0, False), PRIOR, True, 2.0)
        await asyncio.sleep(3.2)  # the reads ahead end a lead and a window after the start

    asyncio.run(main())
    # Waits of 0.25, 0.5, then 1 s: 5 reads in 3 s; at a steady 0.25 s it was 12.
    assert 3 <= node.reads <= 7, node.reads


def test_a_join_waiting_for_its_leader_reads_less_and_less_often() -> None:
    """A follower whose leader waits out its window for a third peer that never declares:
    the follower reads the round again and again to learn whether all have declared."""
    timeouts = RoundTimeouts(matchmaking_window=2.0, join_timeout=0.5)
    leader, follower, _ = _counting(3, timeouts)  # the third never declares

    async def main() -> None:
        await asyncio.gather(leader.start(), follower.start())
        form = [p.form_group(KEY, 1000, 0, 0, 1.0, PRIOR) for p in (leader, follower)]
        led, followed = await asyncio.gather(*form)
        assert led.members == followed.members and len(led.members) == 2

    asyncio.run(main())
    # The follower joins at once and waits out the leader's 2 s window: waits doubling
    # from 0.05 to 0.5 s read it about 7 times; at a steady 0.05 s it was 40.
    assert 2 <= follower.reads <= 12, follower.reads
