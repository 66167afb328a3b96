"""The pace from evidence (docs/design.md "Pace"): whose claimed step seconds a node counts.

Each test is one node's decision: its own full-batch step seconds, the live records' claims,
and the rounds it applied (a real ``Witness``, fed as ``SwarmNode._vouch`` feeds it); the
node's rows come from a ``PaceController`` given the counted claims, as the trainer does.
Expected rows are computed by hand. The attacks (paper keys, a working peer whose claim
contradicts its tokens, a liar paired with one honest node) each shrink the node's rows to
1 under the former rule (the lower median of every record's claim).
"""

from __future__ import annotations

import logging

import pytest

from diloco.codecs import get_codec
from diloco.node.config import NodeOptions, RunConfig
from diloco.node.data.corpus import load_corpus
from diloco.node.evidence.witness import Witness, WitnessedRound
from diloco.node.training.outer_config import OuterConfig
from diloco.node.training.pace import SETTLE_STEPS, PaceController, weigh_claims
from diloco.node.training.trainer import NodeTrainer
from diloco.protocol.core.reducer import InProcessReducer

BATCH, SEQ_LEN, H = 8, 128, 30
ROW = SEQ_LEN * H
"""Tokens one row per step adds to a round: a full batch's round weighs 8 x 3840."""
ME = "me"
FAST = 1e-6
"""The step seconds the attackers claim."""


def witness(weights: dict[str, list[float]], rounds: int = 3) -> Witness:
    """A ledger of ``rounds`` rounds this node applied with the given peers: peer -> its
    weights, one per round (a shorter list: the peer missed the earlier rounds)."""
    ledger = Witness(ME)
    for k in range(rounds):
        present = {p: w[k - rounds + len(w)] for p, w in weights.items() if k >= rounds - len(w)}
        members = (ME, *present)
        ledger.record(WitnessedRound(k % 2, k, members, f"sha{k}", {ME: BATCH * ROW, **present}))
    return ledger


def share(own_seconds: float, claims: dict[str, float], ledger: Witness) -> float:
    """This node's share (rows a step on average) after settling at ``own_seconds`` per
    full-batch step, counting the claims its ledger backs (``NodeTrainer.hear_claims``,
    then ``_pace``)."""
    controller = PaceController(BATCH)
    for _ in range(2 * SETTLE_STEPS):
        seconds = own_seconds * controller.rows / BATCH  # step time proportional to rows
        evidence = weigh_claims(claims, ledger.weights(), own_seconds, BATCH, ROW)
        controller.observe(seconds, list(evidence.counted.values()))
    return controller.share


def paper(k: int) -> dict[str, float]:
    return {f"paper{i}": FAST for i in range(k)}


@pytest.mark.parametrize("k", range(1, 9))
@pytest.mark.parametrize("twin", [False, True], ids=["alone", "with-twin"])
def test_paper_keys_change_no_rows(k: int, twin: bool) -> None:
    # Former rule: alone, the lower median of k x 1e-6 and 1.0 is 1e-6 -> 1 row for any k;
    # with an honest twin at 1.0, from k = 2 on.
    honest = {"twin": 1.0} if twin else {}
    ledger = witness({"twin": [BATCH * ROW] * 3} if twin else {})
    claims = {**honest, **paper(k)}
    assert share(1.0, claims, ledger) == BATCH
    evidence = weigh_claims(claims, ledger.weights(), 1.0, BATCH, ROW)
    assert evidence.counted == honest
    assert set(evidence.ignored) == set(paper(k))
    assert all(why == "no round with this node" for why in evidence.ignored.values())


def test_working_peer_whose_claim_contradicts_its_tokens_is_ignored() -> None:
    # It claims 1e-6 s (a full batch of 8 rows at any pace) but its rounds weigh 1 row per
    # step: 8 > 2 x 1 + 1. Former rule: lower median of [1e-6, 1.0] -> 1 row.
    ledger = witness({"liar": [ROW] * 3})
    assert share(1.0, {"liar": FAST}, ledger) == BATCH
    evidence = weigh_claims({"liar": FAST}, ledger.weights(), 1.0, BATCH, ROW)
    assert evidence.counted == {}
    assert "1.00 rows per step" in evidence.ignored["liar"]


def test_two_contradicted_liars_beside_an_honest_twin_change_no_rows() -> None:
    # Former rule: lower median of [1e-6, 1e-6, 1.0, 1.0] -> 1e-6 -> 1 row.
    ledger = witness({"twin": [BATCH * ROW] * 3, "l1": [ROW] * 3, "l2": [2 * ROW] * 3})
    claims = {"twin": 1.0, "l1": FAST, "l2": FAST}
    assert share(1.0, claims, ledger) == BATCH


def test_claiming_slow_with_full_batch_tokens_is_ignored() -> None:
    # 4.0 s at the pace 1.0 implies floor(8 / 4) = 2 rows; its rounds show 8: 8 > 2 x 2 + 1.
    ledger = witness({"twin": [BATCH * ROW] * 3, "slowpoke": [BATCH * ROW] * 3})
    evidence = weigh_claims({"twin": 1.0, "slowpoke": 4.0}, ledger.weights(), 1.0, BATCH, ROW)
    assert evidence.counted == {"twin": 1.0}
    assert set(evidence.ignored) == {"slowpoke"}


def test_the_band_is_twice_the_implied_rows_plus_one() -> None:
    # Implied 2 rows (4.0 s at the pace 1.0): 5 rows shown agree (5 <= 2 x 2 + 1), 6 do not.
    for shown, counted in ((5, True), (6, False), (2, True), (1, True)):
        ledger = witness({"twin": [BATCH * ROW] * 3, "c": [shown * ROW] * 3})
        evidence = weigh_claims({"twin": 1.0, "c": 4.0}, ledger.weights(), 1.0, BATCH, ROW)
        assert ("c" in evidence.counted) is counted, shown


def test_a_liar_paired_with_one_honest_node_cannot_shrink_its_rows() -> None:
    # Its tokens agree with its claim (a full batch), so only the rule can stop it: the
    # upper median of [1e-6, 1.0] is 1.0. Former rule: 1e-6 -> 1 row.
    ledger = witness({"liar": [BATCH * ROW] * 3})
    assert weigh_claims({"liar": FAST}, ledger.weights(), 1.0, BATCH, ROW).counted == {"liar": FAST}
    assert share(1.0, {"liar": FAST}, ledger) == BATCH


@pytest.mark.parametrize(("liars", "expected"), [(1, 8), (2, 8), (3, 8), (4, 1)])
def test_working_liars_up_to_half_cannot_shrink_rows_a_majority_can(
    liars: int, expected: int
) -> None:
    # This node and two honest twins at 1.0 s, and ``liars`` working liars claiming 1e-6
    # with full-batch tokens: the upper median of 3 + liars figures is 1.0 while liars <= 3
    # (half of 6), 1e-6 with 4 of 7 -> 1 row (docs/design.md "Pace": what a majority does).
    liar_ids = [f"liar{i}" for i in range(liars)]
    ledger = witness({p: [BATCH * ROW] * 3 for p in ["t1", "t2", *liar_ids]})
    claims = {"t1": 1.0, "t2": 1.0, **dict.fromkeys(liar_ids, FAST)}
    assert share(1.0, claims, ledger) == expected


def test_a_slow_node_still_adapts_to_witnessed_fast_peers() -> None:
    # 3.0 s per full batch against two witnessed peers at 1.0 (full batches): pace 1.0,
    # 8 / 3 rows a step, as without the evidence rule.
    ledger = witness({"a": [BATCH * ROW] * 3, "b": [BATCH * ROW] * 3})
    assert share(3.0, {"a": 1.0, "b": 1.0}, ledger) == pytest.approx(8 / 3)


def test_a_slow_node_keeps_its_batch_until_it_has_seen_the_fast_ones_work() -> None:
    assert share(3.0, {"a": 1.0, "b": 1.0}, witness({})) == BATCH


def test_fast_nodes_count_a_slow_peer_whose_tokens_match_its_rows() -> None:
    # c at 2 rows: 4.0 s per full batch; at the pace 1.0 that implies floor(8 / 4) = 2 rows,
    # and its rounds weigh 2 rows per step. The fast node's own rows stay 8.
    ledger = witness({"b": [BATCH * ROW] * 3, "c": [2 * ROW] * 3})
    claims = {"b": 1.0, "c": 4.0}
    assert weigh_claims(claims, ledger.weights(), 1.0, BATCH, ROW).counted == claims
    assert share(1.0, claims, ledger) == BATCH


def test_a_peers_rows_are_read_from_its_newest_rounds() -> None:
    # c trained 8 rows, then 2 (it adapted): the median of its last 3 rounds is 2 rows.
    ledger = witness({"b": [BATCH * ROW] * 6, "c": [BATCH * ROW] * 3 + [2 * ROW] * 3}, 6)
    assert "c" in weigh_claims({"b": 1.0, "c": 4.0}, ledger.weights(), 1.0, BATCH, ROW).counted


def test_witness_weights_are_the_peers_not_this_nodes() -> None:
    ledger = Witness(ME)
    ledger.record(WitnessedRound(0, 1, (ME, "a"), "x", {ME: 5.0, "a": 7.0}))
    ledger.record(WitnessedRound(1, 1, (ME, "a", "b"), "y"))  # no weights carried
    ledger.record(WitnessedRound(0, 2, ("a", "b"), "z", {"a": 9.0, "b": 9.0}))  # not ours
    ledger.record(WitnessedRound(1, 2, (ME, "b"), "w", {ME: 5.0, "b": 3.0, "ghost": 1.0}))
    assert ledger.weights() == {"a": [7.0], "b": [3.0]}


def test_trainer_counts_backed_claims_and_logs_each_ignored_peer_once(caplog) -> None:
    run = RunConfig(steps=4, seq_len=SEQ_LEN, outer=OuterConfig(sync_every=H))
    trainer = NodeTrainer(
        run,
        NodeOptions(batch_size=BATCH),
        InProcessReducer(get_codec("none")),
        ME,
        load_corpus(None),
    )
    ledger = witness({"twin": [BATCH * ROW] * 3, "liar": [ROW] * 3})
    claims = {"twin": 1.0, "liar": FAST, **paper(2)}
    with caplog.at_level(logging.INFO, logger="diloco.node.training.trainer"):
        for _ in range(3):  # every publish
            trainer.hear_claims(claims, ledger.weights())
    assert trainer.peer_step_seconds == (1.0,)
    logged = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert len(logged) == 3  # once per ignored peer, not once per publish
    assert sum(level == logging.WARNING and "liar" in m for level, m in logged) == 1
    assert sum(level == logging.INFO and "no round with this node" in m for level, m in logged) == 2
