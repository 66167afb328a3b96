"""A node alone in the run applies a round of one (its own outer gradient through the
codecs); as soon as the run holds another live node, or a joiner took its state, it fails
such a round as before."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from hivemind.utils import get_dht_time

from diloco.codecs import get_codec
from diloco.errors import RoundFailed
from diloco.protocol.core.group import RoundTimeouts
from diloco.protocol.core.reducer import Contribution, RoundKey
from diloco.protocol.matchmaking.lobby import round_key
from diloco.protocol.records.declarations import declare_round
from diloco.protocol.records.nodes import FragmentVersion, NodeRecord
from diloco.protocol.runtime.network import NetworkOptions
from diloco.protocol.state.fragment import FragmentState, OuterState
from diloco.protocol.swarm import Swarm
from diloco.protocol.swarm_reducer import SwarmReducer
from diloco.protocol.wire.run_id import make_run_id

pytestmark = pytest.mark.swarm

RUN_ID = make_run_id("round-of-one", {})
TIMEOUTS = RoundTimeouts(matchmaking_window=0.5, join_timeout=1.0)


@pytest.fixture
def lone() -> Iterator[Swarm]:
    swarm = Swarm(RUN_ID, NetworkOptions(host_maddrs=("/ip4/127.0.0.1/tcp/0",)))
    try:
        yield swarm
    finally:
        swarm.shutdown()


def test_alone_a_round_of_one_then_with_a_peer_no_round(lone: Swarm) -> None:
    codec = get_codec("e3m0")
    reducer = SwarmReducer(lone, codec, timeouts=TIMEOUTS, rounds_of_one=True)
    delta = torch.randn(1000, generator=torch.Generator().manual_seed(3))
    me = lone.peer_id.to_base58()
    result = reducer.reduce(RoundKey(0, 1), [Contribution(me, delta, 5.0)]).result(60)
    assert result.members == (me,)
    expected = codec.decode(codec.encode(delta))  # e3m0 both ways: the round's own codecs
    assert torch.equal(result.delta, codec.decode(codec.encode(expected)))
    assert not torch.equal(result.delta, delta)

    # A peer of the run is live (its record is there) but does not take part: the round
    # fails for want of a group, as before; a round of one would split the states.
    net = NetworkOptions(initial_peers=tuple(lone.maddrs), host_maddrs=("/ip4/127.0.0.2/tcp/0",))
    peer = Swarm(RUN_ID, net)
    try:
        record = NodeRecord(
            peer.peer_id.to_base58(), tuple(peer.maddrs), 0, (FragmentVersion(0, 0, "0" * 64),),
            1.0, "test",
        )  # fmt: skip
        assert peer.publish_record(record, ttl=60.0)
        assert peer.peer_id.to_base58() in {r.peer_id for r in lone.read_records()}
        future = reducer.reduce(RoundKey(0, 2), [Contribution(me, delta, 5.0)])
        with pytest.raises(RoundFailed, match="no group: 1 member"):
            future.result(60)
    finally:
        reducer.close()
        peer.shutdown()


def fails_alone(reducer: SwarmReducer, lone: Swarm) -> None:
    """The node's next round fails for want of a group: no round of one."""
    me = lone.peer_id.to_base58()
    future = reducer.reduce(RoundKey(0, 1), [Contribution(me, torch.ones(100), 1.0)])
    with pytest.raises(RoundFailed, match="no group: 1 member"):
        future.result(60)


def test_no_round_of_one_while_the_last_read_of_records_saw_a_peer(lone: Swarm) -> None:
    """A fresh read of the records finds nobody else (it may come back empty on a slow
    network), but the publisher's last read saw a peer: the round fails rather than leave
    this node at a state of its own."""
    reducer = SwarmReducer(lone, get_codec("e3m0"), timeouts=TIMEOUTS, rounds_of_one=True)
    try:
        reducer.set_target_group_size(2, live_nodes=2)
        fails_alone(reducer, lone)
    finally:
        reducer.close()


def test_no_round_of_one_when_a_peer_declared_the_round_and_left(lone: Swarm) -> None:
    """A peer declared the round (this node's prior) and then left the run: no record of
    it is read any more, but the round had it, so a round of one would leave this node at
    a state of its own (the run's end: peers that finished formed their last round without
    a late node and left before its matchmaking ended)."""
    reducer = SwarmReducer(lone, get_codec("e3m0"), timeouts=TIMEOUTS, rounds_of_one=True)
    net = NetworkOptions(initial_peers=tuple(lone.maddrs), host_maddrs=("/ip4/127.0.0.2/tcp/0",))
    peer = Swarm(RUN_ID, net)
    try:
        key = RoundKey(0, 1)
        expiration = float(get_dht_time()) + 60.0
        declared = declare_round(peer.dht, round_key(RUN_ID, key), 1.0, expiration, prior="ab" * 32)
        assert peer.call(declared, timeout=30)
        assert lone.read_records() == []  # no live record but its own (none published)
        me = lone.peer_id.to_base58()
        future = reducer.reduce(key, [Contribution(me, torch.ones(100), 1.0, prior="ab" * 32)])
        with pytest.raises(RoundFailed) as failure:
            future.result(60)
        assert failure.value.others_declared == 1
    finally:
        reducer.close()
        peer.shutdown()


def test_no_round_of_one_after_sending_its_state_to_a_joiner(lone: Swarm) -> None:
    """A joiner fetched this node's state and has published no record yet (on a slow
    network it reaches the reads seconds later): it will start from that state and look for
    this node in its rounds, so a round of one now would leave the two apart."""
    reducer = SwarmReducer(lone, get_codec("e3m0"), timeouts=TIMEOUTS, rounds_of_one=True)
    state = FragmentState(torch.zeros(100), torch.zeros(100))
    lone.serve_state(lambda: OuterState(global_step=7, fragments={0: state}))
    net = NetworkOptions(initial_peers=tuple(lone.maddrs), host_maddrs=("/ip4/127.0.0.2/tcp/0",))
    joiner = Swarm(RUN_ID, net)
    try:
        fetched = joiner.fetch_state([0], {0: 100}, donors=[lone.peer_id])
        assert fetched.global_step == 7
        assert lone.read_records() == []  # no live record but its own (none published)
        fails_alone(reducer, lone)
        # and the joiner starts behind it: the round was on the widest window
        assert reducer.matchmaker.timeouts.matchmaking_window == 4 * TIMEOUTS.matchmaking_window
        assert lone.take_state_takers() == {}  # the reducer read them
    finally:
        reducer.close()
        joiner.shutdown()


def test_a_round_of_one_is_withdrawn_once_a_joiner_took_the_state_before_its_apply(
    lone: Swarm,
) -> None:
    """The round of one was decided with nobody around; a joiner then fetched the state,
    which does not hold it (not applied yet): when the node comes to apply it, the result
    says it no longer holds, and the joiner and the node stay at one state."""
    reducer = SwarmReducer(lone, get_codec("e3m0"), timeouts=TIMEOUTS, rounds_of_one=True)
    state = FragmentState(torch.zeros(100), torch.zeros(100))
    lone.serve_state(lambda: OuterState(global_step=7, fragments={0: state}))
    me = lone.peer_id.to_base58()
    net = NetworkOptions(initial_peers=tuple(lone.maddrs), host_maddrs=("/ip4/127.0.0.2/tcp/0",))
    joiner: Swarm | None = None
    try:
        result = reducer.reduce(RoundKey(0, 1), [Contribution(me, torch.ones(100), 1.0)]).result(60)
        assert result.members == (me,) and result.withdrawn is not None
        assert result.withdrawn() is None  # nobody took the state yet: it holds
        joiner = Swarm(RUN_ID, net)
        assert joiner.fetch_state([0], {0: 100}, donors=[lone.peer_id]).global_step == 7
        assert (
            result.withdrawn()
            == "a peer took this node's state before its round of one was applied"
        )
    finally:
        reducer.close()
        if joiner is not None:
            joiner.shutdown()
