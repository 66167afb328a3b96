"""The run's end (``diloco.node.swarm.run_end``), against the fake swarm of ``test_healing``:
a node that lacks a fragment's last round heals it before it leaves, waiting for the peers'
final records while they are in the run; a node that holds it stays while a peer whose word
counts lacks it.

The run of ``make_trainer``: 40 steps, H 6, 5 fragments; every fragment's last round is
round 6 (fragment 0 sends it at step 36, fragment 4 at step 40)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from test_before_send import LateSwarm
from test_healing import FakeSwarm, make_healer, make_trainer, record, vouches_for

from diloco.node.data.corpus import load_corpus
from diloco.node.swarm.run_end import behind_peers, end_wait_seconds, heal_at_end, linger
from diloco.node.training.trainer import NodeTrainer
from diloco.protocol.records.nodes import FragmentVersion, NodeRecord, Vouch
from diloco.protocol.state.fragment import FragmentState, OuterState

WAIT = 30.0
"""Seconds the end may wait: far beyond what the fake swarm takes, so that a test that ends
sooner ended because there was nothing left to wait for, not because time ran out."""
LAST = 6


@pytest.fixture(scope="module")
def corpus() -> Any:
    return load_corpus(None)


@pytest.fixture(autouse=True)
def fast_polls(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reads every 10 ms: the tests count reads, not seconds."""
    for module in ("run_end", "healing"):
        monkeypatch.setattr(f"diloco.node.swarm.{module}.VOUCH_POLL", 0.01)
    monkeypatch.setattr("diloco.node.swarm.run_end.LINGER_POLL", 0.01)


def at_the_end(trainer: NodeTrainer, fragment_0: int) -> list[tuple[int, int, str]]:
    """The trainer at the run's last step with every fragment at its last round but
    fragment 0 (at ``fragment_0``); its record entries but fragment 0's."""
    trainer.step = 40
    for p, s in enumerate(trainer.sync.states):
        s.version = fragment_0 if p == 0 else LAST
    return [(p, LAST, trainer.sync.state_hash(p)) for p in range(1, 5)]


def last_round_elsewhere(trainer: NodeTrainer) -> tuple[OuterState, str, list[NodeRecord]]:
    """Peers "donor" and "x" applied fragment 0's last round and vouch for it; their final
    records (both at the run's end)."""
    base = trainer.sync.states[0]
    served = FragmentState(torch.full_like(base.outer, 0.5), torch.full_like(base.outer, 0.1), LAST)
    vouched = served.sha256()
    others = at_the_end(trainer, LAST - 1)
    records = [record(peer, 40, (0, LAST, vouched), *others) for peer in ("donor", "x")]
    return OuterState(40, {0: served}), vouched, records


class Reads:
    """Records handed out in turn, the last one for good."""

    def __init__(self, *reads: Sequence[NodeRecord]) -> None:
        self.reads, self.count = list(reads), 0

    def __call__(self) -> list[NodeRecord]:
        self.count += 1
        return list(self.reads[min(self.count, len(self.reads)) - 1])


class ChangingSwarm(FakeSwarm):
    """A fake swarm whose records change from one read to the next (``Reads``)."""

    def __init__(
        self, reads: Reads, states: dict[str, OuterState], vouches: Sequence[Vouch]
    ) -> None:
        super().__init__([], states, vouches)
        self.reads = reads

    @property
    def record_reads(self) -> int:
        return self.reads.count

    def read_records(self) -> list[NodeRecord]:
        return self.reads()


def test_behind_peers_counts_workers_that_lack_a_version() -> None:
    mine = [6, 6]
    in_line = [(0, 6, "a" * 64), (1, 6, "b" * 64)]
    lacking = [(0, 5, "c" * 64), (1, 6, "b" * 64)]
    records = [
        record("w1", 40, *lacking),  # a worker at the end without fragment 0's last round
        record("w2", 40, *in_line),  # a worker in line
        record("w3", 12, *lacking),  # a worker whose last record is from step 12
        record("s", 40, *lacking),  # a key never seen working
        record("w4", 40, (1, 6, "b" * 64)),  # publishes no version of fragment 0
    ]
    voters = frozenset({"w1", "w2", "w3", "w4"})
    assert behind_peers(records, mine, voters) == ["w1", "w3"]
    assert behind_peers(records, [5, 6], voters) == []
    assert behind_peers(records, [6, 7], voters) == ["w1", "w2", "w3", "w4"]


def test_the_end_waits_past_its_deadline_and_the_peers_work_by_default() -> None:
    # the default window (2 s) and round timeout (10 s), then a read, a download and
    # two waits for vouches of 8 s each
    assert end_wait_seconds(2.0, 10.0) == pytest.approx(28.0)


def test_a_node_that_missed_the_last_round_heals_it_when_the_peers_records_come(
    corpus: Any,
) -> None:
    """Fragment 0's last round failed for this node; the peers that applied it publish
    their final records two reads later (they were still applying it: their records are
    those of their last step). The node waits for them, then adopts the vouched state
    before its final evaluation."""
    trainer = make_trainer(corpus)
    stale = trainer.sync.state_hash(0)
    served, vouched, records = last_round_elsewhere(trainer)
    vouches = vouches_for(0, LAST, vouched, "donor", "x")
    before = [
        dataclasses.replace(r, fragments=(FragmentVersion(0, LAST - 1, stale), *r.fragments[1:]))
        for r in records
    ]
    swarm = ChangingSwarm(Reads(before, before, records), {"donor": served}, vouches)
    healer, events = make_healer(trainer, swarm, workers=("donor", "x"))
    heal_at_end(healer, WAIT, lambda: False)
    state = trainer.sync.states[0]
    assert state.version == LAST and state.sha256() == vouched
    assert torch.equal(state.outer, served.fragments[0].outer)
    assert swarm.record_reads == 3
    assert {"event": "healed", "step": 40, "fragments": [0]} in events
    end = [e for e in events if e["event"] == "end_heal"]
    assert len(end) == 1 and end[0]["missed"] == [0] and end[0]["still_missing"] == []
    assert end[0]["healed"] == 1 and trainer.blocked_seconds == end[0]["seconds"]


def test_a_last_round_that_failed_for_everyone_is_waited_for_until_the_peers_are_done(
    corpus: Any,
) -> None:
    """Everyone's last round of fragment 0 failed: the peers' records stay at its version
    before. The node cannot tell that from results not out yet, so it reads again while
    they are still busy, and stops at the read that finds them done (their final records),
    keeping its state. Before, it waited for them to leave, and they for it, to the bound."""
    trainer = make_trainer(corpus)
    others = at_the_end(trainer, LAST - 1)
    before = trainer.sync.state_hash(0)
    busy = [record(p, 40, (0, LAST - 1, before), *others) for p in ("donor", "x")]
    done = [r.as_done() for r in busy]
    swarm = ChangingSwarm(Reads(busy, busy, done), {}, ())
    healer, events = make_healer(trainer, swarm, workers=("donor", "x"))
    heal_at_end(healer, WAIT, lambda: False)
    assert swarm.record_reads == 3 and swarm.asked == []
    assert trainer.sync.state_hash(0) == before
    assert [(e["healed"], e["still_missing"]) for e in events if e["event"] == "end_heal"] == [
        (0, [0])
    ]


def test_the_end_stops_waiting_when_the_peers_left(corpus: Any) -> None:
    trainer = make_trainer(corpus)
    others = at_the_end(trainer, LAST - 1)
    before = trainer.sync.state_hash(0)
    busy = [record(p, 40, (0, LAST - 1, before), *others) for p in ("donor", "x")]
    swarm = ChangingSwarm(Reads(busy, []), {}, ())
    healer, _ = make_healer(trainer, swarm, workers=("donor", "x"))
    heal_at_end(healer, WAIT, lambda: False)
    assert swarm.record_reads == 2 and trainer.sync.state_hash(0) == before


def test_a_node_in_line_at_the_end_reads_once_and_logs_nothing(corpus: Any) -> None:
    trainer = make_trainer(corpus)
    others = at_the_end(trainer, LAST)
    records = [record("donor", 40, (0, LAST, trainer.sync.state_hash(0)), *others)]
    swarm = LateSwarm(records, {}, ())
    healer, events = make_healer(trainer, swarm, workers=("donor", "x"))
    heal_at_end(healer, WAIT, lambda: False)
    assert swarm.record_reads == 1 and swarm.asked == [] and events == []


def test_a_stopped_node_does_not_wait_for_its_peers(corpus: Any) -> None:
    trainer = make_trainer(corpus)
    _, _, records = last_round_elsewhere(trainer)
    swarm = LateSwarm(records, {}, (), records_from=1_000)  # the records never come
    healer, events = make_healer(trainer, swarm, workers=("donor", "x"))
    heal_at_end(healer, WAIT, lambda: True)
    assert trainer.sync.states[0].version == LAST - 1
    assert [e["still_missing"] for e in events if e["event"] == "end_heal"] == [[0]]


def test_a_node_lingers_until_the_worker_that_lacked_its_state_caught_up(corpus: Any) -> None:
    trainer = make_trainer(corpus)
    others = at_the_end(trainer, LAST)
    mine = (0, LAST, trainer.sync.state_hash(0))
    lacking = record("x", 40, (0, LAST - 1, "c" * 64), *others)
    stranger = record("s", 40, (0, LAST - 1, "c" * 64), *others)
    me = record("me", 38, (0, LAST - 1, "c" * 64), *others)  # our own record, not out yet
    caught_up = record("x", 40, mine, *others)
    reads = Reads([lacking, stranger, me], [lacking, stranger, me], [caught_up, stranger, me])
    healer, _ = make_healer(trainer, LateSwarm([], {}, ()), workers=("donor", "x"))
    _, peers, behind = linger(healer, reads, WAIT, lambda: False)
    assert reads.count == 3 and peers == ["x"] and behind == []


def test_a_node_does_not_linger_for_strangers_or_when_stopped(corpus: Any) -> None:
    trainer = make_trainer(corpus)
    others = at_the_end(trainer, LAST)
    lacking = [record(p, 40, (0, LAST - 1, "c" * 64), *others) for p in ("x", "s")]
    healer, _ = make_healer(trainer, LateSwarm([], {}, ()), workers=("donor",))
    reads = Reads(lacking)
    assert linger(healer, reads, WAIT, lambda: False)[1:] == ([], [])
    healer, _ = make_healer(trainer, LateSwarm([], {}, ()), workers=("x",))
    reads = Reads(lacking)
    assert linger(healer, reads, WAIT, lambda: True)[1:] == (["x"], ["x"])
    assert reads.count == 1
