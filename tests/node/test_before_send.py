"""A fragment that lacks its last round heals before its next send
(``diloco.node.swarm.before_send``), against the fake swarm of ``test_healing``.

The chaos run's circle, in miniature: round 1 of fragment 0 failed for this node, and the
check that the failure started read the records before the peers' version 1 was out. Its
next send (round 2, at step 12; H 6) would go out from the stale prior; now the step before
it waits for the vouched state of round 1 and the round starts from it.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import pytest
import torch
from test_healing import (
    FakeSwarm,
    donor_state,
    initial_entries,
    make_healer,
    make_trainer,
    record,
    vouches_for,
)

from diloco.errors import RoundFailed
from diloco.node.data.corpus import load_corpus
from diloco.node.swarm.before_send import heal_before_send, hold_seconds, missed_before_send
from diloco.node.training.pending import PendingRound
from diloco.node.training.trainer import NodeTrainer
from diloco.protocol.core.reducer import RoundKey, RoundResult
from diloco.protocol.records.nodes import NodeRecord, Vouch
from diloco.protocol.state.fragment import OuterState

WAIT = 30.0
"""Seconds the send may be held: far beyond what the fake swarm takes, so that a test that
ends sooner ended because the healer stopped waiting, not because time ran out."""


@pytest.fixture(scope="module")
def corpus() -> Any:
    return load_corpus(None)


class LateSwarm(FakeSwarm):
    """A swarm whose records (and vouches) are out only from the ``records_from``-th read
    (and the ``vouches_from``-th): the peers applied round 1 a moment ago."""

    def __init__(
        self,
        records: list[NodeRecord],
        states: dict[str, OuterState],
        vouches: Sequence[Vouch],
        records_from: int = 1,
        vouches_from: int = 1,
    ) -> None:
        super().__init__(records, states, vouches)
        self.records_from, self.vouches_from = records_from, vouches_from
        self.record_reads = self.vouch_reads = 0

    def read_records(self) -> list[NodeRecord]:
        self.record_reads += 1
        return super().read_records() if self.record_reads >= self.records_from else []

    def read_vouches(self, fragments: Sequence[int]) -> list[Vouch]:
        self.vouch_reads += 1
        return super().read_vouches(fragments) if self.vouch_reads >= self.vouches_from else []


def round_one_applied_elsewhere(trainer: NodeTrainer, **late: int) -> tuple[LateSwarm, str]:
    """The peers "donor" and "x" applied round 1 of fragment 0 and vouch for its state."""
    served = donor_state(trainer, 11, 1)
    vouched = served.fragments[0].sha256()
    others = initial_entries(trainer, skip=0)
    records = [record("donor", 11, (0, 1, vouched), *others)]
    swarm = LateSwarm(records, {"donor": served}, vouches_for(0, 1, vouched, "donor", "x"), **late)
    return swarm, vouched


def test_missed_before_send_names_only_fragments_sent_next_that_lack_their_last_round() -> None:
    # H 6, 5 fragments: fragment 0 sends at 6, 12...; fragment 1 at 7, 13...
    assert missed_before_send(11, [0, 0, 1, 1, 1], (), 6) == {0: 1}
    assert missed_before_send(11, [1, 0, 1, 1, 1], (), 6) == {}  # in line; 1 sends at 13
    assert missed_before_send(11, [0, 0, 1, 1, 1], (0,), 6) == {}  # its round still in flight
    assert missed_before_send(12, [0, 0, 1, 1, 1], (), 6) == {1: 1}
    assert missed_before_send(4, [0, 0, 0, 0, 0], (), 6) == {}  # nothing sent yet


def test_a_fragment_that_missed_its_round_is_healed_before_it_is_sent_again(
    corpus: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    trainer = make_trainer(corpus)
    trainer.step = 7  # round 1 of fragment 0 (sent at 6) failed for us
    swarm, vouched = round_one_applied_elsewhere(trainer, records_from=2)
    healer, events = make_healer(trainer, swarm, workers=("donor", "x"))
    healer.maybe_heal([RoundKey(0, 1)])
    assert healer.future is not None
    healer.future.result(timeout=30)  # it read the records before round 1 was out
    monkeypatch.setattr("diloco.node.swarm.healing.HEAL_CHECK_EVERY", 1e9)  # no recheck
    trainer.step = 11  # the step before round 2's send
    healer.maybe_heal([])
    assert healer.future is None and trainer.sync.states[0].version == 0
    heal_before_send(healer, WAIT)
    state = trainer.sync.states[0]
    assert state.version == 1 and state.sha256() == vouched
    assert torch.equal(state.outer, swarm.states["donor"].fragments[0].outer)
    assert {"event": "healed", "step": 11, "fragments": [0]} in events
    held = [e for e in events if e["event"] == "send_held"]
    assert len(held) == 1 and held[0]["fragments"] == [0] and held[0]["still_missing"] == []
    assert trainer.blocked_seconds == held[0]["seconds"]  # the hold is no compute
    assert trainer.step == 11  # the send step itself is still to come


def test_the_send_waits_for_the_vouches_of_a_round_a_peer_already_claims(
    corpus: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The donor's record claims version 1 but its round's vouches are not out yet: not
    adoptable, so the healer reads again instead of sending from the stale prior (its
    reads, not time, bring the vouches: polled every 50 ms, not 500)."""
    for module in ("before_send", "healing"):
        monkeypatch.setattr(f"diloco.node.swarm.{module}.VOUCH_POLL", 0.05)
    trainer = make_trainer(corpus)
    trainer.step = 11
    swarm, vouched = round_one_applied_elsewhere(trainer, vouches_from=3)
    healer, _ = make_healer(trainer, swarm, workers=("donor", "x"))
    heal_before_send(healer, WAIT)
    assert trainer.sync.states[0].sha256() == vouched
    assert swarm.record_reads >= 2


def test_a_round_nobody_claims_holds_the_send_for_one_read_only(corpus: Any) -> None:
    """Round 1 failed for everyone (every record still at version 0): our state is the
    swarm's; the send goes at once, with no state fetched."""
    trainer = make_trainer(corpus)
    trainer.step = 11
    swarm = LateSwarm([record("donor", 11, *initial_entries(trainer))], {}, ())
    healer, events = make_healer(trainer, swarm, workers=("donor", "x"))
    before = trainer.sync.state_hash(0)
    heal_before_send(healer, WAIT)
    assert swarm.record_reads == 1 and swarm.asked == []
    assert trainer.sync.state_hash(0) == before
    assert [e["still_missing"] for e in events if e["event"] == "send_held"] == [[0]]


def test_a_round_the_last_check_saw_fail_everywhere_holds_nothing(corpus: Any) -> None:
    """The last check (at step 11) read a record past round 1's latest receive step (its
    send at 6 plus the longest tau auto may pick, H/2 = 3) still at version 0: the round
    failed for everyone, so the send goes without a read or a hold. Before, the hold read
    the records again: at 300 ms that read took the whole hold (1.2 s) at every such send."""
    trainer = make_trainer(corpus)
    trainer.step = 11
    swarm = LateSwarm([record("donor", 10, *initial_entries(trainer))], {}, ())
    healer, events = make_healer(trainer, swarm, workers=("donor", "x"))
    healer.read_view()  # what the last check read
    heal_before_send(healer, WAIT)
    assert swarm.record_reads == 1 and healer.future is None
    assert [e for e in events if e["event"] == "send_held"] == []


def test_a_last_check_from_before_the_latest_receive_step_still_holds_the_send(
    corpus: Any,
) -> None:
    """The same, but the record the last check read is at step 9, not past round 1's latest
    receive step: a peer with a long tau may still apply it, so the send is held for a read
    as before."""
    trainer = make_trainer(corpus)
    trainer.step = 11
    swarm = LateSwarm([record("donor", 9, *initial_entries(trainer))], {}, ())
    healer, events = make_healer(trainer, swarm, workers=("donor", "x"))
    healer.read_view()
    heal_before_send(healer, WAIT)
    assert swarm.record_reads == 2
    assert [e["still_missing"] for e in events if e["event"] == "send_held"] == [[0]]


def test_a_fragment_in_line_is_sent_without_a_check(corpus: Any) -> None:
    trainer = make_trainer(corpus)
    trainer.step = 11
    trainer.sync.states[0].version = 1  # round 1 applied: fragment 0 is in line
    swarm = LateSwarm([], {}, ())
    healer, events = make_healer(trainer, swarm)
    heal_before_send(healer, WAIT)
    assert swarm.record_reads == 0 and healer.future is None and events == []


def test_a_claim_from_a_key_never_seen_working_does_not_hold_the_send(corpus: Any) -> None:
    """A record claiming round 1 from a peer whose vouches do not count: nothing it says
    could be adopted, so waiting for it would only slow this node at every send."""
    trainer = make_trainer(corpus)
    trainer.step = 11
    swarm, _ = round_one_applied_elsewhere(trainer)
    healer, _ = make_healer(trainer, swarm, workers=("y", "z"))  # donor and x: strangers
    heal_before_send(healer, WAIT)
    assert swarm.record_reads == 1 and swarm.asked == []
    assert trainer.sync.states[0].version == 0


def test_a_hold_leaves_the_round_trips_the_node_still_needs_within_the_peers_window() -> None:
    """After a hold the node declares (2 round trips), reads (1) and JOINs (1): at 300 ms
    with a 2.4 s window, a hold of the whole window (as before) made its JOIN come after the
    peers' leader had closed the group, and its next fragments' rounds too."""
    assert hold_seconds(2.4, 0.3) == pytest.approx(1.2)
    assert hold_seconds(2.0, 0.2) == pytest.approx(1.2)
    assert hold_seconds(2.0, 0.0) == pytest.approx(2.0)  # loopback: the whole window
    assert hold_seconds(1.0, 0.3) == 0.0  # no time left: send at once


def test_a_round_refused_in_flight_is_healed_before_its_receive_step(corpus: Any) -> None:
    """Round 1 of fragment 0 (sent at step 6) was refused by its leader at once, its receive
    step is still 2 steps away, and the peers that formed it applied and vouch for it: the
    node checks now rather than at the receive step, so the heal lands sooner before the
    fragment's next send (at 300 ms it landed at that send step, held it, and the node went
    on missing rounds)."""
    trainer = make_trainer(corpus)
    trainer.step = 9
    refused: Future[RoundResult] = Future()
    refused.set_exception(RoundFailed(0, 1, "leader refused: GROUP_CLOSED group already formed"))
    trainer.sync.pending.append(PendingRound(RoundKey(0, 1), refused, receive_step=11, weight=8))
    swarm, vouched = round_one_applied_elsewhere(trainer)
    healer, events = make_healer(trainer, swarm, workers=("donor", "x"))
    healer.maybe_heal([])  # nothing applied at this step
    assert healer.future is not None and healer.checking == [0]
    healer.future.result(timeout=30)
    healer.maybe_heal([])
    state = trainer.sync.states[0]
    assert state.version == 1 and state.sha256() == vouched
    assert {"event": "healed", "step": 9, "fragments": [0]} in events
    assert trainer.sync.pending[0].weight == 0.0  # the adopted state holds that round
