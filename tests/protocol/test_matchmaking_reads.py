"""Matchmaking when the DHT's reads disagree, and for a JOIN that comes late, in one
process (``Matchmaker`` over ``memory_p2p`` streams and a DHT held in a dict): a read of
the round key may miss a record another read found (it started before the record landed,
or came from another replica). Seen in the staged swarm tests: a leader counted 12 of 12
declared, led with the 11 its window's read held, and the 12th peer's JOIN came too late
for a round it had declared; and (CI, 2026-12-04, read from its logs) a round of 12 split
into groups of 8 and 4, each applying its own mean, as a node that had counted the
first-ranked peer among the declared but not in its view led a group of its own."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from hivemind.p2p import PeerID
from memory_dht import MemoryDHT, Table
from memory_p2p import MemoryNetwork, MemoryP2P, make_identity

from diloco.protocol.core.group import GroupInfo, RoundTimeouts
from diloco.protocol.core.reducer import RoundKey
from diloco.protocol.matchmaking.lobby import leader_rank, round_key
from diloco.protocol.matchmaking.matchmaker import Matchmaker
from diloco.protocol.records.declarations import declare_round
from diloco.protocol.trust.bans import BanList
from diloco.protocol.trust.identity import Identity
from diloco.protocol.wire.frames import Group, Join, Kind, Reject, RejectCode, RoundTag

pytestmark = pytest.mark.clocked

RUN_ID = "reads-0123456789abcdef"
DIGEST = bytes(range(16))
KEY = RoundKey(3, 7)
TIMEOUTS = RoundTimeouts(matchmaking_window=30.0, join_timeout=5.0)
DHT_KEY = round_key(RUN_ID, KEY)
JOIN = Join(RoundTag(DIGEST, KEY.fragment, KEY.round), 1000, 0, 0, 1.0)


class ForgetfulDHT(MemoryDHT):
    """A DHT whose reads find the records of ``forget`` once, then no more (a replica that
    lacks them answers the later reads)."""

    def __init__(self, identity: Identity, table: Table) -> None:
        super().__init__(identity, table)
        self.forget: set[Any] = set()
        self.found: set[Any] = set()

    async def get(self, key: str, latest: bool, return_future: bool) -> Any:
        found = await super().get(key, latest, return_future)
        if found is not None:
            for sub in set(found.value) & self.forget:
                if sub in self.found:
                    del found.value[sub]
                self.found.add(sub)
        return found


def _ranked(first: int) -> list[Identity]:
    """Three identities, the first to lead the round first."""
    identities = [make_identity(first + i) for i in range(3)]
    return sorted(identities, key=lambda i: leader_rank(DHT_KEY, PeerID.from_base58(i.peer_id)))


def _matchmaker(
    network: MemoryNetwork, dht: MemoryDHT, target_group_size: int | None = None
) -> Matchmaker:
    p2p = network.join(PeerID.from_base58(dht.identity.peer_id))
    return Matchmaker(
        p2p, dht, RUN_ID, DIGEST, TIMEOUTS, BanList(), target_group_size=target_group_size
    )


async def _until_decided(peer: Matchmaker, forming: asyncio.Task[GroupInfo]) -> None:
    """Until ``peer`` chose its role in the round (or its matchmaking ended)."""
    while not forming.done() and not (KEY in peer._lobbies and peer._lobbies[KEY].decided.is_set()):
        await asyncio.sleep(0.01)


def test_a_leader_waits_for_a_peer_an_earlier_read_found_declared() -> None:
    """The leader's first read finds the late peer's declaration, its later reads do not.
    It still waits for that peer's JOIN (up to the join timeout), so the group has all
    three; before, it led with the two its last read held and refused the third."""
    network, table = MemoryNetwork(), Table()
    first, *others = _ranked(0)
    forgetful = ForgetfulDHT(first, table)
    leader, follower, late = [
        _matchmaker(network, dht, 3) for dht in (forgetful, *(MemoryDHT(i, table) for i in others))
    ]
    ids = [peer.p2p.peer_id for peer in (leader, follower, late)]

    async def main() -> tuple[GroupInfo, GroupInfo, tuple[Kind, bytes]]:
        for peer in (leader, follower, late):
            await peer.start()
        await declare_round(late.dht, DHT_KEY, 1.0, 1e12)
        forgetful.forget = set(table[DHT_KEY])  # the late peer's record: found once
        leading = asyncio.create_task(leader.form_group(KEY, 1000, 0, 0, 1.0))
        while not forgetful.found:  # the leader's first read found it
            await asyncio.sleep(0.01)
        following = asyncio.create_task(follower.form_group(KEY, 1000, 0, 0, 1.0))
        await _until_decided(leader, leading)  # it counts 3 of 3 declared and leads
        reply = await late._call_join(leader.p2p.peer_id, JOIN)
        return await leading, await following, reply

    led, followed, (kind, body) = asyncio.run(main())
    assert kind == Kind.GROUP, body
    assert set(Group.parse(body).members) == {peer.to_bytes() for peer in ids}
    assert set(led.members) == set(followed.members) == set(ids)


def test_a_follower_taking_over_a_dead_leader_waits_for_peers_declared_since() -> None:
    """The second-ranked peer JOINs the first-ranked one as soon as it sees it (its view
    then holds the two), finds it dead and leads instead; a third peer declared meanwhile
    and, finding the leader dead too, JOINs it. It reads the round once more before
    leading, so it waits for the third: a group of two. Before, it led the view it had
    followed with (itself alone: too small), and the third was refused."""
    network, table = MemoryNetwork(), Table()
    dead, second, third = [_matchmaker(network, MemoryDHT(i, table)) for i in _ranked(10)]

    async def main() -> list[GroupInfo | BaseException]:
        await declare_round(dead.dht, DHT_KEY, 1.0, 1e12)
        dead.p2p.kill()  # declared, then gone
        for peer in (second, third):
            await peer.start()
        taking_over = asyncio.create_task(second.form_group(KEY, 1000, 0, 0, 1.0))
        await _until_decided(
            second, taking_over
        )  # it follows the dead leader, its view {dead, itself}
        late = asyncio.create_task(third.form_group(KEY, 1000, 0, 0, 1.0))
        return await asyncio.gather(taking_over, late, return_exceptions=True)

    results = asyncio.run(main())
    assert all(isinstance(r, GroupInfo) for r in results), results
    pair = {second.p2p.peer_id, third.p2p.peer_id}
    assert all(set(r.members) == pair for r in results), results


class DyingLeader(Matchmaker):
    """Leads, and as soon as the first member has JOINed vanishes like a machine losing
    power (every stream it holds cut, no new one accepted)."""

    async def _lead(self, key: RoundKey, lobby: Any, view: set[PeerID], wait: float) -> Any:
        await lobby.changed.wait()
        assert isinstance(self.p2p, MemoryP2P)
        self.p2p.kill()
        await asyncio.Event().wait()  # a dead machine does nothing more


def test_followers_of_a_dead_leader_agree_on_its_successor_whatever_they_saw_first() -> None:
    """Four peers follow a leader that dies once they JOINed it. The third in line chose to
    follow it as soon as its first read found it (its view then held the two), the others
    after all five had declared. Each reads the round again when its leader turns out
    dead, so all four take the same successor, the first live peer in line, and form one
    group of four. Before, each picked the successor from the view it had followed with:
    the third led a group of its own, waiting for peers that JOINed the first, and the
    round split (seen in the swarm test of a dead leader)."""
    timeouts = RoundTimeouts(matchmaking_window=0.5, join_timeout=0.25)
    network, table = MemoryNetwork(), Table()
    identities = sorted(
        (make_identity(30 + i) for i in range(5)),
        key=lambda i: leader_rank(DHT_KEY, PeerID.from_base58(i.peer_id)),
    )
    leader, *honest = (
        cls(
            network.join(PeerID.from_base58(identity.peer_id)),
            MemoryDHT(identity, table),
            RUN_ID,
            DIGEST,
            timeouts,
            BanList(),
        )
        for cls, identity in zip((DyingLeader, *[Matchmaker] * 4), identities, strict=True)
    )
    stale, others = honest[2], [honest[0], honest[1], honest[3]]

    async def main() -> list[GroupInfo | BaseException]:
        for peer in (leader, *honest):
            await peer.start()
        leading = asyncio.create_task(leader.form_group(KEY, 1000, 0, 0, 1.0))
        while not (KEY in leader._lobbies and leader._lobbies[KEY].reads):
            await asyncio.sleep(0.01)  # it declared, and waits out its window
        tasks = {stale: asyncio.create_task(stale.form_group(KEY, 1000, 0, 0, 1.0))}
        await _until_decided(stale, tasks[stale])  # its view: the leader and itself
        assert set(stale._lobbies[KEY].seen) == {leader.p2p.peer_id, stale.p2p.peer_id}
        for peer in others:
            tasks[peer] = asyncio.create_task(peer.form_group(KEY, 1000, 0, 0, 1.0))
        for peer in others:
            await _until_decided(peer, tasks[peer])
        outcomes = await asyncio.gather(*(tasks[p] for p in honest), return_exceptions=True)
        leading.cancel()
        await asyncio.gather(leading, return_exceptions=True)
        network.close()
        return outcomes

    outcomes = asyncio.run(main())
    ids = {peer.p2p.peer_id for peer in honest}
    assert all(isinstance(r, GroupInfo) and set(r.members) == ids for r in outcomes), outcomes


def test_a_join_after_the_leader_formed_its_group_is_told_the_group_closed() -> None:
    """A peer that JOINs a leader whose round's group formed and whose matchmaking ended
    gets GROUP_CLOSED (it misses the round), not UNKNOWN_ROUND (as if the leader had never
    been in it)."""
    network, table = MemoryNetwork(), Table()
    first, other, late = [_matchmaker(network, MemoryDHT(i, table), 2) for i in _ranked(20)]

    async def main() -> tuple[list[GroupInfo], tuple[Kind, bytes]]:
        for peer in (first, other, late):
            await peer.start()
        groups = await asyncio.gather(
            *(peer.form_group(KEY, 1000, 0, 0, 1.0) for peer in (first, other))
        )
        return list(groups), await late._call_join(first.p2p.peer_id, JOIN)

    groups, (kind, body) = asyncio.run(main())
    assert all(set(g.members) == {first.p2p.peer_id, other.p2p.peer_id} for g in groups)
    assert kind == Kind.REJECT
    assert Reject.parse(body).code == RejectCode.GROUP_CLOSED, Reject.parse(body)
