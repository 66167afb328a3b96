"""A node that left: its declarations of the rounds ahead outlive it, and the nodes left
count it in those rounds only by a JOIN (docs/design.md "The node and its CLI"). In one
process, ``Matchmaker`` over ``memory_p2p`` streams and a DHT held in a dict."""

from __future__ import annotations

import asyncio

import pytest
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time
from memory_dht import MemoryDHT, Table
from memory_p2p import MemoryNetwork, make_identity

from diloco.protocol.core.group import GroupInfo, RoundTimeouts
from diloco.protocol.core.reducer import RoundKey
from diloco.protocol.matchmaking.lobby import leader_rank, round_key
from diloco.protocol.matchmaking.matchmaker import Matchmaker
from diloco.protocol.records.declarations import declare_round
from diloco.protocol.trust.bans import BanList

pytestmark = pytest.mark.clocked

RUN_ID = "left-0123456789abcdef"
DIGEST = bytes(range(16))
KEY = RoundKey(2, 5)
PRIOR = "b" * 64
TIMEOUTS = RoundTimeouts(matchmaking_window=0.5, join_timeout=30.0)
"""A leader waits up to ``join_timeout`` for the JOINs of the peers it saw declare: 30 s
here, so a wait for the node that left would outlast the test's guard below."""
GUARD_S = 15.0


def _identities() -> tuple[int, list[PeerID]]:
    """Three identities (the one that left last) of which the one that left is not first
    in line to lead ``KEY``: the two left choose their leader among themselves."""
    for n in range(0, 600, 3):
        ids = [PeerID.from_base58(make_identity(n + i).peer_id) for i in range(3)]
        ranks = {leader_rank(round_key(RUN_ID, KEY), peer): peer for peer in ids}
        if ranks[min(ranks)] != ids[2]:
            return n, ids
    raise AssertionError("no three identities found")


def test_a_round_does_not_wait_for_the_declaration_of_a_node_that_left() -> None:
    n, (a, b, gone) = _identities()
    network, table = MemoryNetwork(), Table()
    departed = frozenset({gone})
    nodes = [
        Matchmaker(
            network.join(peer),
            MemoryDHT(make_identity(n + i), table),
            RUN_ID,
            DIGEST,
            TIMEOUTS,
            BanList(),
            2,
            2,  # the target as the records set it: the node that left is not counted
            departed=lambda: departed,
        )
        for i, peer in enumerate((a, b))
    ]

    async def main() -> list[GroupInfo | BaseException]:
        # the node that left declared the round before it left, and sends no JOIN
        leaver = MemoryDHT(make_identity(n + 2), table)
        assert await declare_round(
            leaver, round_key(RUN_ID, KEY), 1.0, get_dht_time() + 60, prior=PRIOR
        )
        for node in nodes:
            await node.start()
        rounds = [node.form_group(KEY, 1000, 0, 0, 1.0, PRIOR) for node in nodes]
        done = asyncio.gather(*rounds, return_exceptions=True)
        return list(await asyncio.wait_for(done, GUARD_S))

    outcomes = asyncio.run(main())
    assert all(isinstance(g, GroupInfo) for g in outcomes), outcomes
    groups = [g for g in outcomes if isinstance(g, GroupInfo)]
    assert {g.group_id for g in groups} == {groups[0].group_id}
    assert set(groups[0].members) == {a, b}
