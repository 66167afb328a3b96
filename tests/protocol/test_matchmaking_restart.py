"""A node killed after it joined a round and restarted from an older checkpoint with the
same identity reaches that round again (``Ahead.earlier_process_in``), in one process
(``Matchmaker`` over ``memory_p2p`` streams and a DHT held in a dict; the previous
process is its declaration, left in the DHT).

A chaos run showed what happens without the check: the old process had formed the round
with one peer, the new one formed it again with another, and the three nodes ended with
two states (two groups of one round from one prior)."""

from __future__ import annotations

import asyncio

import pytest
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time
from memory_dht import MemoryDHT, Table
from memory_p2p import MemoryNetwork, make_identity

from diloco.errors import RoundFailed
from diloco.protocol.core.group import GroupInfo, RoundTimeouts
from diloco.protocol.core.reducer import RoundKey
from diloco.protocol.matchmaking.lobby import round_key
from diloco.protocol.matchmaking.matchmaker import Matchmaker
from diloco.protocol.records.declarations import declare_round, read_round_expiring
from diloco.protocol.trust.bans import BanList

pytestmark = pytest.mark.clocked

RUN_ID = "restart-0123456789abcdef"
DIGEST = bytes(range(16))
KEY = RoundKey(2, 5)
DHT_KEY = round_key(RUN_ID, KEY)
TIMEOUTS = RoundTimeouts(matchmaking_window=0.3, join_timeout=0.3, connect_timeout=1.0)
PRIOR = "a" * 64
EARLIER_PROCESS = "previous process was in this round"
NUMEL = 1000


def _restarted(seed: int) -> tuple[Matchmaker, Matchmaker, MemoryDHT]:
    """A peer, the restarted node, and its previous process's DHT handle (same identity)."""
    network, table = MemoryNetwork(), Table()
    other, node = make_identity(seed), make_identity(seed + 1)
    peers = []
    for identity in (other, node):
        p2p = network.join(PeerID.from_base58(identity.peer_id))
        dht = MemoryDHT(identity, table)
        peers.append(Matchmaker(p2p, dht, RUN_ID, DIGEST, TIMEOUTS, BanList(), 2, 2))
    return peers[0], peers[1], MemoryDHT(node, table)


async def _previous_process_declared(previous: MemoryDHT, due: float) -> float:
    """The killed process's declaration of the round, as it left it: made for a send step
    it said it reaches at ``due`` (DHT time); its expiration."""
    expiration = due + TIMEOUTS.matchmaking + TIMEOUTS.allreduce
    assert await declare_round(previous, DHT_KEY, 1.0, expiration, prior=PRIOR)
    return expiration


def _both_form(
    other: Matchmaker, node: Matchmaker, previous: MemoryDHT, due: float
) -> list[GroupInfo | BaseException]:
    """The previous process's declaration due at ``due``, then the restarted node and its
    peer both form the round: each one's group, or why it failed."""

    async def main() -> list[GroupInfo | BaseException]:
        await other.start()
        await node.start()
        await _previous_process_declared(previous, due)
        return list(
            await asyncio.gather(
                *(p.form_group(KEY, NUMEL, 0, 0, 1.0, PRIOR) for p in (node, other)),
                return_exceptions=True,
            )
        )

    return asyncio.run(main())


def test_a_restarted_node_sits_out_a_round_its_previous_process_declared() -> None:
    """The restarted node (its identity reused) finds its own peer id declared in the round
    before declaring: it fails the round at once (it heals instead), and the peer that
    would have formed a second group with it fails too. Without the check the two formed
    a group."""
    other, node, previous = _restarted(0)
    node.restarted_at = get_dht_time()
    mine, theirs = _both_form(other, node, previous, due=node.restarted_at - 1.0)
    assert isinstance(mine, RoundFailed) and EARLIER_PROCESS in str(mine), mine
    assert isinstance(theirs, RoundFailed), theirs


def test_a_restarted_node_announces_no_round_its_previous_process_declared() -> None:
    """Announced ahead, the same round: the restarted node declares nothing (the old
    declaration is left as it was, not replaced) and fails the round at its send step."""
    _, node, previous = _restarted(10)
    node.restarted_at = get_dht_time()

    async def main() -> tuple[float, float]:
        await node.start()
        expiration = await _previous_process_declared(previous, due=node.restarted_at - 1.0)
        node.open_ahead(KEY, node.join_request(KEY, NUMEL, 0, 0, 1.0, False), PRIOR, True, 5.0)
        while KEY in node._lobbies:  # read, found its old declaration, dropped the lobby
            await asyncio.sleep(0.01)
        with pytest.raises(RoundFailed, match=EARLIER_PROCESS):
            await node.form_group(KEY, NUMEL, 0, 0, 1.0, PRIOR)
        view = await read_round_expiring(node.dht, DHT_KEY)
        return expiration, view[node.p2p.peer_id][1]

    declared, found = asyncio.run(main())
    assert found == pytest.approx(declared)


def test_a_round_the_previous_process_only_announced_is_taken_as_usual() -> None:
    """The previous process announced the round ahead, due 10 s after the restart: it died
    before its send step and sent nothing, so the restarted node forms the round with its
    peer (sitting it out would have cost the peer the round too), and its declaration
    replaces the old one."""
    other, node, previous = _restarted(20)
    node.restarted_at = get_dht_time()

    async def main() -> tuple[list[GroupInfo], float, float]:
        await other.start()
        await node.start()
        old = await _previous_process_declared(previous, due=node.restarted_at + 10.0)
        groups = await asyncio.gather(
            *(p.form_group(KEY, NUMEL, 0, 0, 1.0, PRIOR) for p in (node, other))
        )
        view = await read_round_expiring(node.dht, DHT_KEY)
        return list(groups), old, view[node.p2p.peer_id][1]

    groups, old, new = asyncio.run(main())
    assert groups[0].group_id == groups[1].group_id
    assert new > old  # its own declaration replaced the old one


def test_a_round_its_previous_process_noted_is_sat_out_whatever_its_declaration_says() -> None:
    """The previous process announced the round ahead with a long lead (its declaration
    due 10 s after the restart), reached the send step sooner and formed a group, then died;
    its notes in the checkpoint folder say it reached the round. The restarted node sits
    it out, and its peer fails the round too; by the declaration alone the two formed the
    round again (the test above)."""
    other, node, previous = _restarted(30)
    node.restarted_at = get_dht_time()
    node.reached_before([KEY])
    mine, theirs = _both_form(other, node, previous, due=node.restarted_at + 10.0)
    assert isinstance(mine, RoundFailed) and EARLIER_PROCESS in str(mine), mine
    assert isinstance(theirs, RoundFailed), theirs
