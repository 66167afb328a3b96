"""A heal's downloads go one request per donor (``diloco.node.swarm.fetch_groups``): a donor
answers a peer a few requests, then one every few seconds, and a node that healed every
fragment alone after each skip ahead was refused (BUSY) for the rest of the chaos run."""

from __future__ import annotations

from typing import Any

import pytest
from test_healing import (
    FakeSwarm,
    donor_state,
    make_healer,
    make_trainer,
    record,
    vouches_for,
)

from diloco.node.data.corpus import load_corpus
from diloco.node.swarm.fetch_groups import by_donor
from diloco.protocol.records.nodes import NodeRecord


@pytest.fixture(scope="module")
def corpus() -> Any:
    return load_corpus(None)


def holder(peer: str) -> NodeRecord:
    return record(peer, 0)


def test_fragments_sharing_their_best_donor_go_in_one_request() -> None:
    d, e, f = holder("d"), holder("e"), holder("f")
    plan = {0: [d, e], 1: [d, f, e], 2: [e, d], 3: [d]}
    assert by_donor(plan) == [([0, 1, 3], ["d"]), ([2], ["e", "d"])]
    assert by_donor({0: [d, e], 1: [d, e]}) == [([0, 1], ["d", "e"])]
    assert by_donor({}) == [] and by_donor({0: []}) == []


def test_a_node_that_skips_ahead_heals_every_fragment_in_one_request(corpus: Any) -> None:
    trainer = make_trainer(corpus)
    trainer.step = 6  # a periodic check; the swarm is at step 30, version 4 of every fragment
    served = donor_state(trainer, 30, 4)
    entries = [(p, 4, s.sha256()) for p, s in served.fragments.items()]
    vouches = [v for p, _, h in entries for v in vouches_for(p, 4, h, "donor", "x")]
    swarm = FakeSwarm(
        [record("donor", 30, *entries), record("x", 30, *entries)], {"donor": served}, vouches
    )
    healer, events = make_healer(trainer, swarm, anchors=["donor"], workers=("donor", "x"))
    healer.maybe_heal([])
    assert healer.future is not None
    healer.future.result(timeout=30)
    healer.maybe_heal([])
    fragments = list(range(trainer.sync.num_fragments))
    assert swarm.asked == [(fragments, ["donor"])]  # one request, not one per fragment
    assert [s.version for s in trainer.sync.states] == [4] * len(fragments)
    assert {"event": "healed", "step": trainer.step, "fragments": fragments} in events
