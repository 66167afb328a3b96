"""A leader that is alive but silent (takes JOINs, sends no GROUP), in one process
(``Matchmaker`` over ``memory_p2p`` streams and a DHT held in a dict): its followers charge
it an offence once its GROUP is overdue and the next in line leads, so the round still
forms; after repeated offences it is banned and nobody follows it any more
(docs/design.md "Liveness")."""

from __future__ import annotations

import asyncio

import pytest
from faults import SilentLeader
from hivemind.p2p import PeerID
from memory_dht import MemoryDHT, Table
from memory_p2p import MemoryNetwork, make_identity

from diloco.errors import RoundFailed
from diloco.protocol.core.group import GroupInfo, RoundTimeouts
from diloco.protocol.core.reducer import RoundKey
from diloco.protocol.matchmaking.lobby import Lobby, leader_rank, round_key
from diloco.protocol.matchmaking.matchmaker import Matchmaker
from diloco.protocol.records.declarations import declare_round
from diloco.protocol.trust.bans import BAN_OFFENCES, SILENCE_SPAN, BanList
from diloco.protocol.wire.frames import Join, RoundTag

pytestmark = pytest.mark.clocked

RUN_ID = "liveness-0123456789abcdef"
DIGEST = bytes(range(16))
TIMEOUTS = RoundTimeouts(matchmaking_window=0.25, join_timeout=0.25)
ROUNDS = 6


class Clock:
    """The ban lists' clock, moved by the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class CountingBans(BanList):
    """A ``BanList`` that also counts the offences reported against each peer."""

    def __init__(self, clock: Clock) -> None:
        super().__init__(clock=clock)
        self.offences: dict[PeerID, int] = {}

    def offend(self, peer: PeerID, reason: str, *, silence: bool = False) -> bool:
        self.offences[peer] = self.offences.get(peer, 0) + 1
        return super().offend(peer, reason, silence=silence)


def _rounds_led_by(silent: PeerID, peers: list[PeerID], count: int) -> list[RoundKey]:
    """The first ``count`` rounds of fragment 3 that ``silent`` is first in line to lead."""
    keys = (RoundKey(3, k) for k in range(1, 10_000))
    led = (
        key
        for key in keys
        if min(peers, key=lambda p: leader_rank(round_key(RUN_ID, key), p)) == silent
    )
    return [next(led) for _ in range(count)]


def _run(
    target_group_size: int | None, apart: float = SILENCE_SPAN
) -> tuple[list[list[GroupInfo | BaseException]], list[CountingBans], list[PeerID]]:
    """Six rounds that the silent peer (the last) is first in line to lead, ``apart``
    seconds apart on the ban lists' clock; per round the honest peers' outcomes, their ban
    lists, and the three peer ids."""
    network, table = MemoryNetwork(), Table()
    identities = [make_identity(40 + i) for i in range(3)]
    clock = Clock()
    bans = [CountingBans(clock) for _ in identities]
    peers = [
        cls(
            network.join(PeerID.from_base58(identity.peer_id)),
            MemoryDHT(identity, table),
            RUN_ID,
            DIGEST,
            TIMEOUTS,
            ban_list,
            target_group_size=target_group_size,
        )
        for cls, identity, ban_list in zip(
            (Matchmaker, Matchmaker, SilentLeader), identities, bans, strict=True
        )
    ]
    ids = [peer.p2p.peer_id for peer in peers]
    keys = _rounds_led_by(ids[2], ids, ROUNDS)

    async def main() -> list[list[GroupInfo | BaseException]]:
        for peer in peers:
            await peer.start()
        outcomes = []
        for key in keys:
            clock.now += apart
            tasks = [asyncio.create_task(p.form_group(key, 1000, 0, 0, 1.0)) for p in peers]
            outcomes.append(await asyncio.gather(*tasks[:2], return_exceptions=True))
            tasks[2].cancel()  # the silent peer waits out its bound; the test need not
            await asyncio.gather(tasks[2], return_exceptions=True)
        network.close()
        return outcomes

    return asyncio.run(main()), bans, ids


def _check(target_group_size: int | None) -> None:
    outcomes, bans, ids = _run(target_group_size)
    honest, silent = set(ids[:2]), ids[2]
    formed = [o for o in outcomes if all(isinstance(r, GroupInfo) for r in o)]
    assert len(formed) == ROUNDS, outcomes  # every round formed without the silent leader
    assert all(set(r.members) == honest for o in formed for r in o if isinstance(r, GroupInfo))
    # each honest follower charged it once per round until the ban, then never followed it
    assert [b.offences.get(silent, 0) for b in bans[:2]] == [BAN_OFFENCES] * 2
    assert all(b.banned(silent) for b in bans[:2])
    assert not any(b.offences.get(peer) for b in bans for peer in honest)  # nobody honest
    assert all(not isinstance(r, RoundFailed) for o in outcomes for r in o)


def test_silent_leader_charged_next_in_line_leads_then_banned() -> None:
    """Every peer waits for all three (``target_group_size``): the GROUP is due two join
    timeouts after all three declared."""
    _check(target_group_size=3)


def test_silent_leader_charged_without_a_target_group_size() -> None:
    """No target size: the GROUP is due a window and two join timeouts after a follower
    chose its role, and the takeover still fits the matchmaking bound."""
    _check(target_group_size=None)


def test_a_leader_silent_in_rounds_within_a_minute_commits_one_offence() -> None:
    """The same silent leader, its six rounds within seconds (a node stopped for that
    long is silent in each round it was due in): each follower charges the first silence
    and counts the others with it, so it is not banned; the next in line leads them all."""
    outcomes, bans, ids = _run(target_group_size=3, apart=1.0)
    honest, silent = set(ids[:2]), ids[2]
    formed = [o for o in outcomes if all(isinstance(r, GroupInfo) for r in o)]
    assert len(formed) == ROUNDS, outcomes
    assert all(set(r.members) == honest for o in formed for r in o if isinstance(r, GroupInfo))
    assert [b.offences.get(silent, 0) for b in bans[:2]] == [ROUNDS] * 2  # reported each time
    assert not any(b.banned(silent) for b in bans[:2])  # ... counted once


def test_a_late_leader_that_counts_more_live_nodes_than_its_follower_is_not_charged() -> None:
    """Each node counts the nodes a round waits for on its own evidence (node/evidence/claims.py
    ``group_target``), so a leader can wait for more than its follower counts. Here both
    announced the round ahead for 0.1 s later and reach their send step 1.2 s later (a
    training thread blocked meanwhile). The leader counts a fourth node that never comes, so
    it waits out its window from its send step, then a join timeout for a third peer that
    declared and never JOINs: its GROUP comes 1.5 s after the send step. Its follower counts
    two (both declared long ago), so by its own count the leader chose its role at once, and
    the leader's announcement promised that 1.1 s before; but the follower knows four live
    records (``live_nodes``), so the leader may be waiting for them: the GROUP is due a
    window after the follower's own choice and two join timeouts (2.0 s after the send step).
    Counting only its own two, the follower charged the honest leader at 1.0 s."""
    timeouts = RoundTimeouts(matchmaking_window=1.0, join_timeout=0.5)
    network, table = MemoryNetwork(), Table()
    identities = [make_identity(60 + i) for i in range(3)]
    bans = [CountingBans(Clock()) for _ in identities[:2]]
    leader, follower = (
        Matchmaker(
            network.join(PeerID.from_base58(identity.peer_id)),
            MemoryDHT(identity, table),
            RUN_ID,
            DIGEST,
            timeouts,
            ban_list,
            target_group_size=target,
        )
        for identity, ban_list, target in zip(identities, bans, (4, 2), strict=False)
    )
    follower.live_nodes = 4
    ids = [PeerID.from_base58(identity.peer_id) for identity in identities]
    keys = (RoundKey(3, k) for k in range(1, 10_000))
    key = next(
        k for k in keys if min(ids, key=lambda p: leader_rank(round_key(RUN_ID, k), p)) == ids[0]
    )

    async def main() -> list[GroupInfo | BaseException]:
        silent = MemoryDHT(identities[2], table)
        await declare_round(silent, round_key(RUN_ID, key), 1.0, 1e12)
        for peer in (leader, follower):
            await peer.start()
            peer.open_ahead(key, peer.join_request(key, 1000, 0, 0, 1.0, False), "", True, 0.1)
        while not all(len(p._lobbies[key].arrived) >= 3 for p in (leader, follower)):
            await asyncio.sleep(0.01)
        await asyncio.sleep(1.2)  # both blocked on another round: late for the announcement
        tasks = [peer.form_group(key, 1000, 0, 0, 1.0) for peer in (leader, follower)]
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        network.close()
        return outcomes

    outcomes = asyncio.run(main())
    assert all(isinstance(r, GroupInfo) for r in outcomes), outcomes
    assert all(set(r.members) == set(ids[:2]) for r in outcomes if isinstance(r, GroupInfo))
    assert not bans[1].offences, bans[1].offences


def test_one_round_in_four_waits_for_every_live_record() -> None:
    """A leader waits for the nodes it saw work (``target_group_size``), but in the rounds
    whose fragment plus round is a multiple of four for every live record's author
    (``live_nodes``): there a late newcomer gets its first round. Without a record count it
    waits for its target in every round."""
    identity = make_identity(70)
    peer = Matchmaker(
        MemoryNetwork().join(PeerID.from_base58(identity.peer_id)),
        MemoryDHT(identity, Table()),
        RUN_ID,
        DIGEST,
        TIMEOUTS,
        BanList(),
        target_group_size=2,
    )

    def targets() -> dict[tuple[int, int], int | None]:
        return {
            (p, k): peer.wait_target(Lobby(Join(RoundTag(DIGEST, p, k), 1000, 0, 0, 1.0), "key"))
            for p in range(5)
            for k in range(1, 9)
        }

    peer.live_nodes = 6
    waits = targets()
    assert [key for key, target in waits.items() if target == 6] == [
        (0, 4), (0, 8), (1, 3), (1, 7), (2, 2), (2, 6), (3, 1), (3, 5), (4, 4), (4, 8)
    ]  # fmt: skip
    assert {target for target in waits.values()} == {2, 6}
    peer.live_nodes = None
    assert set(targets().values()) == {2}
