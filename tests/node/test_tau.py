"""``--tau auto`` (docs/design.md "Across the internet"): the decision by hand, a change of
tau that leaves rounds in flight where they were, and replicas whose taus change mid-run
that still apply every round in order with bit-identical outer states."""

import dataclasses
import logging
from collections.abc import Sequence
from concurrent.futures import Future

import pytest
import torch
from torch import nn

from diloco.codecs import get_codec
from diloco.errors import ConfigError
from diloco.node.config import NodeOptions, RunConfig
from diloco.node.data.corpus import load_corpus
from diloco.node.model.fragments import sends_at
from diloco.node.training.local import LocalConfig, LocalTrainer
from diloco.node.training.outer import FragmentSync
from diloco.node.training.outer_config import OuterConfig
from diloco.node.training.tau import (
    TauAuto,
    nearest_rank,
    next_tau,
    target_tau,
    tau_bounds,
    tau_ceiling,
)
from diloco.node.training.trainer import NodeTrainer
from diloco.protocol.core.reducer import (
    Contribution,
    InProcessReducer,
    RoundKey,
    RoundResult,
)


@pytest.fixture(scope="module")
def corpus():
    return load_corpus(None)


def test_nearest_rank_by_hand() -> None:
    assert nearest_rank([3, 1, 2, 5, 4], 0.8) == 4  # ceil(0.8 * 5) = 4th smallest
    assert nearest_rank([8, 7, 6, 5, 4, 3, 2, 1], 0.8) == 7  # ceil(6.4) = 7th smallest
    assert nearest_rank([4, 1, 3, 2], 0.5) == 2  # the lower median
    assert nearest_rank([9], 0.8) == 9
    with pytest.raises(ValueError):
        nearest_rank([], 0.5)


def test_target_tau_by_hand() -> None:
    latencies = [1.0, 1.25, 1.5, 1.0, 1.25]  # 80th percentile: 4th of 5 sorted = 1.25
    steps = [0.125, 0.25, 0.125]  # median 0.125
    assert target_tau(latencies, steps, sync_every=30) == 11  # 1.25 / 0.125 = 10, + 1
    assert target_tau(latencies, steps, sync_every=8) == 4  # bounded to H / 2
    assert target_tau([0.0625] * 3, [0.25], sync_every=30) == 2  # within a step: 1 + 1
    assert target_tau([0.0], [0.25], sync_every=30) == 1  # never below 1
    assert tau_bounds(30) == (1, 15) and tau_bounds(7) == (1, 3)
    assert tau_bounds(2) == (1, 1) and tau_bounds(1) == (0, 0)
    assert target_tau([5.0], [0.25], sync_every=1) == 0  # H = 1 has only tau 0
    # At most max_ahead seconds of steps: 1.0 / 0.125 = 8 steps ahead of the peers.
    assert target_tau(latencies, steps, sync_every=30, max_ahead=1.0) == 8
    assert target_tau(latencies, steps, sync_every=30, max_ahead=0.0625) == 1  # still >= 1
    # Ahead by at most tau steps less the network's part of a round: (0.5 + 0.5) / 0.125.
    assert target_tau(latencies, steps, sync_every=30, max_ahead=0.5, network=0.5) == 8
    assert target_tau(latencies, steps, sync_every=30, max_ahead=1.0, network=0.5) == 11
    assert tau_ceiling(steps, 30, max_ahead=1.0, network=0.5) == 12
    assert tau_ceiling(steps, 30) == 15 and tau_ceiling(steps, 30, 0.0, 0.0) == 1


def test_next_tau_rises_at_once_and_falls_by_a_clear_margin() -> None:
    assert next_tau(3, 5) == 5
    assert next_tau(5, 5) == 5
    assert next_tau(5, 4) == 5  # one step below: jitter, keep
    assert next_tau(5, 3) == 3


def test_tau_auto_rises_after_one_round_and_falls_only_every_four() -> None:
    auto = TauAuto(sync_every=30, tau=1)
    for _ in range(3):
        auto.observe_step(0.125)
    change = auto.observe_round(1.0)  # the first slow round: 1.0 / 0.125 = 8, + 1, at once
    assert change is not None and (change.old, change.new) == (1, 9)
    assert (change.latency, change.step_seconds) == (1.0, 0.125)
    # Fast rounds: [1, .25, .25, .25] has 1.0 at its 80th percentile (4th of 4); then
    # [1, .25, .25, .25, .25] has .25 (4th of 5): 0.25 / 0.125 = 2, + 1 = 3, at least 2 below
    # 9, decided at the fourth round after the last decision, not before.
    assert [auto.observe_round(0.25) for _ in range(3)] == [None] * 3
    change = auto.observe_round(0.25)
    assert change is not None and (change.old, change.new) == (9, 3)
    assert auto.tau == 3 and auto.used == {1, 9, 3}
    # A slower round raises it again at once: [1, .25 x 4, .75] has .75 at its 80th
    # percentile (5th of 6): 6 steps, + 1.
    change = auto.observe_round(0.75)
    assert change is not None and (change.old, change.new) == (3, 7)


def test_tau_auto_counts_a_followers_join_and_not_the_wait_for_later_peers() -> None:
    """At 200 ms (a round trip measured at 0.25 s) a node leads some rounds (its peers'
    JOINs wait for it: matchmaking 0) and follows in others (JOIN -> GROUP, a round trip),
    the all-reduce 0.5 s either way; in two more rounds it waited 1.75 s for a peer behind.
    tau must hide the followed rounds, 0.75 s (the shortest matchmaking, 0, left each of
    them blocking for its JOIN), and not the wait (counting it, 2.25 s, would let this node
    run further ahead and raise tau again)."""
    auto = TauAuto(sync_every=30, tau=1, round_trip=0.25)
    auto.observe_step(0.125)
    rounds = [(0.5, 0.0), (0.75, 0.25), (0.5, 0.0), (0.75, 0.25), (2.25, 1.75)] * 2
    for seconds, matchmaking in rounds:
        auto.observe_round(seconds, matchmaking_seconds=matchmaking)
    assert list(auto.latencies) == [0.5, 0.75, 0.75, 0.5, 0.75, 0.5, 0.75, 0.75]
    assert auto.tau == 7  # 0.75 / 0.125 = 6, + 1
    assert auto.used == {1, 5, 7}  # 0.5 / 0.125 + 1 after the first round


def test_tau_auto_runs_ahead_of_its_peers_at_most_max_ahead() -> None:
    """Three rounds of 2.5 s, then one of 0.75 s: tau for the slow ones is 2.5 / 0.125 + 1
    = 21 steps, but with tau t the node runs t steps less the network's part of a round
    (0.75 s at least) ahead of its peers, which must stay within ``max_ahead``."""
    auto = TauAuto(sync_every=30, tau=1, max_ahead=0.5)
    auto.observe_step(0.125)
    for _ in range(3):
        auto.observe_round(2.5)
    assert auto.tau == 15  # the network's part so far: 2.5 s, so the bound is H / 2
    auto.observe_round(0.75)
    assert auto.network == 0.75
    assert auto.tau == 10  # (0.5 + 0.75) / 0.125, down at once: not a fall by the cadence
    auto.max_ahead = None  # no matchmaking: only H / 2
    assert auto.observe_round(2.5) is not None and auto.tau == 15


def test_tau_auto_tells_when_its_rounds_need_more_than_half_the_period() -> None:
    """Rounds of 1.75 s at 0.125 s a step need 14 + 1 = 15 steps: H/2 of 30 still hides
    them; rounds of 2.5 s need 21, beyond what tau may be."""
    auto = TauAuto(sync_every=30, tau=1)
    auto.observe_step(0.125)
    auto.observe_round(1.75)
    assert not auto.period_short and auto.tau == 15
    for _ in range(4):
        auto.observe_round(2.5)
    assert auto.period_short and auto.tau == 15


def test_tau_auto_starts_within_its_bounds() -> None:
    assert TauAuto(sync_every=6, tau=0).tau == 1  # a run of tau 0: auto overlaps at least 1
    assert TauAuto(sync_every=1, tau=0).tau == 0


def _done(numel: int) -> Future[RoundResult]:
    future: Future[RoundResult] = Future()
    future.set_result(RoundResult(torch.ones(numel), ("me", "you"), 1, 1, 0.0))
    return future


def test_a_change_of_tau_leaves_rounds_in_flight_at_their_receive_step() -> None:
    layer = nn.Linear(3, 2)
    weight, bias = list(layer.named_parameters())
    sync = FragmentSync([[weight], [bias]], OuterConfig(sync_every=4), "me", tau=1)
    sync.submit(RoundKey(0, 1), _done(6), 4, 1.0)  # tau 1: received at 5
    sync.set_tau(3)
    sync.submit(RoundKey(1, 1), _done(2), 5, 1.0)  # tau 3: received at 8
    assert [r.receive_step for r in sync.pending] == [5, 8]
    assert sync.apply_due(4) == []
    assert [r.key for r in sync.apply_due(5)] == [RoundKey(0, 1)]
    assert sync.apply_due(7) == []
    assert [r.key for r in sync.apply_due(8)] == [RoundKey(1, 1)]
    with pytest.raises(ConfigError, match="tau must satisfy"):
        sync.set_tau(4)  # tau < H keeps a fragment's rounds in order


class AutoTauTrainer(LocalTrainer):
    """Replicas whose tau follows ``TauAuto``, fed latencies as if measured: each round of
    replica m took ``LATENCIES[m]`` seconds and each step 0.125 s."""

    LATENCIES = (0.5, 0.03125)

    def __init__(self, config: LocalConfig, corpus) -> None:  # type: ignore[no-untyped-def]
        super().__init__(config, corpus)
        H = config.outer.sync_every
        self.autos = [TauAuto(H, config.tau_of(m)) for m in range(config.replicas)]
        self.seen = 0
        self.sent: dict[RoundKey, int] = {}
        self.delays: list[list[tuple[int, int]]] = [[] for _ in range(config.replicas)]
        """Per replica, (send step, receive step - send step) of each round applied."""

    def _streaming_step(self, step: int, lr: float) -> float:
        H, F = self.config.outer.sync_every, self.num_fragments
        self.sent |= {RoundKey(p, k): step for p, k in sends_at(step, H, F)}
        loss = super()._streaming_step(step, lr)
        for auto in self.autos:
            auto.observe_step(0.125)
        for m, applied in self.round_log[self.seen :]:
            self.delays[m].append((self.sent[applied.key], step - self.sent[applied.key]))
            change = self.autos[m].observe_round(self.LATENCIES[m])
            if change is not None:
                self.replicas[m].sync.set_tau(change.new)  # type: ignore[union-attr]
        self.seen = len(self.round_log)
        return loss


def test_replicas_changing_tau_mid_run_apply_rounds_in_order_and_bit_identically(
    corpus,
) -> None:
    config = LocalConfig(
        preset="tiny",
        replicas=2,
        steps=40,
        batch_size=2,
        seq_len=16,
        eval_batches=2,
        log_every=1000,
        fragment_size=1,
        taus=[1, 4],
        outer=OuterConfig(sync_every=10),  # auto's taus: up to H / 2 = 5
    )
    trainer = AutoTauTrainer(config, corpus)
    summary = trainer.train()
    # Replica 0: 0.5 / 0.125 = 4, + 1 = 5 (up from 1); replica 1: 0.03125 / 0.125 rounds up
    # to 1, + 1 = 2 (down from 4, by more than one step).
    assert [a.tau for a in trainer.autos] == [5, 2]
    assert [r.sync.tau for r in trainer.replicas] == [5, 2]  # type: ignore[union-attr]
    # Rounds sent before a change were applied at their old delay, those after at the new
    # (after a fall, a round sent later may be applied before one sent earlier).
    first, second = ([delay for _, delay in sorted(d)] for d in trainer.delays)
    assert set(first) == {1, 5} and first == sorted(first)
    assert set(second) == {4, 2} and second == sorted(second, reverse=True)
    # Every round applied, in order per fragment, with the same outer state on both replicas.
    rounds: dict[int, dict[int, list[int]]] = {0: {}, 1: {}}
    hashes: dict[RoundKey, set[str]] = {}
    for m, applied in trainer.round_log:
        assert applied.ok
        rounds[m].setdefault(applied.key.fragment, []).append(applied.key.round)
        hashes.setdefault(applied.key, set()).add(applied.outer_sha256)
    for per_fragment in rounds.values():
        assert all(r == list(range(1, len(r) + 1)) for r in per_fragment.values())
    assert rounds[0] == rounds[1]
    assert all(len(h) == 1 for h in hashes.values())
    assert summary["rounds_pending"] == 0 and summary["outer_states_identical"]


class SlowRoundsReducer(InProcessReducer):
    """The in-process reduction, with every round reported to have taken a day (its
    ``seconds``, which ``--tau auto`` reads): a node on a very slow network."""

    def reduce(self, key: RoundKey, contributions: Sequence[Contribution]) -> Future[RoundResult]:
        result = super().reduce(key, contributions).result()
        future: Future[RoundResult] = Future()
        # A round with a peer: rounds of one (alone) teach tau nothing.
        slow = dataclasses.replace(result, seconds=86400.0, members=(*result.members, "peer"))
        future.set_result(slow)
        return future


def _node(corpus, tau: str) -> NodeTrainer:  # type: ignore[no-untyped-def]
    run = RunConfig(steps=24, seq_len=16, outer=OuterConfig(sync_every=6, fragment_sync_delay=2))
    options = NodeOptions(batch_size=2, eval_batches=1, data_seed=0, tau=tau)
    return NodeTrainer(run, options, SlowRoundsReducer(get_codec("e3m0")), "me", corpus)


def test_node_with_tau_auto_raises_tau_for_slow_rounds_and_logs_why(corpus, caplog) -> None:
    trainer = _node(corpus, "auto")
    assert trainer.sync.tau == 2  # the run's tau, until rounds have been measured
    with caplog.at_level(logging.INFO, logger="diloco.node.training.trainer"):
        while trainer.step < 24:
            trainer.train_step()
        trainer.finish_rounds()
    assert trainer.sync.tau == 3  # a day per round: H / 2
    assert trainer.tau_range == (2, 3)
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("tau ")]
    assert line.startswith("tau 2 -> 3: 80% of the last 1 round(s) took <= 86400.00 s")
    # said once, not at every round
    (short,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("rounds ")]
    assert "rounds take 86400.00 s" in short and "(H/2 = 3 of H = 6)" in short
    assert all(s.version >= 1 for s in trainer.sync.states) and trainer.sync.pending == []


def test_node_with_a_fixed_tau_keeps_it(corpus) -> None:
    trainer = _node(corpus, "3")
    while trainer.step < 12:
        trainer.train_step()
    assert trainer.tau_auto is None and trainer.sync.tau == 3 and trainer.tau_range == (3, 3)
