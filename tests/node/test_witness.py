"""The witness ledger: who this node saw work, on hand-made rounds."""

from __future__ import annotations

from diloco.node.evidence.witness import Witness, WitnessedRound

H = "1" * 64


def test_workers_are_the_other_members_of_rounds_this_node_was_counted_in() -> None:
    witness = Witness("me")
    witness.record(WitnessedRound(0, 1, ("a", "me"), H))
    witness.record(WitnessedRound(1, 1, ("a", "b"), H))  # sat out: proves nothing to it
    assert witness.workers() == {"a"}
    assert witness.rounds_with("a") == 1 and witness.rounds_with("b") == 0


def test_a_peer_fades_once_it_stops_working_with_this_node() -> None:
    witness = Witness("me", horizon=2)
    witness.record(WitnessedRound(0, 1, ("a", "me"), H))
    witness.record(WitnessedRound(1, 1, ("b", "me"), H))
    witness.record(WitnessedRound(2, 1, ("b", "me"), H))
    assert witness.workers() == {"b"} and len(witness.rounds()) == 2


def test_rounds_of_one_leave_the_peers_it_worked_with_in_the_ledger() -> None:
    # Alone in the run for longer than the horizon: its rounds of one witness nobody, and
    # must not push out the rounds it shared with peers (whose word counts in healing).
    witness = Witness("me", horizon=2)
    witness.record(WitnessedRound(0, 1, ("a", "me"), H))
    witness.record(WitnessedRound(1, 1, ("b", "me"), H))
    for k in range(2, 6):
        witness.record(WitnessedRound(0, k, ("me",), H))
    assert witness.workers() == {"a", "b"}
    assert [(r.fragment, r.round) for r in witness.rounds()] == [(0, 1), (1, 1)]


def test_a_round_restored_from_a_checkpoint_witnesses_nobody() -> None:
    # A resumed node counts its anchors until its next round (docs/design.md "Evidence"):
    # the round its checkpoint held in flight, with a partner that may be gone, is no such.
    witness = Witness("me")
    witness.restored = frozenset({(0, 2)})
    witness.record(WitnessedRound(0, 2, ("a", "me"), H))
    assert witness.workers() == frozenset()
    witness.record(WitnessedRound(1, 2, ("a", "me"), H))
    assert witness.workers() == {"a"}
