"""Which rounds a node announces before their send step (``diloco.node.swarm.ahead``): each
fragment's next round once, only while no round of that fragment is in flight (its prior is
not known before), with the prior the send will carry and the weight it will have."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future

import torch
from torch import nn

from diloco.errors import PriorDiverged
from diloco.node.model.fragments import send_step
from diloco.node.swarm.ahead import Announcer
from diloco.node.training.outer import FragmentSync
from diloco.node.training.outer_config import OuterConfig
from diloco.protocol.core.reducer import Contribution, Reducer, RoundKey, RoundResult
from diloco.protocol.state.fragment import FragmentState


class Recording(Reducer):
    """Keeps what it is told; reduces nothing (rounds stay in flight until set)."""

    def __init__(self) -> None:
        self.prepared: list[tuple[RoundKey, int, float, str, float]] = []
        self.sent: dict[RoundKey, Future[RoundResult]] = {}

    def prepare(self, key: RoundKey, numel: int, weight: float, prior: str, lead: float) -> None:
        self.prepared.append((key, numel, weight, prior, lead))

    def reduce(self, key: RoundKey, contributions: Sequence[Contribution]) -> Future[RoundResult]:
        self.sent[key] = Future()
        return self.sent[key]


def test_each_fragments_next_round_is_announced_once_when_its_prior_is_known() -> None:
    h, tokens = 4, 10.0
    fragments = [[("a", nn.Parameter(torch.zeros(3)))], [("b", nn.Parameter(torch.zeros(5)))]]
    config = OuterConfig(sync_every=h, fragment_sync_delay=2, outer_lr=0.7, outer_momentum=0.9)
    sync = FragmentSync(fragments, config, "me", tau=2)
    reducer = Recording()
    announcer = Announcer(reducer)
    keys: list[RoundKey] = []
    for step in range(1, 13):
        sync.record_tokens(int(tokens))
        sync.send_due(step, lambda key, c: reducer.reduce(key, [c]))
        for key, future in reducer.sent.items():  # each round resolves at its receive step
            if not future.done() and step >= send_step(key.fragment, key.round, h, 2) + 2:
                delta = torch.ones(3 + 2 * key.fragment)  # the state changes
                future.set_result(RoundResult(delta, ("me",), 0, 0, 0))
        sync.apply_due(step)
        in_flight = {pending.key.fragment for pending in sync.pending}
        found = announcer.announce(sync, step, 12, tokens, 0.1)
        assert reducer.prepared[len(reducer.prepared) - len(found) :] == [
            (
                key,
                3 + 2 * key.fragment,
                sync.tokens_since_send[key.fragment]
                + (send_step(key.fragment, key.round, h, 2) - step) * tokens,
                sync.states[key.fragment].sha256(),  # the prior the send will carry
                2 * (send_step(key.fragment, key.round, h, 2) - step) * 0.1 + 1.0,
            )
            for key in found
        ]
        for key in found:
            assert key.fragment not in in_flight
            assert step < send_step(key.fragment, key.round, h, 2) <= 12
        keys += found
    assert len(keys) == len(set(keys))  # never twice
    # every round sent was announced before its send step
    assert set(keys) == set(reducer.sent)


def test_a_round_is_announced_again_once_a_heal_changed_its_prior() -> None:
    """A node that missed a round heals right after its announcement: the round is
    announced again with the state it now starts from, once."""
    fragments = [[("a", nn.Parameter(torch.zeros(3)))]]
    config = OuterConfig(sync_every=4, fragment_sync_delay=1, outer_lr=0.7, outer_momentum=0.9)
    sync = FragmentSync(fragments, config, "me", tau=1)
    reducer = Recording()
    announcer = Announcer(reducer)
    (key,) = announcer.announce(sync, 1, 100, 10.0, 0.1)
    before = sync.state_hash(0)
    assert announcer.announce(sync, 2, 100, 10.0, 0.1) == []
    sync.states[0].outer.add_(1.0)  # what adopting a healed state does
    sync.hashes.pop(0)
    assert announcer.announce(sync, 2, 100, 10.0, 0.1) == [key]
    assert announcer.announce(sync, 3, 100, 10.0, 0.1) == []
    priors = [prior for k, _, _, prior, _ in reducer.prepared if k == key]
    assert priors == [before, sync.states[0].sha256()] and before != priors[1]


def test_a_fragment_whose_last_round_failed_is_announced_only_once_healed() -> None:
    """Its prior is likely stale, and a declaration ends the peers' wait at their send step
    (every live node declared): the round is announced once a heal brought the state in."""
    fragments = [[("a", nn.Parameter(torch.zeros(3)))]]
    config = OuterConfig(sync_every=4, fragment_sync_delay=1, outer_lr=0.7, outer_momentum=0.9)
    sync = FragmentSync(fragments, config, "me", tau=1)
    reducer = Recording()
    announcer = Announcer(reducer)
    assert announcer.announce(sync, 1, 100, 10.0, 0.1) == [RoundKey(0, 1)]
    sync.send_due(4, lambda key, c: reducer.reduce(key, [c]))  # round 1, sent at step 4...
    reducer.sent[RoundKey(0, 1)].set_exception(PriorDiverged(0, 1, "no partner", "ab" * 8))
    (failed,) = sync.apply_due(5)  # ... failed for us
    assert not failed.ok and sync.states[0].version == 0
    assert announcer.announce(sync, 5, 100, 10.0, 0.1) == []
    assert announcer.announce(sync, 6, 100, 10.0, 0.1) == []
    healed = FragmentState(torch.full((3,), 0.5), torch.zeros(3), version=1)
    sync.adopt(0, healed)  # the peers' round 1
    assert announcer.announce(sync, 6, 100, 10.0, 0.1) == [RoundKey(0, 2)]
    assert reducer.prepared[-1][3] == healed.sha256()
