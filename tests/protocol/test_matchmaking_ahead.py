"""Matchmaking started before the send step (``ahead``), in one process (``Matchmaker``
over ``memory_p2p`` streams and a DHT held in a dict): a round announced ahead declares
and reads while the node trains, so at the send step the round's path is JOIN -> GROUP
alone; a JOIN that comes before the leader's own send step waits for it instead of being
told UNKNOWN_ROUND; a prior that changed meanwhile declares again, replacing the stale
declaration; a lobby never claimed closes."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from hivemind.p2p import PeerID
from memory_dht import MemoryDHT, Table
from memory_p2p import MemoryNetwork, make_identity

from diloco.errors import RoundFailed
from diloco.protocol.core.group import GroupInfo, RoundTimeouts
from diloco.protocol.core.reducer import RoundKey
from diloco.protocol.matchmaking.lobby import leader_rank, round_key
from diloco.protocol.matchmaking.matchmaker import Matchmaker
from diloco.protocol.records.declarations import declare_round, prior_tag, read_round_view
from diloco.protocol.runtime.round_trips import counting
from diloco.protocol.trust.bans import BanList
from diloco.protocol.trust.identity import Identity
from diloco.protocol.wire.frames import Kind, Reject, RejectCode

pytestmark = pytest.mark.clocked

RUN_ID = "ahead-0123456789abcdef"
DIGEST = bytes(range(16))
KEY = RoundKey(2, 5)
DHT_KEY = round_key(RUN_ID, KEY)
TIMEOUTS = RoundTimeouts(matchmaking_window=30.0, join_timeout=5.0)
PRIOR = "a" * 64
NUMEL = 1000


def _ranked(first: int, count: int) -> list[Identity]:
    """``count`` identities, the first to lead the round first."""
    identities = [make_identity(first + i) for i in range(count)]
    return sorted(identities, key=lambda i: leader_rank(DHT_KEY, PeerID.from_base58(i.peer_id)))


def _peers(first: int, count: int, timeouts: RoundTimeouts = TIMEOUTS) -> list[Matchmaker]:
    network, table = MemoryNetwork(), Table()
    peers = []
    for identity in _ranked(first, count):
        p2p = network.join(PeerID.from_base58(identity.peer_id))
        dht = MemoryDHT(identity, table)
        peers.append(Matchmaker(p2p, dht, RUN_ID, DIGEST, timeouts, BanList(), 2, count))
    return peers


def _open(peer: Matchmaker, prior: str = PRIOR, lead: float = 10.0) -> None:
    request = peer.join_request(KEY, NUMEL, 0, 0, 1.0, False)
    peer.open_ahead(KEY, request, prior, True, lead)


async def _until_read(peers: list[Matchmaker], declared: int) -> None:
    """Until every peer's reads ahead found ``declared`` peers of the round."""
    while not all(KEY in p._lobbies and len(p._lobbies[KEY].arrived) >= declared for p in peers):
        await asyncio.sleep(0.01)


async def _form(peer: Matchmaker, prior: str = PRIOR) -> tuple[GroupInfo, list[str]]:
    with counting() as trips:
        group = await peer.form_group(KEY, NUMEL, 0, 0, 1.0, prior)
    return group, [kind for kind, _ in trips.critical_path()]


async def _follow_then_lead(
    leader: Matchmaker, follower: Matchmaker, later: float
) -> tuple[GroupInfo, GroupInfo]:
    """The follower reaches its send step first, the leader ``later`` seconds after it (the
    follower still waiting then): both groups."""
    following = asyncio.create_task(follower.form_group(KEY, NUMEL, 0, 0, 1.0, PRIOR))
    await asyncio.sleep(later)
    assert not following.done()
    return await leader.form_group(KEY, NUMEL, 0, 0, 1.0, PRIOR), await following


def test_announced_ahead_the_send_step_needs_only_the_join() -> None:
    """Three peers announce the round, declare and read while they 'train'; at the send
    step the leader counts no exchange and each follower one, its JOIN -> GROUP (before:
    declare, read, then JOIN)."""
    peers = _peers(0, 3)

    async def main() -> list[tuple[GroupInfo, list[str]]]:
        for peer in peers:
            await peer.start()
            _open(peer)
        await _until_read(peers, 3)
        return list(await asyncio.gather(*(_form(peer) for peer in peers)))

    (led, leader_path), *followed = asyncio.run(main())
    ids = {peer.p2p.peer_id for peer in peers}
    assert set(led.members) == ids
    assert leader_path == []
    for group, path in followed:
        assert group.group_id == led.group_id and set(group.members) == ids
        assert path == ["join"], path


def test_a_join_before_the_leaders_send_step_waits_for_it() -> None:
    """The follower reaches its send step first and JOINs the leader, which announced the
    round but is still training: the JOIN waits in the leader's lobby and gets the GROUP
    once the leader reaches its send step. Before, the leader had no lobby yet and refused
    it (UNKNOWN_ROUND): both missed the round."""
    leader, follower = _peers(10, 2)

    async def main() -> tuple[GroupInfo, GroupInfo]:
        for peer in (leader, follower):
            await peer.start()
            _open(peer)
        await _until_read([leader, follower], 2)
        following = asyncio.create_task(follower.form_group(KEY, NUMEL, 0, 0, 1.0, PRIOR))
        while not leader._lobbies[KEY].knockers:  # the JOIN arrived and waits
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        assert not following.done()
        return await leader.form_group(KEY, NUMEL, 0, 0, 1.0, PRIOR), await following

    led, followed = asyncio.run(main())
    assert led.group_id == followed.group_id
    assert set(led.members) == {leader.p2p.peer_id, follower.p2p.peer_id}


def test_a_prior_changed_since_the_announcement_declares_again() -> None:
    """A node announced the round from one state, then healed: at the send step it drops
    the lobby, declares its new prior (the stale record replaced: a later expiration) and
    forms a group with the peer of that prior."""
    healed, other = _peers(20, 2)
    new_prior = "b" * 64

    async def main() -> tuple[GroupInfo, list[str], GroupInfo]:
        await healed.start()
        await other.start()
        _open(healed, PRIOR)
        while healed._lobbies[KEY].declared_at is None:
            await asyncio.sleep(0.01)
        (mine, path), theirs = await asyncio.gather(
            _form(healed, new_prior), other.form_group(KEY, NUMEL, 0, 0, 1.0, new_prior)
        )
        return mine, path, theirs

    mine, path, theirs = asyncio.run(main())
    assert path[0] == "declare", path
    assert mine.group_id == theirs.group_id
    assert set(mine.members) == {healed.p2p.peer_id, other.p2p.peer_id}
    view = asyncio.run(read_round_view(healed.dht, DHT_KEY))
    assert view[healed.p2p.peer_id].prior == prior_tag(new_prior)


def test_a_lobby_never_claimed_closes_and_its_waiting_join_is_told() -> None:
    """A node announced the round and never reached its send step (stopped): a JOIN waiting
    there is told GROUP_CLOSED once the round could no longer form, and the lobby goes."""
    short = RoundTimeouts(matchmaking_window=0.1, join_timeout=0.1, connect_timeout=1.0)
    gone, asking = _peers(30, 2, short)

    async def main() -> tuple[Kind, bytes]:
        await gone.start()
        await asking.start()
        _open(gone, lead=0.0)
        while gone._lobbies[KEY].declared_at is None:
            await asyncio.sleep(0.01)
        await declare_round(asking.dht, DHT_KEY, 1.0, 1e12, prior=PRIOR)
        request = asking.join_request(KEY, NUMEL, 0, 0, 1.0, False)
        return await asking._call_join(gone.p2p.peer_id, request)

    kind, body = asyncio.run(main())
    assert kind == Kind.REJECT
    assert Reject.parse(body).code == RejectCode.GROUP_CLOSED
    assert KEY not in gone._lobbies


def test_a_peer_that_announced_nothing_still_has_the_window_from_the_send_step() -> None:
    """Two of three peers announced the round long ago (more than a window before their send
    step); the third declares only at its own send step, a moment after theirs. The two
    wait for it a window from their send step, as when declaring there: one group of
    three. Counting the window from their early declaration, they would have formed a
    group of two at once and refused the third (GROUP_CLOSED)."""
    short = RoundTimeouts(matchmaking_window=0.5, join_timeout=0.5)
    *early, late = _peers(40, 3, short)

    async def main() -> list[GroupInfo]:
        for peer in (*early, late):
            await peer.start()
        for peer in early:
            _open(peer)
        await _until_read(early, 2)
        await asyncio.sleep(short.matchmaking_window * 1.2)  # training meanwhile
        forming = [asyncio.create_task(_form(peer)) for peer in early]
        await asyncio.sleep(0.1)
        group = await late.form_group(KEY, NUMEL, 0, 0, 1.0, PRIOR)
        return [group, *[(await task)[0] for task in forming]]

    groups = asyncio.run(main())
    ids = {peer.p2p.peer_id for peer in (*early, late)}
    assert all(set(g.members) == ids for g in groups), groups


def test_a_leader_still_training_toward_its_send_step_is_not_charged_as_silent() -> None:
    """The follower JOINs a leader that announced the round ahead (with 10 s to go) and
    reaches its send step 1.7 s later, past the due time a leader that declared at its send
    step has (a window and two join timeouts: 1.5 s) but within the follower's matchmaking
    bound (2 s). The follower waits: one group, no offence. Before, it charged the honest
    leader as silent (three such rounds banned it, as a 200 ms swarm showed at start-up) and
    failed over."""
    timeouts = RoundTimeouts(matchmaking_window=0.5, join_timeout=0.5)
    leader, follower = _peers(50, 2, timeouts)

    async def main() -> tuple[GroupInfo, GroupInfo]:
        for peer in (leader, follower):
            await peer.start()
            _open(peer, lead=10.0)
        await _until_read([leader, follower], 2)
        return await _follow_then_lead(leader, follower, 1.7)

    led, followed = asyncio.run(main())
    assert led.group_id == followed.group_id
    assert not follower.bans.banned(leader.p2p.peer_id)
    assert leader.p2p.peer_id not in follower.bans._peers  # no offence recorded


def test_announced_again_with_a_healed_prior_the_send_step_still_needs_only_the_join() -> None:
    """A node announced the round, healed, and announced it again with its new prior
    before the send step: its new declaration replaces the old one ahead of time, so at the
    send step it joins its peer of that prior with one exchange. Before, it dropped the
    lobby at the send step and declared then: late for a leader that closed at once."""
    healed, other = _peers(60, 2)
    new_prior = "c" * 64

    async def main() -> list[tuple[GroupInfo, list[str]]]:
        await healed.start()
        await other.start()
        _open(healed, PRIOR)
        while healed._lobbies[KEY].declared_at is None:
            await asyncio.sleep(0.01)
        _open(healed, new_prior)
        _open(other, new_prior)
        await _until_read([healed, other], 2)

        async def seen() -> None:  # the other read the healed node's new prior
            while healed.p2p.peer_id not in other._lobbies[KEY].seen:
                await asyncio.sleep(0.01)

        await asyncio.wait_for(seen(), 5.0)
        return list(await asyncio.gather(_form(healed, new_prior), _form(other, new_prior)))

    (mine, my_path), (theirs, their_path) = asyncio.run(main())
    assert mine.group_id == theirs.group_id
    assert sorted([my_path, their_path]) == [[], ["join"]]
    view = asyncio.run(read_round_view(healed.dht, DHT_KEY))
    assert view[healed.p2p.peer_id].prior == prior_tag(new_prior)


def test_a_join_from_a_peer_whose_read_prior_is_stale_is_read_again() -> None:
    """The leader read a peer's declaration of another prior ahead of the send step; the
    peer healed and declared anew, and JOINs: the leader reads the round again and takes
    it. Before, it refused it (MISMATCH) on the stale record, round after round."""
    leader, healed = _peers(70, 2)

    async def main() -> tuple[GroupInfo, GroupInfo]:
        for peer in (leader, healed):
            await peer.start()
        await declare_round(healed.dht, DHT_KEY, 1.0, 1e11, prior="d" * 64)  # before healing
        _open(leader)
        await _until_read([leader], 2)
        assert leader._lobbies[KEY].declared[healed.p2p.peer_id] == prior_tag("d" * 64)
        await declare_round(healed.dht, DHT_KEY, 1.0, 1e12, prior=PRIOR)  # healed
        following = asyncio.create_task(healed.form_group(KEY, NUMEL, 0, 0, 1.0, PRIOR))

        async def knocked() -> None:  # its JOIN passed the leader's prior check
            while healed.p2p.peer_id not in leader._lobbies[KEY].knockers:
                await asyncio.sleep(0.01)

        await asyncio.wait_for(knocked(), 5.0)
        return await leader.form_group(KEY, NUMEL, 0, 0, 1.0, PRIOR), await following

    led, followed = asyncio.run(main())
    assert led.group_id == followed.group_id


class _LandsButNeverAnswers(MemoryDHT):
    """Stores, then never answers: a declaration that timed out here but landed (a DHT
    process starved of CPU)."""

    hang = True

    async def store(self, *args: Any, **kwargs: Any) -> bool:
        stored = await super().store(*args, **kwargs)
        while self.hang:
            await asyncio.sleep(0.01)
        return stored


def test_a_declaration_that_timed_out_but_landed_is_still_replaced_after_a_heal() -> None:
    """A node's declaration ahead timed out here but landed, with a far expiration; the
    node healed and announced the round again, closer to its send step: its new
    declaration must expire later than the landed one, or the DHT keeps the stale prior and
    the round's leader refuses the node's JOIN (MISMATCH), round after round. Before, the
    new expiration only had to pass the previous one the node knew of (none: it timed
    out)."""
    timeouts = RoundTimeouts(matchmaking_window=30.0, join_timeout=0.3)
    identity, table = make_identity(90), Table()
    p2p = MemoryNetwork().join(PeerID.from_base58(identity.peer_id))
    dht = _LandsButNeverAnswers(identity, table)
    healed = Matchmaker(p2p, dht, RUN_ID, DIGEST, timeouts, BanList(), 2, 2)
    new_prior = "d" * 64

    async def main() -> None:
        await healed.start()
        _open(healed, PRIOR, lead=20.0)
        lobby = healed._lobbies[KEY]
        assert lobby.ahead is not None
        await lobby.ahead  # timed out here
        assert lobby.declared_at is None
        dht.hang = False
        _open(healed, new_prior, lead=1.0)
        while healed._lobbies[KEY].declared_at is None:
            await asyncio.sleep(0.01)

    asyncio.run(main())
    view = asyncio.run(read_round_view(dht, DHT_KEY))
    assert view[healed.p2p.peer_id].prior == prior_tag(new_prior)


def test_a_leader_that_has_not_opened_the_round_yet_is_asked_again() -> None:
    """The leader announced the round and came later than it said: its lobby opened ahead
    was dropped (lead 0), so the follower's JOIN finds no lobby there (UNKNOWN_ROUND). The
    leader reaches its send step 0.6 s later, within the follower's matchmaking bound: the
    follower asked again and both are in one group. Before, the follower failed at the
    first refusal and the leader led alone (a 6-node run at 300 ms lost a fragment's first
    round for every node this way)."""
    timeouts = RoundTimeouts(matchmaking_window=0.3, join_timeout=0.5)
    leader, follower = _peers(70, 2, timeouts)

    async def main() -> tuple[GroupInfo, GroupInfo]:
        for peer in (leader, follower):
            await peer.start()
        _open(leader, lead=0.0)
        while leader._lobbies[KEY].declared_at is None:
            await asyncio.sleep(0.01)
        leader._drop_unclaimed(KEY, leader._lobbies[KEY])  # as at lead + matchmaking
        return await _follow_then_lead(leader, follower, 0.6)

    led, followed = asyncio.run(main())
    assert led.group_id == followed.group_id
    assert set(led.members) == {leader.p2p.peer_id, follower.p2p.peer_id}


def test_a_join_after_the_leader_failed_the_round_is_told_the_round_ended() -> None:
    """The leader's round failed (nobody came in its window) and its matchmaking ended; a
    JOIN after that is told GROUP_CLOSED, so the late follower does not wait out its bound
    asking again as it would a leader that has not reached the round yet."""
    short = RoundTimeouts(matchmaking_window=0.1, join_timeout=0.1, connect_timeout=1.0)
    alone, late = _peers(80, 2, short)

    async def main() -> tuple[Kind, bytes]:
        await alone.start()
        await late.start()
        with pytest.raises(RoundFailed, match="no group: 1 member"):
            await alone.form_group(KEY, NUMEL, 0, 0, 1.0, PRIOR)
        request = late.join_request(KEY, NUMEL, 0, 0, 1.0, False)
        return await late._call_join(alone.p2p.peer_id, request)

    kind, body = asyncio.run(main())
    assert kind == Kind.REJECT
    assert Reject.parse(body).code == RejectCode.GROUP_CLOSED, Reject.parse(body)


def test_a_leader_that_skipped_its_send_step_sends_its_followers_to_the_next_in_line() -> None:
    """The first in line announced the round, then skipped its send step (it caught up with
    the swarm's step). The two others, already waiting for it, are told LEFT_ROUND and
    form the round without it; a JOIN that comes later is told so too. Before, they waited
    until its lobby closed (GROUP_CLOSED) and both failed the round (6 nodes at 200 ms)."""
    short = RoundTimeouts(matchmaking_window=0.5, join_timeout=0.25, connect_timeout=1.0)
    skipper, *others = _peers(60, 3, short)

    async def main() -> tuple[list[GroupInfo | BaseException], tuple[Kind, bytes]]:
        for peer in (skipper, *others):
            await peer.start()
            _open(peer, lead=2.0 if peer is skipper else 0.0)
        await _until_read([skipper, *others], 3)
        forming = [asyncio.create_task(p.form_group(KEY, NUMEL, 0, 0, 1.0, PRIOR)) for p in others]
        await asyncio.sleep(0.3)  # both JOINed the skipper and wait there
        assert not any(task.done() for task in forming)
        skipper.forgo(KEY)
        groups = await asyncio.gather(*forming, return_exceptions=True)
        request = others[0].join_request(KEY, NUMEL, 0, 0, 1.0, False)
        return groups, await others[0]._call_join(skipper.p2p.peer_id, request)

    groups, (kind, body) = asyncio.run(main())
    assert all(isinstance(g, GroupInfo) for g in groups), groups
    members = {p.p2p.peer_id for p in others}
    assert all(set(g.members) == members for g in groups if isinstance(g, GroupInfo))
    assert len({g.group_id for g in groups if isinstance(g, GroupInfo)}) == 1
    assert kind == Kind.REJECT and Reject.parse(body).code == RejectCode.LEFT_ROUND
    assert KEY not in skipper._lobbies
