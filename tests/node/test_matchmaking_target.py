"""A round applied with new peers raises the group the next round waits for at once, not a
records read later (docs/design.md "Healing and joining").

Seen in the 100 ms CLI swarm (tests/node/test_wan_tau.py): tau auto rose to about the 12
steps between two sends, so a round was applied the step before the next fragment's send;
the creator, which had just worked with the second joiner for the first time, still led
that send with the count set at its last records read (itself and the first joiner), closed
the group on those two and refused the second joiner (GROUP_CLOSED), which then lacked the
round and had to heal."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import pytest

from diloco import __version__
from diloco.node.config import NodeOptions, RoundOptions, RunConfig
from diloco.node.evidence.claims import Evidence
from diloco.node.evidence.witness import Witness, WitnessedRound
from diloco.node.swarm.matchmaking_target import MatchmakingTarget
from diloco.node.swarm.node import SwarmNode
from diloco.node.swarm.pinned_run import start_run
from diloco.node.training.inner import InnerConfig
from diloco.node.training.outer_config import OuterConfig
from diloco.node.training.pending import AppliedRound
from diloco.protocol.core.reducer import RoundKey
from diloco.protocol.records.nodes import NodeRecord
from diloco.protocol.runtime.network import NetworkOptions
from diloco.protocol.trust.identity import Identity


def records(*peers: str) -> list[NodeRecord]:
    return [NodeRecord(p, (), 10, (), 0.0, __version__) for p in peers]


def test_a_witnessed_round_sets_the_target_before_the_next_records_read() -> None:
    me, b, c = (Identity.generate().peer_id for _ in range(3))
    witness = Witness(me)
    set_to: list[tuple[int, int, int]] = []
    target = MatchmakingTarget(
        lambda: Evidence(me, witness.workers(), creator=b),
        2,
        lambda size, live, counted: set_to.append((size, live, counted)),
    )
    target.witnessed()  # no records read yet: nothing to count against
    assert set_to == []
    target.heard(records(me, b, c))
    assert set_to == [(2, 3, 1)]  # a joiner that has seen nobody work: itself and the creator
    witness.record(WitnessedRound(0, 1, (me, b), "h"))
    target.witnessed()
    assert set_to == [(2, 3, 1)]  # b alone: still two
    witness.record(WitnessedRound(1, 1, tuple(sorted((me, b, c))), "h"))
    target.witnessed()
    assert set_to[-1] == (3, 3, 2)
    target.heard(records(me, b))  # c's record gone (it left): c is not waited for
    assert set_to[-1] == (2, 2, 1)
    target.witnessed()  # nothing new: the target stays
    assert set_to == [(2, 3, 1), (3, 3, 2), (2, 2, 1)]


def test_a_witnessed_round_never_lowers_the_target_the_next_read_does() -> None:
    """A restarted joiner counts its anchor (the third node) and the creator until its first
    round, which it has with the creator alone: the anchor stays waited for until the
    records are read again."""
    me, creator, anchor = (Identity.generate().peer_id for _ in range(3))
    witness = Witness(me)
    set_to: list[tuple[int, int, int]] = []
    target = MatchmakingTarget(
        lambda: Evidence(me, witness.workers(), frozenset({anchor}), creator),
        2,
        lambda size, live, counted: set_to.append((size, live, counted)),
    )
    target.heard(records(me, creator, anchor))
    assert set_to == [(3, 3, 2)]
    witness.record(WitnessedRound(0, 1, tuple(sorted((me, creator))), "h"))
    target.witnessed()
    assert set_to == [(3, 3, 2)]
    target.heard(records(me, creator, anchor))
    assert set_to[-1] == (2, 3, 1)


@pytest.mark.swarm
def test_a_node_waits_for_its_new_partner_in_the_round_after_their_first() -> None:
    """The real node, the run's creator: its records read (two live peers, neither seen
    working: before its first round with others it waits for every live record), then a
    round applied with both, then a read with a third newcomer, whom it no longer waits for:
    it has peers it saw work now."""
    run = RunConfig(
        steps=1000,
        seq_len=16,
        outer=OuterConfig(sync_every=6),
        inner=InnerConfig(warmup_steps=5),
        codec="none",
    )
    net = NetworkOptions()
    run, signed, dht = start_run(run, net, None)
    options = NodeOptions(batch_size=2, eval_batches=1, threads=1, log_every=10_000)
    node = SwarmNode(run, options, RoundOptions(), net, signed=signed, dht=dht)
    try:
        me = node.swarm.peer_id.to_base58()
        b, c = (Identity.generate().peer_id for _ in range(2))
        node._heard(records(me, b, c))
        assert wait_for(node, lambda size, live: (size, live) == (3, 3))
        members: Sequence[str] = tuple(sorted((me, b, c)))
        node._vouch(AppliedRound(RoundKey(0, 1), ok=True, members=members, outer_sha256="h"))
        d = Identity.generate().peer_id
        node._heard(records(me, b, c, d))
        assert wait_for(node, lambda size, live: (size, live) == (3, 4)), (
            node.reducer.matchmaker.target_group_size
        )
        # b and c, which it saw work, are at step 10, this node at 0: it is behind them, so
        # its rounds led alone are no evidence that they come late (matchmaking/late.py)
        assert node.trainer.step == 0
        assert wait_until(lambda: node.reducer.matchmaker.late.behind)
        node._heard([NodeRecord(p, (), 2, (), 0.0, __version__) for p in (me, b, c, d)])
        assert wait_until(lambda: not node.reducer.matchmaker.late.behind)  # within 2 steps
    finally:
        node.close()


def wait_until(holds: Callable[[], bool], timeout: float = 5.0) -> bool:
    """Whether ``holds`` comes true (a value set on the swarm's loop)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if holds():
            return True
        time.sleep(0.05)
    return False


def wait_for(
    node: SwarmNode, holds: Callable[[int | None, int | None], bool], timeout: float = 5.0
) -> bool:
    """Whether the reducer's target (set on the swarm's loop) comes to satisfy ``holds``."""
    matchmaker = node.reducer.matchmaker
    return wait_until(lambda: holds(matchmaker.target_group_size, matchmaker.live_nodes), timeout)
