"""Healing decisions on hand-made record sets, and the Healer against a fake swarm."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

import pytest
import torch

from diloco.codecs import get_codec
from diloco.errors import ProtocolError
from diloco.node.data.corpus import load_corpus
from diloco.node.evidence.claims import Schedule, SwarmView
from diloco.node.evidence.suspects import failed_everywhere, missed_rounds, open_suspects
from diloco.node.evidence.witness import Witness, WitnessedRound
from diloco.node.model.fragments import send_step
from diloco.node.swarm.donors import (
    ahead_of,
    catch_up_step,
    choose_donors,
    fragments_to_adopt,
    heal_plan,
    join_donors,
    lagging,
    majority_hash,
    skip_target,
)
from diloco.node.swarm.healing import Healer
from diloco.node.training.inner import InnerConfig
from diloco.node.training.outer_config import OuterConfig
from diloco.node.training.trainer import NodeOptions, NodeTrainer, RunConfig
from diloco.protocol.core.reducer import InProcessReducer, RoundKey, RoundResult
from diloco.protocol.records.nodes import FragmentVersion, NodeRecord, Vouch
from diloco.protocol.state.fragment import FragmentState, OuterState
from diloco.protocol.trust.identity import Identity

A, B, C = "a" * 64, "b" * 64, "c" * 64
NONE: frozenset[str] = frozenset()


def record(peer: str, step: int, *frags: tuple[int, int, str]) -> NodeRecord:
    """A node record with ``(fragment, version, hash)`` entries."""
    versions = tuple(FragmentVersion(p, v, h) for p, v, h in frags)
    return NodeRecord(peer, (), step, versions, 0.0, "test")


def peers(records: Sequence[NodeRecord]) -> list[str]:
    return [r.peer_id for r in records]


def trusting(records: list[NodeRecord], step: int | None = None) -> SwarmView:
    """A view in which every record is plausible and every state it claims vouched."""
    claims = {(f.fragment, f.version, f.state_hash) for r in records for f in r.fragments}
    return SwarmView(tuple(records), dict.fromkeys(claims, frozenset()), step)


# -- choose_donors -----------------------------------------------------------------------------


def test_choose_donors_takes_peers_ahead_newest_first() -> None:
    records = [
        record("p1", 50, (0, 4, A)),
        record("p2", 50, (0, 6, B)),
        record("p3", 50, (0, 3, C)),
        record("p4", 50, (0, 5, A)),
        record("p5", 50, (1, 9, A)),  # another fragment only
    ]
    assert peers(choose_donors(trusting(records), 0, 3, C)) == ["p2", "p4", "p1"]


def test_choose_donors_ignores_states_that_are_not_vouched() -> None:
    records = [record("p1", 50, (0, 4, A)), record("p2", 50, (0, 6, B))]
    view = SwarmView(tuple(records), {(0, 4, A): frozenset()}, 50)
    assert peers(choose_donors(view, 0, 3, C)) == ["p1"]
    # Unvouched at our version with another hash: no conflict to follow either.
    alone = SwarmView((record("p1", 50, (0, 3, A)), record("p2", 50, (0, 3, A))), {}, 50)
    assert choose_donors(alone, 0, 3, C) == []


def test_choose_donors_none_when_in_line_or_ahead_of_everyone() -> None:
    records = [record("p1", 50, (0, 3, C)), record("p2", 50, (0, 2, A))]
    assert choose_donors(trusting(records), 0, 3, C) == []
    assert choose_donors(trusting([]), 0, 3, C) == []


def test_choose_donors_follows_the_majority_hash_at_my_version() -> None:
    two_for_b = [record("p1", 50, (0, 3, B)), record("p2", 50, (0, 3, B))]
    assert peers(choose_donors(trusting(two_for_b), 0, 3, C)) == ["p1", "p2"]
    # One peer with C sides with me: 2 against 2, the smaller hash (B < C) wins.
    tie = [*two_for_b, record("p3", 50, (0, 3, C))]
    assert peers(choose_donors(trusting(tie), 0, 3, C)) == ["p1", "p2"]
    # The same tie seen from a node holding A: A < B, it keeps its state.
    tie_a = [*two_for_b, record("p3", 50, (0, 3, A))]
    assert choose_donors(trusting(tie_a), 0, 3, A) == []
    # One peer against me: a tie, which the smaller hash wins (A < C).
    lone = [record("p1", 50, (0, 3, A))]
    assert peers(choose_donors(trusting(lone), 0, 3, C)) == ["p1"]
    # With one peer on my side the conflicting peer is the minority.
    assert choose_donors(trusting([*lone, record("p2", 50, (0, 3, C))]), 0, 3, C) == []


def test_choose_donors_majority_counts_only_my_version() -> None:
    records = [
        record("p1", 50, (0, 3, B)),
        record("p2", 50, (0, 2, A)),
        record("p3", 50, (0, 2, A)),
    ]
    assert majority_hash(records, 0, 3, C) == B  # 1 each at version 3: B < C
    assert peers(choose_donors(trusting(records), 0, 3, C)) == ["p1"]
    assert majority_hash(records, 0, 3, A) == A


def test_lagging_against_the_views_robust_step() -> None:
    assert lagging(trusting([], step=53), my_step=50)
    assert not lagging(trusting([], step=52), my_step=50)  # within MAX_LAG_STEPS (2)
    assert not lagging(trusting([], step=None), my_step=0)


def test_ahead_of_counts_only_the_clocks_records_past_max_lag_steps() -> None:
    records = [record("creator", 53), record("stranger", 900)]
    assert ahead_of(records, {"creator"}, my_step=50)  # 3 past: more than MAX_LAG_STEPS (2)
    assert not ahead_of(records, {"creator"}, my_step=51)  # 2 past: within it
    assert not ahead_of(records, set(), my_step=0)  # a stranger's claim moves nothing


def test_heal_plan_checks_every_fragment_when_lagging() -> None:
    mine = {0: (3, C), 1: (2, C), 2: (1, C)}
    records = [record("p1", 50, (0, 3, C), (1, 3, A), (2, 1, C))]
    in_line = trusting(records, step=50)
    assert {p: peers(d) for p, d in heal_plan(in_line, mine, 50, [0, 1]).items()} == {1: ["p1"]}
    assert heal_plan(in_line, mine, 50, [0, 2]) == {}
    ahead = trusting([*records, record("p2", 80, (0, 4, C), (1, 2, C), (2, 2, C))], step=80)
    plan = heal_plan(ahead, mine, 50, [0])
    assert {p: peers(d) for p, d in plan.items()} == {0: ["p2"], 1: ["p1"], 2: ["p2"]}


def test_join_donors_need_every_fragment_vouched() -> None:
    full = record("full", 50, (0, 2, A), (1, 1, B))
    partial = record("partial", 60, (0, 3, A), (1, 1, B))
    missing = record("missing", 60, (0, 2, A))
    view = SwarmView((full, partial, missing), dict.fromkeys([(0, 2, A), (1, 1, B)], NONE), 50)
    assert peers(join_donors(view, 2)) == ["full"]
    both = SwarmView((full, partial), dict.fromkeys([(0, 2, A), (0, 3, A), (1, 1, B)], NONE), 50)
    assert peers(join_donors(both, 2)) == ["partial", "full"]  # the newest first


def test_donors_who_vouched_come_before_copies_of_their_claim() -> None:
    member = record("zz-member", 50, (0, 2, A), (1, 1, B))
    copies = [record(f"sybil{i}", 60, (0, 2, A), (1, 1, B)) for i in range(3)]
    vouchers = {(0, 2, A): frozenset({"zz-member", "other"}), (1, 1, B): frozenset({"x", "y"})}
    view = SwarmView((*copies, member), vouchers, 50)
    assert peers(join_donors(view, 2))[0] == "zz-member"
    assert peers(choose_donors(view, 0, 1, C))[0] == "zz-member"


# -- adopt, missed rounds, suspects ------------------------------------------------------------


def state(version: int, value: float) -> FragmentState:
    return FragmentState(torch.full((4,), value), torch.zeros(4), version)


def test_fragments_to_adopt_rules() -> None:
    mine = {p: (3, state(3, 1.0).sha256()) for p in range(5)}
    fetched = {
        0: state(4, 2.0),  # newer
        1: state(3, 2.0),  # same version, another hash
        2: state(3, 1.0),  # the same state
        3: state(2, 2.0),  # older
        4: state(5, 2.0),  # newer but a round is in flight
    }
    assert fragments_to_adopt(fetched, mine, in_flight={4}) == [0, 1]


def test_catch_up_step_reaches_the_send_step_of_the_newest_round_adopted() -> None:
    # H 10, 2 fragments (offsets 0 and 5): round 4 is sent at steps 40 and 45.
    adopted = {0: state(4, 2.0), 1: state(4, 2.0)}
    assert catch_up_step(adopted, 39, sync_every=10, num_fragments=2) == 45
    assert catch_up_step({0: state(4, 2.0)}, 39, sync_every=10, num_fragments=2) == 40
    assert catch_up_step(adopted, 50, sync_every=10, num_fragments=2) == 50
    assert catch_up_step({0: state(0, 2.0)}, 0, sync_every=10, num_fragments=2) == 0


def test_missed_rounds_by_hand() -> None:
    # H 10, 2 fragments: offsets 0 and 5; round 1 sent at steps 10 and 15.
    assert missed_rounds(9, [0, 0], 10) == {}
    assert missed_rounds(12, [0, 0], 10) == {0: 1}
    assert missed_rounds(16, [0, 1], 10) == {0: 1}
    assert missed_rounds(26, [1, 0], 10) == {0: 2, 1: 2}
    assert missed_rounds(26, [2, 2], 10) == {}


def test_failed_everywhere_only_when_every_vouched_holder_is_past_the_receive_step() -> None:
    # H 10, 2 fragments, tau 1: round 1 of fragment 0 sent at step 10, received at 11.
    schedule, missed = Schedule(100, 10, 2), {0: 1}
    failed = record("p1", 12, (0, 0, A), (1, 0, A))
    assert failed_everywhere(trusting([failed]), missed, schedule, tau=1)
    assert failed_everywhere(trusting([failed, record("p2", 20, (0, 0, B))]), missed, schedule, 1)
    assert not failed_everywhere(trusting([]), missed, schedule, tau=1)  # nobody says
    assert not failed_everywhere(trusting([record("p1", 11, (0, 0, A))]), missed, schedule, 1)
    assert not failed_everywhere(trusting([failed]), missed, schedule, tau=2)  # may still come
    applied = record("p2", 12, (0, 1, B))
    assert not failed_everywhere(trusting([failed, applied]), missed, schedule, tau=1)
    # a newer claim nobody vouches for (a Sybil's) says nothing
    view = SwarmView((failed, applied), {(0, 0, A): NONE}, 12)
    assert failed_everywhere(view, missed, schedule, tau=1)
    # every missed round must have failed: round 1 of fragment 1 (sent at 15) not yet past
    assert not failed_everywhere(trusting([failed]), {0: 1, 1: 1}, schedule, tau=1)


def test_open_suspects_until_caught_up_or_next_round_sent() -> None:
    # H 10, 2 fragments; round 1 of fragment 0 (sent at 10) failed.
    assert open_suspects({0: 1}, [0, 0], 15, 10) == {0: 1}
    assert open_suspects({0: 1}, [1, 0], 15, 10) == {}
    assert open_suspects({0: 1}, [0, 0], 20, 10) == {}  # round 2 sent at step 20
    assert open_suspects({1: 1}, [0, 0], 24, 10) == {1: 1}  # fragment 1's round 2: step 25


# -- the Healer against a fake swarm -----------------------------------------------------------


class FakeSwarm:
    """Records, vouches and states to hand out; remembers what was asked."""

    def __init__(
        self,
        records: list[NodeRecord],
        states: dict[str, OuterState],
        vouches: Sequence[Vouch] = (),
    ) -> None:
        self.records, self.states, self.vouches = records, states, list(vouches)
        self.asked: list[tuple[list[int], list[str]]] = []

    def read_swarm(self, fragments: Sequence[int]) -> tuple[list[NodeRecord], list[Vouch]]:
        return self.read_records(), self.read_vouches(fragments)

    def read_records(self) -> list[NodeRecord]:
        return list(self.records)

    def read_vouches(self, fragments: Sequence[int]) -> list[Vouch]:
        return [v for v in self.vouches if v.fragment in fragments]

    def fetch_state(
        self, fragments: Sequence[int], expected_numel: Mapping[int, int], donors: Sequence[str]
    ) -> OuterState:
        self.asked.append((list(fragments), list(donors)))
        for donor in donors:
            if donor in self.states:
                full = self.states[donor]
                return OuterState(full.global_step, {p: full.fragments[p] for p in fragments})
        raise ProtocolError("no donor delivered")


def vouches_for(fragment: int, round: int, state_hash: str, *members: str) -> list[Vouch]:
    """Every member of a round vouching for the state it reached."""
    listed = tuple(sorted(members))
    return [Vouch(m, fragment, round, state_hash, listed) for m in listed]


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


def make_healer(
    trainer: NodeTrainer,
    swarm: FakeSwarm,
    anchors: Sequence[str] = (),
    workers: Sequence[str] = (),
) -> tuple[Healer, list[dict[str, Any]]]:
    """A healer of node "me" that joined through ``anchors`` and applied a round with
    ``workers`` (whose vouches it counts: docs/design.md "Evidence")."""
    events: list[dict[str, Any]] = []
    worker = ThreadPoolExecutor(1)
    initial = [s.sha256() for s in trainer.sync.states]
    witness = Witness("me")
    if workers:
        witness.record(WitnessedRound(0, 1, tuple(sorted(["me", *workers])), A))
    healer = Healer(
        trainer, swarm, "me", worker, events.append, lambda: None, initial, anchors, witness
    )
    return healer, events


def donor_state(trainer: NodeTrainer, global_step: int, version: int) -> OuterState:
    fragments = {
        p: FragmentState(torch.full_like(s.outer, 0.5 + p), torch.full_like(s.outer, 0.1), version)
        for p, s in enumerate(trainer.sync.states)
    }
    return OuterState(global_step, fragments)


def initial_entries(trainer: NodeTrainer, skip: int | None = None) -> list[tuple[int, int, str]]:
    """Record entries of the run's initial state (version 0), but for fragment ``skip``."""
    return [(p, 0, s.sha256()) for p, s in enumerate(trainer.sync.states) if p != skip]


def finish_check(healer: Healer, swarm: FakeSwarm) -> list[tuple[list[int], list[str]]]:
    """Wait for the check in flight and apply it; returns what it asked the swarm for (the
    next check may start at once)."""
    assert healer.future is not None
    wait([healer.future], timeout=30)
    asked = list(swarm.asked)
    healer.maybe_heal([])
    return asked


def test_healer_fetches_a_fragment_vouched_newer_and_adopts_it(corpus: Any) -> None:
    trainer = make_trainer(corpus)
    trainer.step = 6  # fragment 0 sent round 1 at step 6; a periodic check is due
    served = donor_state(trainer, 6, 1)
    vouched = served.fragments[0].sha256()
    others = initial_entries(trainer, skip=0)
    ahead = record("donor", 6, (0, 1, vouched), *others)
    liar = record("liar", 6, (0, 1, A), *others)  # newer too, but no majority vouches for A
    swarm = FakeSwarm(
        [liar, ahead, record("me", 6, (0, 9, A))],
        {"donor": served, "liar": donor_state(trainer, 6, 1)},
        [*vouches_for(0, 1, vouched, "donor", "x"), Vouch("liar", 0, 1, A, ("liar",))],
    )
    healer, events = make_healer(trainer, swarm, workers=("donor", "x"))
    healer.maybe_heal([])
    assert finish_check(healer, swarm) == [([0], ["donor"])]  # its own record is ignored
    adopted = trainer.sync.states[0]
    assert torch.equal(adopted.outer, served.fragments[0].outer) and adopted.version == 1
    assert torch.equal(adopted.momentum, served.fragments[0].momentum)
    live = torch.cat([p.detach().reshape(-1) for _, p in trainer.fragments[0]])
    assert torch.equal(live, served.fragments[0].outer)  # theta takes the outer state
    assert events == [{"event": "healed", "step": 6, "fragments": [0]}]
    assert healer.healed_fragments == 1 and trainer.step == 6


def test_healer_refuses_bytes_that_do_not_hash_to_the_vouched_state(
    corpus: Any, caplog: pytest.LogCaptureFixture
) -> None:
    trainer = make_trainer(corpus)
    trainer.step = 6
    vouched = donor_state(trainer, 6, 1).fragments[0].sha256()
    forged = OuterState(6, {p: s.clone() for p, s in enumerate(trainer.sync.states)})
    forged.fragments[0].outer.zero_()
    forged.fragments[0].version = 1
    before = trainer.sync.states[0].clone()
    swarm = FakeSwarm(
        [record("donor", 6, (0, 1, vouched), *initial_entries(trainer, skip=0))],
        {"donor": forged},
        vouches_for(0, 1, vouched, "donor", "x"),
    )
    healer, events = make_healer(trainer, swarm, workers=("donor", "x"))
    healer.maybe_heal([])
    with caplog.at_level("WARNING"):
        assert finish_check(healer, swarm) == [([0], ["donor"])]
    assert trainer.sync.states[0].sha256() == before.sha256() and not events
    assert "peer donor: download refused: a forged state: fragment 0 at version 1" in caplog.text
    assert 0 in healer.diverged  # checked again soon


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


def test_healer_periodic_check_hashes_no_unchanged_fragment(
    corpus: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hashes a check compares come from the outer loop's cache, which the node's
    record fills at every step: a check every H steps re-hashes nothing that did not
    change (the whole outer state, each time, before)."""
    trainer = make_trainer(corpus)
    trainer.step = 6  # a periodic check of every fragment is due
    cached = [trainer.sync.state_hash(p) for p in range(trainer.sync.num_fragments)]
    ours = {id(s) for s in trainer.sync.states}
    hashed = []
    honest = FragmentState.sha256

    def counted(state: FragmentState) -> str:
        hashed.append(id(state) in ours)
        return honest(state)

    monkeypatch.setattr(FragmentState, "sha256", counted)
    healer, _ = make_healer(trainer, FakeSwarm([], {}))
    hashed.clear()  # the healer hashes the initial state once, when built
    healer.maybe_heal([])
    assert healer.checking == list(range(trainer.sync.num_fragments))
    assert not any(hashed)
    assert trainer.sync.state_hash(0) == cached[0] == honest(trainer.sync.states[0])


def test_healer_checks_a_fragment_once_after_a_round_and_follows_the_majority(
    corpus: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The chaos run's split: we applied round 1 of fragment 0 "successfully"
    from another prior state than the round's other members, who vouch for another state
    at version 1; the check after the round (not only after failures) heals us to theirs."""
    monkeypatch.setattr("diloco.node.swarm.healing.VERIFY_AFTER", 0.0)
    trainer = make_trainer(corpus)
    trainer.step = 8  # not a multiple of H: no periodic check
    served = donor_state(trainer, 8, 1)
    majority = served.fragments[0].sha256()
    others = initial_entries(trainer, skip=0)
    swarm = FakeSwarm(
        [record("donor", 8, (0, 1, majority), *others), record("x", 8, (0, 1, majority), *others)],
        {"donor": served},
        vouches_for(0, 1, majority, "donor", "x", "me"),
    )
    healer, events = make_healer(trainer, swarm, workers=("donor", "x"))
    healer.maybe_heal([])
    assert healer.future is None  # nothing moved, nothing failed: no check
    mine = trainer.sync.states[0]
    mine.outer.add_(0.25)  # our round result, from our own prior state
    mine.version = 1
    healer.maybe_heal([])
    assert healer.checking == [0]
    assert finish_check(healer, swarm) == [([0], ["donor"])]
    assert trainer.sync.states[0].sha256() == majority
    assert events == [{"event": "healed", "step": 8, "fragments": [0]}]


def test_healer_lagging_node_skips_to_its_anchors_step_before_any_vouch(corpus: Any) -> None:
    trainer = make_trainer(corpus)
    trainer.step = 12
    mine = initial_entries(trainer)
    swarm = FakeSwarm([record("fast", 30, *mine), record("faster", 36, *mine)], {})
    healer, events = make_healer(trainer, swarm, anchors=["fast"])
    behind: list[int] = []
    healer.on_behind = lambda: behind.append(trainer.step)
    healer.maybe_heal([])
    assert finish_check(healer, swarm) == []  # in line on every fragment: nothing to fetch
    assert trainer.step == 30  # the peer it joined through, not the furthest claim
    assert {"event": "caught_up", "from_step": 12, "to_step": 30} in events
    assert behind == [12]  # told before it moved: its rounds led alone were late ones
    # Version 0 after step 30: every fragment missed its rounds, all suspect now.
    assert set(healer.suspects) == set(range(trainer.sync.num_fragments))


def test_skip_target_stops_before_a_send_step_the_swarm_just_passed() -> None:
    # H 100, 5 fragments: fragment p sends at 20 p + 100 k
    assert skip_target(117, 120, 100, 5) == 119  # the swarm at the send step of 120
    assert skip_target(137, 141, 100, 5) == 139  # one step past the send step of 140
    assert skip_target(137, 142, 100, 5) == 139  # two
    assert skip_target(137, 143, 100, 5) == 143  # three: that round formed without us
    assert skip_target(103, 115, 100, 5) == 115  # no send step between
    assert skip_target(119, 121, 100, 5) == 119  # the next step sends: no skip at all


def test_healer_lagging_node_trains_the_send_step_the_swarm_just_passed(corpus: Any) -> None:
    trainer = make_trainer(corpus)
    h, fragments = trainer.run.outer.sync_every, trainer.sync.num_fragments
    sends = {send_step(p, k, h, fragments) for p in range(fragments) for k in range(1, 10)}
    # a step after which one step sends nothing and the next sends: the swarm one past that
    step = next(s for s in range(1, 30) if s + 1 not in sends and s + 2 in sends)
    trainer.step = step
    swarm = FakeSwarm([record("fast", step + 3, *initial_entries(trainer))], {})
    healer, events = make_healer(trainer, swarm, anchors=["fast"])
    healer.diverged.add(0)  # a check now (not a periodic step)
    healer.maybe_heal([])
    assert finish_check(healer, swarm) == []
    assert trainer.step == step + 1  # it trains the send step, and sends
    assert {"event": "caught_up", "from_step": step, "to_step": step + 1} in events


def test_healer_lagging_node_takes_the_vouchers_step_not_the_sybils(corpus: Any) -> None:
    trainer = make_trainer(corpus)
    trainer.step = 12
    # H 6: the two members that vouched are at step 30 (the pace); steps up to 30 + 2H = 42
    # are plausible, so five Sybils at 36 outnumber them among the plausible records.
    served = donor_state(trainer, 30, 4)
    h = served.fragments[0].sha256()
    others = initial_entries(trainer, skip=0)
    honest = [record(peer, 30, (0, 4, h), *others) for peer in ("a", "b")]
    sybils = [record(f"s{i}", 36, (0, 4, h), *others) for i in range(5)]
    swarm = FakeSwarm([*sybils, *honest], {"a": served}, vouches_for(0, 4, h, "a", "b"))
    healer, events = make_healer(trainer, swarm, workers=("a", "b"))
    healer.maybe_heal([])
    # The members that vouched are tried first: Sybils copying their claim come last.
    assert finish_check(healer, swarm) == [([0], ["a"])]
    assert {"event": "caught_up", "from_step": 12, "to_step": 30} in events
    assert trainer.step == 30 and trainer.sync.states[0].sha256() == h


def test_healer_join_takes_the_robust_step_and_settles_rounds_in_flight(corpus: Any) -> None:
    trainer = make_trainer(corpus)
    # H 6, 5 fragments (offsets 0..4): fragment 0 sent round 1 at step 6, during the download.
    initial = OuterState(6, {p: s.clone() for p, s in enumerate(trainer.sync.states)})
    landed = donor_state(trainer, 8, 1)
    h = landed.fragments[0].sha256()
    swarm = FakeSwarm(
        [record("old", 7, *initial_entries(trainer)), record("new", 6, (0, 1, h))],
        {"old": initial, "new": landed},
        vouches_for(0, 1, h, "new", "x"),
    )
    healer, _ = make_healer(trainer, swarm, anchors=["new"])
    healer.join(deadline=time.monotonic() + 30)
    # "new" publishes fragment 0 only: the joiner downloads all from "old", and starts at
    # the step of its anchor (6), not at its donor's claim (7).
    assert swarm.asked == [(list(range(trainer.sync.num_fragments)), ["old"])]
    assert trainer.step == 6 and trainer.sync.states[0].version == 0
    healer.settle_rounds_in_flight(deadline=time.monotonic() + 30)
    assert swarm.asked[1:] == [([0], ["new"])]
    assert trainer.sync.states[0].version == 1
    assert torch.equal(trainer.sync.states[0].outer, landed.fragments[0].outer)


class TrainingOnSwarm(FakeSwarm):
    """A swarm whose records move on to ``later`` while a download runs."""

    def __init__(self, later: list[NodeRecord], *args: Any) -> None:
        super().__init__(*args)
        self.later = later

    def fetch_state(
        self, fragments: Sequence[int], expected_numel: Mapping[int, int], donors: Sequence[str]
    ) -> OuterState:
        state = super().fetch_state(fragments, expected_numel, donors)
        self.records = self.later
        return state


def test_healer_join_starts_at_the_step_the_swarm_reached_during_the_download(
    corpus: Any,
) -> None:
    trainer = make_trainer(corpus)
    initial = OuterState(5, {p: s.clone() for p, s in enumerate(trainer.sync.states)})
    entries = initial_entries(trainer)
    swarm = TrainingOnSwarm(
        [record("creator", 11, *entries)], [record("creator", 5, *entries)], {"creator": initial}
    )
    healer, _ = make_healer(trainer, swarm, anchors=["creator"])
    healer.join(deadline=time.monotonic() + 30)
    assert trainer.step == 11  # read after the download, not the 5 read before it


def test_healer_join_downloads_one_fragment_before_the_first_round(corpus: Any) -> None:
    """Every record holds every fragment at version 0 under the run's initial hash: the
    joiner built that state itself from the run's seed, so it downloads only the smallest
    fragment, which tells the donor that a peer starts from its state (before, the
    creator's upload carried the whole model to every joiner at the run's start), and
    starts at the records' step."""
    trainer = make_trainer(corpus)
    initial = OuterState(5, {p: s.clone() for p, s in enumerate(trainer.sync.states)})
    sizes = [s.outer.numel() for s in trainer.sync.states]
    entries = initial_entries(trainer)
    swarm = FakeSwarm([record("creator", 5, *entries)], {"creator": initial})
    healer, _ = make_healer(trainer, swarm, anchors=["creator"])
    healer.join(deadline=time.monotonic() + 30)
    assert swarm.asked == [([sizes.index(min(sizes))], ["creator"])]
    assert min(sizes) < sum(sizes) / len(sizes)  # a smaller download than before
    assert [s.sha256() for s in trainer.sync.states] == [h for _, _, h in entries]
    assert trainer.step == 5


def test_healer_join_skips_a_donor_whose_state_is_not_the_vouched_one(
    corpus: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Round 1 of fragment 2 (sent at step 8) was applied: the joiner downloads that
    fragment alone (the others are at the initial state, its own). The first donor serves
    it at version 0 and not the run's initial weights: refused and named; the next one's
    is adopted."""
    trainer = make_trainer(corpus)
    landed = donor_state(trainer, 10, 1).fragments[2]
    honest = OuterState(10, {p: s.clone() for p, s in enumerate(trainer.sync.states)})
    honest.fragments[2] = landed
    zeros = donor_state(trainer, 10, 0)  # version 0, but not the run's initial weights
    h = landed.sha256()
    entries = [*initial_entries(trainer, skip=2), (2, 1, h)]
    swarm = FakeSwarm(
        [record("forger", 10, *entries), record("honest", 10, *entries)],
        {"forger": zeros, "honest": honest},
        vouches_for(2, 1, h, "forger", "honest"),
    )
    healer, _ = make_healer(trainer, swarm, anchors=["honest"], workers=("forger", "honest"))
    expected = [h0 for _, _, h0 in initial_entries(trainer)]
    expected[2] = h
    with caplog.at_level("WARNING"):
        healer.join(deadline=time.monotonic() + 30)
    assert swarm.asked == [([2], ["forger"]), ([2], ["honest"])]
    assert [s.sha256() for s in trainer.sync.states] == expected
    assert trainer.step == 10
    assert "peer forger: download refused: a forged state: fragment 2 at version 0" in caplog.text


def test_healer_adopting_a_newer_round_moves_on_to_its_send_step(corpus: Any) -> None:
    trainer = make_trainer(corpus)
    trainer.step = 3
    # H 6, 5 fragments: round 1 of fragment 1 is sent at step 7, of fragment 0 at step 6.
    newer = donor_state(trainer, 8, 1)
    healer, events = make_healer(trainer, FakeSwarm([], {}))
    behind: list[int] = []
    healer.on_behind = lambda: behind.append(trainer.step)
    assert healer.adopt(OuterState(8, {1: newer.fragments[1]})) == [1]
    assert trainer.step == 7 and trainer.sync.states[1].version == 1
    assert events == [{"event": "caught_up", "from_step": 3, "to_step": 7}]
    assert behind == [3]
    assert healer.suspects == {0: 1}  # round 1 of fragment 0, sent at 6, was skipped


def test_healer_adopts_a_fragment_whose_round_in_flight_failed_on_a_diverged_prior(
    corpus: Any,
) -> None:
    """The node missed round 1 of fragment 0 and its round 2 found no partner of its prior
    (``PriorDiverged``) before its receive step: healing adopts the vouched state at once,
    and that failed round's tokens are not carried (the adopted state holds the round)."""
    from concurrent.futures import Future

    from diloco.errors import PriorDiverged

    trainer = make_trainer(corpus)
    trainer.step = 12  # fragment 0 sent round 2 here; received at 13
    failed: Future[Any] = Future()
    failed.set_exception(PriorDiverged(0, 2, "no partner", "ab" * 8))
    trainer.sync.submit(RoundKey(0, 2), failed, 12, 5.0)
    served = donor_state(trainer, 12, 1)
    vouched = served.fragments[0].sha256()
    swarm = FakeSwarm(
        [record("donor", 12, (0, 1, vouched), *initial_entries(trainer, skip=0))],
        {"donor": served},
        vouches_for(0, 1, vouched, "donor", "x"),
    )
    healer, events = make_healer(trainer, swarm, workers=("donor", "x"))
    healer.maybe_heal(list(trainer.sync.diverged()))
    assert finish_check(healer, swarm) == [([0], ["donor"])]
    assert trainer.sync.states[0].version == 1 and 0 not in healer.diverged
    assert events == [{"event": "healed", "step": 12, "fragments": [0]}]
    assert trainer.sync.pending[0].weight == 0.0


def test_healer_refuses_a_state_only_paper_keys_vouch_for_and_names_them_once(
    corpus: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Two keys that never worked with this node vouch for a newer state under a member list
    of their own (a majority of it, which made it adoptable before): nothing is fetched,
    each key is named once, and the node neither heals nor moves its step."""
    trainer = make_trainer(corpus)
    trainer.step = 6
    served = donor_state(trainer, 36, 4)
    forged = served.fragments[0].sha256()
    others = initial_entries(trainer, skip=0)
    papers = [record(f"s{i}", 36, (0, 4, forged), *others) for i in range(2)]
    honest = record("partner", 6, *initial_entries(trainer))
    swarm = FakeSwarm(
        [*papers, honest],
        {"s0": served, "s1": served},
        vouches_for(0, 4, forged, "s0", "s1"),
    )
    healer, events = make_healer(trainer, swarm, anchors=["partner"], workers=("partner",))
    with caplog.at_level("WARNING"):
        for _ in range(2):
            healer.maybe_heal([])
            assert finish_check(healer, swarm) == []
            trainer.step += 6  # a periodic check again
    assert not events and trainer.sync.states[0].version == 0
    refused = [m for m in caplog.messages if m.startswith("not counting the vouches of peer")]
    assert sorted(refused) == [
        f"not counting the vouches of peer {s} (no round with this node): fragment 0 round 4 "
        f"hash {forged[:16]}... is not adoptable on the word of peers this node has not seen "
        "work"
        for s in ("s0", "s1")
    ]


def test_healer_refuses_a_round_without_the_live_creator_until_it_worked_with_others(
    corpus: Any,
) -> None:
    """A joiner applies no round its creator is not in while the creator is live and has
    vouched for no round with others: it could not heal from joiners it never worked with."""
    trainer = make_trainer(corpus)
    boss = Identity.generate().peer_id
    trainer.run = dataclasses.replace(trainer.run, creator=boss)
    swarm = FakeSwarm([record(boss, 10, *initial_entries(trainer))], {})
    healer, _ = make_healer(trainer, swarm, anchors=[boss])
    assert healer.refusal(RoundResult(torch.zeros(1), ("j1", "me"), 0, 0, 0.0)) is None  # unread
    healer.read_view()
    without = RoundResult(torch.zeros(1), ("j1", "me"), 0, 0, 0.0)
    assert healer.refusal(without) is not None
    assert healer.refusal(RoundResult(torch.zeros(1), (boss, "me"), 0, 0, 0.0)) is None
    swarm.vouches = vouches_for(0, 1, A, boss, "j2")  # it worked with another joiner
    healer.read_view()
    assert healer.refusal(without) is None
    swarm.vouches, swarm.records = [], []  # a fresh healer: the creator left
    healer, _ = make_healer(trainer, swarm, anchors=[boss])
    healer.read_view()
    assert healer.refusal(without) is None
