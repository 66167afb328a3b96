"""Healing decisions on hand-made record sets, and the Healer against a fake swarm."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from diloco.codecs import get_codec
from diloco.errors import ProtocolError
from diloco.node.data import load_corpus
from diloco.node.healing import (
    Healer,
    choose_donors,
    fragments_to_adopt,
    heal_plan,
    majority_hash,
    missed_rounds,
    open_suspects,
)
from diloco.node.inner import InnerConfig
from diloco.node.outer import OuterConfig
from diloco.node.trainer import NodeOptions, NodeTrainer, RunConfig
from diloco.protocol.fragment_state import FragmentState, OuterState
from diloco.protocol.records import FragmentVersion, NodeRecord
from diloco.protocol.reducer import InProcessReducer, RoundKey

A, B, C = "a" * 64, "b" * 64, "c" * 64


def record(peer: str, step: int, *frags: tuple[int, int, str]) -> NodeRecord:
    """A node record with ``(fragment, version, hash)`` entries."""
    versions = tuple(FragmentVersion(p, v, h) for p, v, h in frags)
    return NodeRecord(peer, (), step, versions, 0.0, "test")


def peers(records: Sequence[NodeRecord]) -> list[str]:
    return [r.peer_id for r in records]


# -- choose_donors -----------------------------------------------------------------------------


def test_choose_donors_takes_peers_ahead_newest_first() -> None:
    records = [
        record("p1", 50, (0, 4, A)),
        record("p2", 50, (0, 6, B)),
        record("p3", 50, (0, 3, C)),
        record("p4", 50, (0, 5, A)),
        record("p5", 50, (1, 9, A)),  # another fragment only
    ]
    assert peers(choose_donors(records, 0, 3, C, my_step=50)) == ["p2", "p4", "p1"]


def test_choose_donors_none_when_in_line_or_ahead_of_everyone() -> None:
    records = [record("p1", 50, (0, 3, C)), record("p2", 50, (0, 2, A))]
    assert choose_donors(records, 0, 3, C, my_step=50) == []
    assert choose_donors([], 0, 3, C, my_step=50) == []


def test_choose_donors_follows_the_majority_hash_at_my_version() -> None:
    two_for_b = [record("p1", 50, (0, 3, B)), record("p2", 50, (0, 3, B))]
    assert peers(choose_donors(two_for_b, 0, 3, C, my_step=50)) == ["p1", "p2"]
    # One peer with C sides with me: 2 against 2, the smaller hash (B < C) wins.
    tie = [*two_for_b, record("p3", 50, (0, 3, C))]
    assert peers(choose_donors(tie, 0, 3, C, my_step=50)) == ["p1", "p2"]
    # The same tie seen from a node holding A: A < B, it keeps its state.
    tie_a = [*two_for_b, record("p3", 50, (0, 3, A))]
    assert choose_donors(tie_a, 0, 3, A, my_step=50) == []
    # One peer against me: a tie, which the smaller hash wins (A < C).
    lone = [record("p1", 50, (0, 3, A))]
    assert peers(choose_donors(lone, 0, 3, C, my_step=50)) == ["p1"]
    # With one peer on my side the conflicting peer is the minority.
    assert choose_donors([*lone, record("p2", 50, (0, 3, C))], 0, 3, C, my_step=50) == []


def test_choose_donors_majority_counts_only_my_version() -> None:
    records = [
        record("p1", 50, (0, 3, B)),
        record("p2", 50, (0, 2, A)),
        record("p3", 50, (0, 2, A)),
    ]
    assert majority_hash(records, 0, 3, C) == B  # 1 each at version 3: B < C
    assert peers(choose_donors(records, 0, 3, C, my_step=50)) == ["p1"]
    assert majority_hash(records, 0, 3, A) == A


def test_choose_donors_lagging_node_takes_the_peer_furthest_ahead() -> None:
    in_line = [record("p1", 53, (0, 3, C)), record("p2", 60, (0, 3, C))]
    assert peers(choose_donors(in_line, 0, 3, C, my_step=50)) == ["p2"]
    # Within MAX_LAG_STEPS (2) a node is not lagging.
    close = [record("p1", 52, (0, 3, C))]
    assert choose_donors(close, 0, 3, C, my_step=50) == []
    # A peer ahead on the fragment is preferred to the furthest step.
    mixed = [*in_line, record("p3", 51, (0, 4, A))]
    assert peers(choose_donors(mixed, 0, 3, C, my_step=50)) == ["p3"]


def test_heal_plan_checks_every_fragment_when_lagging() -> None:
    mine = {0: (3, C), 1: (2, C), 2: (1, C)}
    records = [record("p1", 50, (0, 3, C), (1, 3, A), (2, 1, C))]
    assert {p: peers(d) for p, d in heal_plan(records, mine, 50, [0, 1]).items()} == {1: ["p1"]}
    assert heal_plan(records, mine, 50, [0, 2]) == {}
    lagging = [*records, record("p2", 80, (0, 3, C), (1, 2, C), (2, 1, C))]
    plan = heal_plan(lagging, mine, 50, [0])
    assert {p: peers(d) for p, d in plan.items()} == {0: ["p2"], 1: ["p1"], 2: ["p2"]}


# -- adopt, missed rounds, suspects ------------------------------------------------------------


def state(version: int, value: float) -> FragmentState:
    return FragmentState(torch.full((4,), value), torch.zeros(4), version)


def test_fragments_to_adopt_rules() -> None:
    mine = [state(3, 1.0), state(3, 1.0), state(3, 1.0), state(3, 1.0), state(3, 1.0)]
    fetched = {
        0: state(4, 2.0),  # newer
        1: state(3, 2.0),  # same version, another hash
        2: state(3, 1.0),  # the same state
        3: state(2, 2.0),  # older
        4: state(5, 2.0),  # newer but a round is in flight
    }
    assert fragments_to_adopt(fetched, mine, in_flight={4}) == [0, 1]
    assert fragments_to_adopt(fetched, mine, in_flight={4}, take_all=True) == [0, 1, 2, 3]


def test_missed_rounds_by_hand() -> None:
    # H 10, 2 fragments: offsets 0 and 5; round 1 sent at steps 10 and 15.
    assert missed_rounds(9, [0, 0], 10) == {}
    assert missed_rounds(12, [0, 0], 10) == {0: 1}
    assert missed_rounds(16, [0, 1], 10) == {0: 1}
    assert missed_rounds(26, [1, 0], 10) == {0: 2, 1: 2}
    assert missed_rounds(26, [2, 2], 10) == {}


def test_open_suspects_until_caught_up_or_next_round_sent() -> None:
    # H 10, 2 fragments; round 1 of fragment 0 (sent at 10) failed.
    assert open_suspects({0: 1}, [0, 0], 15, 10) == {0: 1}
    assert open_suspects({0: 1}, [1, 0], 15, 10) == {}
    assert open_suspects({0: 1}, [0, 0], 20, 10) == {}  # round 2 sent at step 20
    assert open_suspects({1: 1}, [0, 0], 24, 10) == {1: 1}  # fragment 1's round 2: step 25


# -- the Healer against a fake swarm -----------------------------------------------------------


class FakeSwarm:
    """Records and states to hand out; remembers what was asked."""

    def __init__(self, records: list[NodeRecord], states: dict[str, OuterState]) -> None:
        self.records, self.states = records, states
        self.asked: list[tuple[list[int], list[str]]] = []

    def read_records(self) -> list[NodeRecord]:
        return list(self.records)

    def fetch_state(
        self, fragments: Sequence[int], expected_numel: Mapping[int, int], donors: Sequence[str]
    ) -> OuterState:
        self.asked.append((list(fragments), list(donors)))
        for donor in donors:
            if donor in self.states:
                full = self.states[donor]
                return OuterState(full.global_step, {p: full.fragments[p] for p in fragments})
        raise ProtocolError("no donor delivered")


@pytest.fixture(scope="module")
def corpus() -> Any:
    return load_corpus(None)


def make_trainer(corpus: Any) -> NodeTrainer:
    run = RunConfig(
        steps=40,
        seq_len=16,
        outer=OuterConfig(sync_every=6, fragment_sync_delay=1),
        inner=InnerConfig(warmup_steps=5),
        codec="none",
    )
    options = NodeOptions(batch_size=2, eval_batches=1)
    return NodeTrainer(run, options, InProcessReducer(get_codec("none")), "me", corpus)


def make_healer(trainer: NodeTrainer, swarm: FakeSwarm) -> tuple[Healer, list[dict[str, Any]]]:
    events: list[dict[str, Any]] = []
    worker = ThreadPoolExecutor(1)
    healer = Healer(trainer, swarm, "me", worker, events.append, lambda: None)
    return healer, events


def donor_state(trainer: NodeTrainer, global_step: int, version: int) -> OuterState:
    fragments = {
        p: FragmentState(torch.full_like(s.outer, 0.5 + p), torch.full_like(s.outer, 0.1), version)
        for p, s in enumerate(trainer.sync.states)
    }
    return OuterState(global_step, fragments)


def finish_check(healer: Healer, swarm: FakeSwarm) -> list[tuple[list[int], list[str]]]:
    """Wait for the check in flight and apply it; returns what it asked the swarm for (the
    next check may start at once)."""
    assert healer.future is not None
    healer.future.result(timeout=30)
    asked = list(swarm.asked)
    healer.maybe_heal([])
    return asked


def test_healer_fetches_a_fragment_a_peer_holds_newer_and_adopts_it(corpus: Any) -> None:
    trainer = make_trainer(corpus)
    trainer.step = 6  # fragment 0 sent round 1 at step 6; a periodic check is due
    served = donor_state(trainer, 6, 1)
    others = [(p, s.version, s.sha256()) for p, s in enumerate(trainer.sync.states) if p]
    ahead = record("donor", 6, (0, 1, served.fragments[0].sha256()), *others)
    swarm = FakeSwarm([ahead, record("me", 6, (0, 9, A))], {"donor": served})
    healer, events = make_healer(trainer, swarm)
    healer.maybe_heal([])
    assert finish_check(healer, swarm) == [([0], ["donor"])]  # its own record is ignored
    adopted = trainer.sync.states[0]
    assert torch.equal(adopted.outer, served.fragments[0].outer) and adopted.version == 1
    assert torch.equal(adopted.momentum, served.fragments[0].momentum)
    live = torch.cat([p.detach().reshape(-1) for _, p in trainer.fragments[0]])
    assert torch.equal(live, served.fragments[0].outer)  # theta takes the outer state
    assert events == [{"event": "healed", "step": 6, "fragments": [0]}]
    assert healer.healed_fragments == 1 and trainer.step == 6


def test_healer_failed_round_makes_a_suspect_checked_without_waiting_for_h(corpus: Any) -> None:
    trainer = make_trainer(corpus)
    trainer.step = 8  # not a multiple of H: no periodic check
    swarm = FakeSwarm([], {})
    healer, _ = make_healer(trainer, swarm)
    healer.maybe_heal([])
    assert healer.future is None
    healer.maybe_heal([RoundKey(0, 1)])
    assert healer.suspects == {0: 1} and healer.checking == [0]
    assert finish_check(healer, swarm) == []  # nobody ahead: the suspect stays until...
    trainer.step = 12  # ... fragment 0 sends round 2
    healer.maybe_heal([])
    assert healer.suspects == {}


def test_healer_lagging_node_skips_to_the_donors_step(corpus: Any) -> None:
    trainer = make_trainer(corpus)
    trainer.step = 12
    mine = [(p, s.version, s.sha256()) for p, s in enumerate(trainer.sync.states)]
    served = donor_state(trainer, 30, 0)
    swarm = FakeSwarm([record("fast", 30, *mine)], {"fast": served})
    healer, events = make_healer(trainer, swarm)
    healer.maybe_heal([])
    num_fragments = trainer.sync.num_fragments
    assert finish_check(healer, swarm) == [([p], ["fast"]) for p in range(num_fragments)]
    assert trainer.step == 30
    assert {"event": "caught_up", "from_step": 12, "to_step": 30} in events
    # Version 0 after step 30: every fragment missed its rounds, all suspect now.
    assert set(healer.suspects) == set(range(num_fragments))


def test_healer_join_settles_rounds_in_flight(corpus: Any) -> None:
    trainer = make_trainer(corpus)
    # H 6, 5 fragments (offsets 0..4): fragment 0 sent round 1 at step 6, during the download.
    joined = donor_state(trainer, 6, 0)
    landed = donor_state(trainer, 8, 1)
    swarm = FakeSwarm([record("old", 7, (0, 0, A)), record("new", 8, (0, 1, B))], {"new": landed})
    healer, _ = make_healer(trainer, swarm)
    assert healer.adopt(joined, take_step=True) == list(range(trainer.sync.num_fragments))
    assert trainer.step == 6 and trainer.sync.states[0].version == 0
    healer.settle_rounds_in_flight(deadline=time.monotonic() + 30)
    assert swarm.asked == [([0], ["new"])]
    assert trainer.sync.states[0].version == 1
    assert torch.equal(trainer.sync.states[0].outer, landed.fragments[0].outer)
