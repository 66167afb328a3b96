"""Round trips on a round's critical path: the longest chain of exchanges, exchanges that
overlap counted once, only inside a counted round; and a real matchmaking (``Matchmaker``
over ``memory_p2p`` and a DHT in a dict) counted at both of its members."""

from __future__ import annotations

import asyncio

import pytest
from hivemind.p2p import PeerID
from memory_dht import MemoryDHT, Table
from memory_p2p import MemoryNetwork, make_identity

from diloco.protocol.core.group import RoundTimeouts
from diloco.protocol.core.reducer import RoundKey
from diloco.protocol.matchmaking.matchmaker import Matchmaker
from diloco.protocol.runtime import round_trips
from diloco.protocol.runtime.round_trips import RoundTrips, counting, exchange
from diloco.protocol.trust.bans import BanList

pytestmark = pytest.mark.clocked


def kinds(trips: RoundTrips) -> list[str]:
    return [kind for kind, _ in trips.critical_path()]


def test_the_path_is_the_longest_chain_of_intervals_one_after_another() -> None:
    trips = RoundTrips()
    trips.add("declare", 0.0, 1.0)
    trips.add("read", 1.0, 2.0)
    trips.add("part", 2.5, 4.0)  # three parts side by side: one step of the path
    trips.add("part", 2.6, 3.0)
    trips.add("part", 2.7, 3.9)
    trips.add("check", 4.1, 5.0)  # the report and the check overlap
    trips.add("report", 4.2, 4.8)
    path = trips.critical_path()
    assert [kind for kind, _ in path] == ["declare", "read", "part", "check"]
    assert [round(s, 6) for _, s in path] == [1.0, 1.0, 1.5, 0.9]
    assert RoundTrips().critical_path() == []


def test_a_short_exchange_inside_a_long_one_still_chains_after_the_first() -> None:
    """Two reads one after another, side by side with one long exchange: the path is the
    two reads (2), not the long one (1)."""
    trips = RoundTrips()
    trips.add("join", 0.0, 10.0)
    trips.add("read", 1.0, 2.0)
    trips.add("read", 3.0, 4.0)
    assert kinds(trips) == ["read", "read"]


@exchange("ask")
async def _ask(seconds: float) -> float:
    await asyncio.sleep(seconds)
    return seconds


def test_sequential_exchanges_count_each_parallel_ones_once_outside_nothing() -> None:
    async def main() -> tuple[list[str], list[str]]:
        assert await _ask(0.0) == 0.0  # outside a round: not counted, nothing breaks
        with counting() as trips:
            await _ask(0.01)
            await asyncio.gather(*(_ask(0.02) for _ in range(4)))  # tasks inherit the round
            await asyncio.create_task(_ask(0.01))
        with counting() as other:
            await asyncio.gather(_ask(0.02), _ask(0.02))
        await _ask(0.0)  # after the round: not counted
        return kinds(trips), kinds(other)

    first, second = asyncio.run(main())
    assert first == ["ask", "ask", "ask"]
    assert second == ["ask"]


def test_two_rounds_side_by_side_are_counted_apart() -> None:
    """Each round's task has its own count (fragments' rounds overlap in a streaming node)."""

    async def one(n: int) -> list[str]:
        with counting() as trips:
            for _ in range(n):
                await _ask(0.005)
        return kinds(trips)

    async def main() -> list[list[str]]:
        return await asyncio.gather(one(2), one(5))

    assert asyncio.run(main()) == [["ask"] * 2, ["ask"] * 5]


def test_matchmaking_a_pair_leader_declares_and_reads_follower_joins_too() -> None:
    """Two nodes of one prior: both declare then read the view; the follower then JOINs
    the leader and waits for the GROUP, the leader answers it (no exchange of its own)."""
    network, table = MemoryNetwork(), Table()
    timeouts = RoundTimeouts(matchmaking_window=30.0, join_timeout=5.0)
    peers = []
    for i in range(2):
        identity = make_identity(i)
        p2p = network.join(PeerID.from_base58(identity.peer_id))
        dht = MemoryDHT(identity, table)
        digest = bytes(range(16))
        peers.append(
            Matchmaker(p2p, dht, "trips-0123456789abcdef", digest, timeouts, BanList(), 2, 2)
        )

    async def form(peer: Matchmaker) -> list[str]:
        with counting() as trips:
            await peer.form_group(RoundKey(1, 3), 1000, 0, 0, 1.0, "a" * 64)
        return kinds(trips)

    async def main() -> list[list[str]]:
        for peer in peers:
            await peer.start()
        return await asyncio.gather(*(form(peer) for peer in peers))

    paths = asyncio.run(main())
    followers = [p for p in paths if "join" in p]
    leaders = [p for p in paths if "join" not in p]
    assert len(followers) == 1 and len(leaders) == 1, paths
    (follower,), (leader,) = followers, leaders
    assert follower[:2] == ["declare", "read"] and follower[-1] == "join", follower
    assert set(follower[2:-1]) <= {"read"}, follower
    assert leader[0] == "declare" and set(leader[1:]) == {"read"}, leader
    assert round_trips.path_summary([("join", 0.25)]) == "join 0.250s"
