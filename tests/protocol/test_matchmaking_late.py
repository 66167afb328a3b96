"""Nodes out of step: a peer whose send steps come later than this node's window (a joiner
starts behind by its state transfer) JOINs rounds this node has ended. That JOIN is the
evidence; this node then waits the widest window, the peer arrives within it and both are
in one group (docs/design.md "The round"). In one process, ``Matchmaker`` over
``memory_p2p`` streams and a DHT held in a dict, as the reducer drives it: each round's
timeouts from ``RoundBudget.of``."""

from __future__ import annotations

import asyncio
import logging

import pytest
import torch
from hivemind.p2p import PeerID
from memory_dht import MemoryDHT, Table
from memory_p2p import MemoryNetwork, make_identity

from diloco.codecs import get_codec
from diloco.errors import RoundFailed
from diloco.protocol.core.budget import RoundBudget
from diloco.protocol.core.group import GroupInfo, RoundTimeouts
from diloco.protocol.core.reducer import Contribution, RoundKey
from diloco.protocol.matchmaking.late import LATE_MEMORY, MAX_LATE, LatePeers
from diloco.protocol.matchmaking.lobby import leader_rank, round_key
from diloco.protocol.matchmaking.matchmaker import Matchmaker
from diloco.protocol.runtime.network import NetworkOptions
from diloco.protocol.swarm import Swarm
from diloco.protocol.swarm_reducer import SwarmReducer
from diloco.protocol.trust.bans import BanList
from diloco.protocol.wire.run_id import make_run_id

pytestmark = pytest.mark.clocked

RUN_ID = "late-0123456789abcdef"
DIGEST = bytes(range(16))
TIMEOUTS = RoundTimeouts(matchmaking_window=0.5, join_timeout=0.5)
OFFSET_S = 0.9
"""How much later than the early node the late one reaches each send step: more than a
window and a join (0.5 s each), less than the widest window (4 x 0.5 s)."""
PRIOR = "a" * 64
NUMEL = 1000
FIRST, MEET, AGAIN = RoundKey(3, 1), RoundKey(3, 2), RoundKey(3, 3)


def peer(n: int) -> PeerID:
    return PeerID.from_base58(make_identity(n).peer_id)


def test_a_join_after_the_round_ended_marks_the_peer_late_until_a_group_with_it() -> None:
    late = LatePeers()
    a, b = peer(1), peer(2)
    assert not late.came(a, FIRST, 0.0)  # a round this node has not reached: no evidence
    assert not late.out_of_step(0.0)
    late.ended(FIRST)
    assert not late.came(a, MEET, 1.0)  # the next round, not reached here yet
    assert late.came(a, FIRST, 1.0)
    assert late.out_of_step(1.0) and late.out_of_step(1.0 + LATE_MEMORY)
    assert not late.out_of_step(1.1 + LATE_MEMORY)  # forgotten: it may have left
    late.met([b])
    assert late.out_of_step(2.0)
    late.met([a, b])
    assert not late.out_of_step(2.0)


def test_a_round_led_alone_while_counting_a_peer_is_out_of_step() -> None:
    late = LatePeers()
    late.alone(counted=0, now=0.0)  # no peer it saw work, nor the creator: no evidence
    assert not late.out_of_step(0.0)
    late.alone(counted=1, now=1.0)  # a joiner's creator is live and was not in the round
    assert late.out_of_step(1.0) and not late.out_of_step(1.1 + LATE_MEMORY)
    late.met([peer(1)])  # any group formed: in step again
    assert not late.out_of_step(1.0)


def test_rounds_led_alone_by_a_node_behind_the_swarm_are_no_evidence_late_joins_are() -> None:
    late = LatePeers()
    late.alone(counted=1, now=1.0)
    assert late.out_of_step(1.0)
    late.set_behind(True)  # the peers it counts are past its step: those rounds were late
    assert not late.out_of_step(1.0)
    late.alone(counted=1, now=2.0)  # still behind: no evidence either
    assert not late.out_of_step(2.0)
    late.set_behind(False)
    late.alone(counted=1, now=3.0)  # in step again by the records: evidence again
    assert late.out_of_step(3.0)
    late.ended(FIRST)
    assert late.came(peer(3), FIRST, 4.0)
    late.set_behind(True)  # a JOIN after the round ended is not undone
    assert late.out_of_step(4.0)


def test_a_peer_that_took_the_state_is_out_of_step_until_a_group_with_it() -> None:
    late = LatePeers()
    a = peer(1)
    assert not late.out_of_step(10.0)
    late.took_state(a, 10.0)
    assert late.out_of_step(10.0) and late.out_of_step(10.0 + LATE_MEMORY)
    assert not late.out_of_step(10.1 + LATE_MEMORY)  # forgotten: it may have left
    late.took_state(a, 20.0 + LATE_MEMORY)
    late.met([a])
    assert not late.out_of_step(20.0 + LATE_MEMORY)


def test_a_state_taker_that_never_comes_widens_one_cycle_of_rounds_once_a_minute() -> None:
    """A peer that downloads the state again and again and never works in a round (a forger
    did, 52 times in one run) keeps this node on the widest window for one cycle of rounds
    (``TAKER_ROUNDS`` of one fragment), not for the run."""
    late = LatePeers()
    forger, joiner = peer(1), peer(2)
    late.took_state(forger, 0.0)
    for fragment in range(3):  # one round of each fragment: not a cycle yet
        late.ended(RoundKey(fragment, 1))
        assert late.out_of_step(1.0)
    late.ended(RoundKey(0, 1))  # the same round again is no round more
    assert late.out_of_step(1.0)
    late.ended(RoundKey(0, 2))
    assert not late.out_of_step(1.0)
    for when in (2.0, 30.0, LATE_MEMORY):  # its next downloads within a minute: nothing
        late.took_state(forger, when)
        assert not late.out_of_step(when)
    late.took_state(joiner, 40.0)  # another peer still counts
    assert late.out_of_step(40.0)
    late.met([joiner])
    assert not late.out_of_step(40.0)
    late.took_state(forger, 0.1 + LATE_MEMORY)  # a minute later it may be a joiner again
    assert late.out_of_step(0.1 + LATE_MEMORY)
    late.met([forger])  # a group with it: its next download counts at once
    late.took_state(forger, 1.0 + LATE_MEMORY)
    assert late.out_of_step(1.0 + LATE_MEMORY)


def test_late_peers_kept_are_bounded_and_the_oldest_go_first() -> None:
    late = LatePeers()
    late.ended(FIRST)
    peers = [peer(10 + i) for i in range(MAX_LATE + 1)]
    for i, p in enumerate(peers):
        late.came(p, FIRST, float(i))
    late.met(peers[1:])
    assert not late.out_of_step(float(MAX_LATE))  # the first was dropped to keep the bound


def test_out_of_step_budget_waits_the_widest_window_and_joins() -> None:
    configured = RoundTimeouts(matchmaking_window=2.0, join_timeout=1.5)
    assert RoundBudget.of(configured).matching.matchmaking_window == 2.0
    wide = RoundBudget.of(configured, rtt=0.01, out_of_step=True).matching
    assert (wide.matchmaking_window, wide.join_timeout) == (8.0, 6.0)
    assert RoundBudget.of(configured, out_of_step=True).join_stream() >= wide.matchmaking


def _pair(early_leads_meet: bool) -> tuple[Matchmaker, Matchmaker]:
    """(early, late): the early node leads the first round (the late one JOINs it after it
    ended there), and leads the meeting round or not."""
    for n in range(0, 400, 2):
        ids = [PeerID.from_base58(make_identity(n + i).peer_id) for i in range(2)]

        def first(key: RoundKey, ids: list[PeerID] = ids) -> PeerID:
            ranks = {leader_rank(round_key(RUN_ID, key), member): member for member in ids}
            return ranks[min(ranks)]

        early = first(FIRST)
        if (first(MEET) == early) == early_leads_meet:
            network, table = MemoryNetwork(), Table()
            made = {}
            for i, p in enumerate(ids):
                dht = MemoryDHT(make_identity(n + i), table)
                made[p] = Matchmaker(
                    network.join(p), dht, RUN_ID, DIGEST, TIMEOUTS, BanList(), 2, 2
                )
            return made[early], made[next(p for p in ids if p != early)]
    raise AssertionError("no pair of identities found")


def _trio() -> tuple[Matchmaker, list[Matchmaker]]:
    """(early, two late ones), each counting all three as peers it saw work (target 3): the
    early node is not first in line for the first round, so the late ones form that round
    without it and never JOIN it late."""
    for n in range(0, 600, 3):
        ids = [PeerID.from_base58(make_identity(n + i).peer_id) for i in range(3)]
        ranks = {leader_rank(round_key(RUN_ID, FIRST), member): member for member in ids}
        if ranks[min(ranks)] != ids[0]:
            network, table = MemoryNetwork(), Table()
            made = []
            for i, member in enumerate(ids):
                dht = MemoryDHT(make_identity(n + i), table)
                p2p = network.join(member)
                made.append(Matchmaker(p2p, dht, RUN_ID, DIGEST, TIMEOUTS, BanList(), 2, 3))
            return made[0], made[1:]
    raise AssertionError("no trio of identities found")


def test_an_early_node_that_led_alone_waits_for_the_peers_it_counts() -> None:
    """The mirror of a late JOIN: the early node's first round finds none of the two peers it
    counts (they come after its window and form the round without it), so its next round
    waits the widest window, and all three are in it."""
    early, later = _trio()

    async def main() -> list[list[GroupInfo | RoundFailed]]:
        for node in (early, *later):
            await node.start()
        outcomes = []
        for key in (FIRST, MEET, AGAIN):
            rounds = [_round(early, key, 0.0), *(_round(node, key, OFFSET_S) for node in later)]
            outcomes.append(list(await asyncio.gather(*rounds)))
        return outcomes

    first, met, again = asyncio.run(main())
    assert isinstance(first[0], RoundFailed) and "no group: 1 member" in first[0].reason
    assert all(isinstance(g, GroupInfo) and len(g.members) == 2 for g in first[1:]), first
    assert all(isinstance(g, GroupInfo) for g in met), met
    assert len({g.group_id for g in met if isinstance(g, GroupInfo)}) == 1
    assert isinstance(again[0], RoundFailed), again  # in step again: the usual window misses


async def _round(node: Matchmaker, key: RoundKey, delay: float) -> GroupInfo | RoundFailed:
    """One round as the reducer runs it: the timeouts from the node's budget, then
    matchmaking, ``delay`` seconds after the other node's."""
    await asyncio.sleep(delay)
    now = asyncio.get_running_loop().time()
    node.timeouts = RoundBudget.of(TIMEOUTS, out_of_step=node.late.out_of_step(now)).matching
    try:
        return await node.form_group(key, NUMEL, 0, 0, 1.0, PRIOR)
    except RoundFailed as failed:
        return failed


@pytest.mark.parametrize("early_leads_meet", [True, False])
def test_a_late_peer_is_waited_for_after_its_join_came_late(early_leads_meet: bool) -> None:
    early, late = _pair(early_leads_meet)

    async def main() -> list[tuple[GroupInfo | RoundFailed, GroupInfo | RoundFailed]]:
        await early.start()
        await late.start()
        outcomes = []
        for key in (FIRST, MEET, AGAIN):
            both = await asyncio.gather(_round(early, key, 0.0), _round(late, key, OFFSET_S))
            outcomes.append((both[0], both[1]))
        return outcomes

    (first_early, first_late), (met_early, met_late), (again_early, _) = asyncio.run(main())
    # The first round: the early node waited its window in vain; the late one JOINed it
    # after it had ended there.
    assert isinstance(first_early, RoundFailed) and isinstance(first_late, RoundFailed)
    assert "refused" in first_late.reason, first_late.reason
    # Then: the early node waited the widest window and both are in one group.
    assert isinstance(met_early, GroupInfo), met_early
    assert isinstance(met_late, GroupInfo), met_late
    assert met_early.group_id == met_late.group_id
    assert set(met_early.members) == {early.p2p.peer_id, late.p2p.peer_id}
    # In step again, the early node waits its usual window: the same offset misses it,
    # which is what the wider window made up for.
    assert isinstance(again_early, RoundFailed), again_early


@pytest.mark.swarm
def test_a_reducer_out_of_step_waits_the_widest_window_and_tells_tau_the_usual_one() -> None:
    """The wiring, on a real swarm: a fragment's last round of the run, and the reducer's
    round after a late JOIN, run on the widest window, while ``peers_window`` (what tau auto
    and the hold before a send go by: the window the peers give this node) stays the usual
    one."""
    swarm = Swarm(make_run_id("late", {}), NetworkOptions(host_maddrs=("/ip4/127.0.0.1/tcp/0",)))
    reducer = SwarmReducer(swarm, get_codec("none"), timeouts=TIMEOUTS)
    me = swarm.peer_id.to_base58()
    delta = torch.zeros(NUMEL)
    try:
        with pytest.raises(RoundFailed):  # alone, counting no peer: no group
            reducer.reduce(FIRST, [Contribution(me, delta, 1.0, last=True)]).result(60)
        assert reducer.matchmaker.timeouts.matchmaking_window == TIMEOUTS.matchmaking_window
        # the run's last round of a fragment: a member that misses it heals at the run's end
        # only, so the widest window, once the node counts a peer (alone, as above, it would
        # wait for nobody)
        reducer.set_target_group_size(2, 2, 1)
        with pytest.raises(RoundFailed):
            reducer.reduce(MEET, [Contribution(me, delta, 1.0, last=True)]).result(60)
        assert reducer.matchmaker.timeouts.matchmaking_window == 4 * TIMEOUTS.matchmaking_window

        async def late_join() -> bool:
            now = asyncio.get_running_loop().time()
            return reducer.matchmaker.late.came(peer(7), FIRST, now)

        assert swarm.call(late_join())
        with pytest.raises(RoundFailed):
            reducer.reduce(AGAIN, [Contribution(me, delta, 1.0)]).result(60)
        assert reducer.matchmaker.timeouts.matchmaking_window == 4 * TIMEOUTS.matchmaking_window
        assert reducer.peers_window(None) == TIMEOUTS.matchmaking_window
    finally:
        reducer.close()
        swarm.shutdown()


def _leader_and_follower(timeouts: RoundTimeouts) -> tuple[Matchmaker, Matchmaker]:
    """Two matchmakers that each wait for 3 declarations (the third never comes): the first
    in line to lead round ``FIRST``, and the other."""
    network, table = MemoryNetwork(), Table()
    ids = [PeerID.from_base58(make_identity(n).peer_id) for n in range(2)]
    made = {
        member: Matchmaker(
            network.join(member), MemoryDHT(make_identity(n), table), RUN_ID, DIGEST,
            timeouts, BanList(), 2, 3,
        )
        for n, member in enumerate(ids)
    }  # fmt: skip
    ranks = {leader_rank(round_key(RUN_ID, FIRST), member): member for member in ids}
    return made[ranks[min(ranks)]], made[ranks[max(ranks)]]


async def _first(node: Matchmaker) -> GroupInfo | RoundFailed:
    """``node``'s group of round ``FIRST`` on its own timeouts, or why it has none."""
    try:
        return await node.form_group(FIRST, NUMEL, 0, 0, 1.0, PRIOR)
    except RoundFailed as failed:
        return failed


def test_a_join_to_a_round_on_the_widest_window_outlasts_a_narrower_next_round() -> None:
    """A leader out of step waits the widest window for a peer it counts (target 3, the
    third never comes); meanwhile its next round narrows the matchmaker's budget, as the
    reducer sets it per round. The JOIN that came early still gets the GROUP: cut at the
    narrower budget, it was counted as a member whose reply could no longer be sent."""
    timeouts = RoundTimeouts(matchmaking_window=0.5, join_timeout=0.05)
    leader, follower = _leader_and_follower(timeouts)
    wide = RoundBudget.of(timeouts, out_of_step=True).matching
    narrow = RoundBudget.of(timeouts).matching
    assert narrow.matchmaking < wide.matchmaking_window  # the JOIN outlives the narrow one

    async def main() -> list[GroupInfo | RoundFailed]:
        for node in (leader, follower):
            await node.start()
            node.timeouts = wide

        led = asyncio.create_task(_first(leader))
        await asyncio.sleep(0.1)  # its window is running, the wide one
        leader.timeouts = narrow  # its next round's budget
        await asyncio.sleep(0.1)
        return [await _first(follower), await led]  # the JOIN comes on the narrow budget

    followed, led = asyncio.run(main())
    assert isinstance(led, GroupInfo) and isinstance(followed, GroupInfo), (led, followed)
    assert led.group_id == followed.group_id and len(led.members) == 2


def test_a_follower_on_the_usual_window_waits_for_a_leader_on_the_widest_one() -> None:
    """The leader is out of step (a late JOIN: the widest window) and waits it out for a peer
    it counts (target 3, the third never comes); its follower is in step (the usual window),
    so its own matchmaking bound ends first. It waits up to the bound the leader declared
    and is in the group: leaving at its own, it was counted in a group it was not in, and
    every member's part for it went missing (6 nodes at 200 ms, their first rounds)."""
    timeouts = RoundTimeouts(matchmaking_window=0.5, join_timeout=0.05)
    leader, follower = _leader_and_follower(timeouts)
    leader.timeouts = RoundBudget.of(timeouts, out_of_step=True).matching
    follower.timeouts = RoundBudget.of(timeouts).matching
    assert follower.timeouts.matchmaking < leader.timeouts.matchmaking_window

    async def main() -> list[GroupInfo | RoundFailed]:
        for node in (leader, follower):
            await node.start()

        led = asyncio.create_task(_first(leader))
        await asyncio.sleep(0.05)  # the leader declared first: the follower reads it
        return [await _first(follower), await led]

    followed, led = asyncio.run(main())
    assert isinstance(led, GroupInfo) and len(led.members) == 2, led
    assert isinstance(followed, GroupInfo), followed
    assert led.group_id == followed.group_id


def test_a_leader_that_fell_out_of_step_after_declaring_ahead_is_not_charged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Both declared the round ahead on the usual window; then a late JOIN put the leader out
    of step, and at its send step it waits the widest window (target 3, the third never
    comes). Its declaration made ahead said the usual one: its follower, due to hear from it
    a window and a group timeout after its send step, charged it as silent and left it
    (2 nodes, the pace attack's swarm). The leader declares again with the bound it waits
    by, and the follower reads that before charging anyone: both are in one group."""
    timeouts = RoundTimeouts(matchmaking_window=0.5, join_timeout=0.05)
    leader, follower = _leader_and_follower(timeouts)
    narrow = RoundBudget.of(timeouts).matching
    wide = RoundBudget.of(timeouts, out_of_step=True).matching
    assert narrow.matchmaking + narrow.group_timeout < wide.matchmaking_window

    async def main() -> list[GroupInfo | RoundFailed]:
        for node in (leader, follower):
            await node.start()
            node.timeouts = narrow
            node.open_ahead(
                FIRST, node.join_request(FIRST, NUMEL, 0, 0, 1.0, False), PRIOR, True, 0.2
            )
        await asyncio.sleep(0.2)  # both declarations made ahead are stored and read
        leader.timeouts = wide  # the JOIN came late: its send step begins the widest window
        led = asyncio.create_task(_first(leader))
        return [await _first(follower), await led]

    with caplog.at_level(logging.WARNING, logger="diloco.protocol.matchmaking"):
        followed, led = asyncio.run(main())
    assert "is silent" not in caplog.text
    assert isinstance(led, GroupInfo) and len(led.members) == 2, led
    assert isinstance(followed, GroupInfo), followed
    assert led.group_id == followed.group_id


@pytest.mark.parametrize(
    ("target", "counted", "late"),
    [(2, 1, True), (2, 0, False), (3, None, True), (2, None, False)],
)
def test_a_joiner_that_led_alone_while_counting_the_creator_waits_the_widest_window(
    target: int, counted: int | None, late: bool
) -> None:
    """A joiner counts the creator alone until they worked together: its target is the
    floor (2), and a round it led alone was no evidence when that asked for more than the
    floor. At 6 nodes and RTT 0 one such joiner led its first four rounds alone on its
    usual window. Told how many peers it counts (``counted``), it waits the widest window
    after leading alone while counting one; counting nobody, it does not. Not told, the
    target above its floor stands for them, as before."""
    network, table = MemoryNetwork(), Table()
    node = Matchmaker(
        network.join(peer(0)), MemoryDHT(make_identity(0), table), RUN_ID, DIGEST,
        RoundTimeouts(matchmaking_window=0.1, join_timeout=0.05), BanList(), 2, target,
    )  # fmt: skip
    node.counted = counted

    async def main() -> tuple[GroupInfo | RoundFailed, bool]:
        await node.start()
        outcome = await _first(node)
        return outcome, node.late.out_of_step(asyncio.get_running_loop().time())

    outcome, out_of_step = asyncio.run(main())
    assert isinstance(outcome, RoundFailed) and "no group" in str(outcome), outcome
    assert out_of_step is late
