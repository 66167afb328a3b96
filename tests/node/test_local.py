"""The in-process trainer against the exact special cases of the algorithm
(docs/design.md "Algorithm and schedule")."""

import copy
import json
import math

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from diloco.cli import main
from diloco.errors import ConfigError
from diloco.node.data.corpus import BatchSampler, load_corpus
from diloco.node.model.compute import ComputeOptions
from diloco.node.model.transformer import Transformer
from diloco.node.training.inner import InnerConfig, build_inner_optimizer, lr_at, set_lr
from diloco.node.training.local import LocalConfig, LocalTrainer
from diloco.node.training.outer_config import OuterConfig


@pytest.fixture(scope="module")
def corpus():
    return load_corpus(None)


def small(**overrides) -> LocalConfig:
    base = dict(
        preset="micro",
        replicas=2,
        steps=12,
        batch_size=2,
        seq_len=16,
        eval_batches=2,
        log_every=1000,
        fragment_size=1,
    )
    base.update(overrides)
    return LocalConfig(**base)


def params_of(trainer: LocalTrainer, replica: int = 0) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in trainer.replicas[replica].model.parameters()])


def vector(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def samplers_by_hand(corpus, config: LocalConfig) -> list[BatchSampler]:
    """Replica ``m`` reads the stream seeded ``seed * 1000 + m`` (what every method uses)."""
    return [
        BatchSampler(corpus.train, config.batch_size, config.seq_len, seed=config.seed * 1000 + m)
        for m in range(config.replicas)
    ]


def diloco_by_hand(corpus, config: LocalConfig, model_config) -> torch.Tensor:
    """DiLoCo (Douillard et al. 2024, Algorithm 1) in plain torch, none of our outer code.

    Every replica takes AdamW steps (decay on matrices only, clipped at 1.0, constant lr);
    every ``H`` steps the mean of ``global - replica`` is the gradient of
    ``torch.optim.SGD(nesterov=True)`` on a global copy, which then replaces every replica.
    """
    inner, outer = config.inner, config.outer
    torch.manual_seed(config.seed)
    initial = Transformer(model_config)
    global_model = copy.deepcopy(initial)
    replicas = [copy.deepcopy(initial) for _ in range(config.replicas)]
    adamws = [
        torch.optim.AdamW(
            [
                {"params": [p for p in r.parameters() if p.dim() >= 2], "weight_decay": 0.1},
                {"params": [p for p in r.parameters() if p.dim() < 2], "weight_decay": 0.0},
            ],
            lr=inner.lr,
            betas=(0.9, 0.95),
            fused=True,  # the kernel the node uses on a CPU (same arithmetic, other rounding)
        )
        for r in replicas
    ]
    nesterov = torch.optim.SGD(
        global_model.parameters(), lr=outer.outer_lr, momentum=outer.outer_momentum, nesterov=True
    )
    samplers = samplers_by_hand(corpus, config)
    for step in range(1, config.steps + 1):
        for replica, adamw, sampler in zip(replicas, adamws, samplers, strict=True):
            inputs, targets = sampler.next_batch()
            _, loss = replica(inputs, targets)
            adamw.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(replica.parameters(), 1.0)
            adamw.step()
        if step % outer.sync_every == 0:
            replica_params = [list(r.parameters()) for r in replicas]
            for i, g in enumerate(global_model.parameters()):
                deltas = [g.detach() - params[i].detach() for params in replica_params]
                g.grad = torch.stack(deltas).mean(0)
            nesterov.step()
            for replica in replicas:
                replica.load_state_dict(global_model.state_dict())
    return vector(global_model)


DILOCO_OUTER = dict(sync_every=4, outer_lr=0.7, outer_momentum=0.9, fragment_sync_delay=0)
CONSTANT_LR = InnerConfig(lr=1e-3, warmup_steps=0, min_lr_ratio=1.0)


@pytest.mark.parametrize(
    "overrides",
    [
        dict(method="diloco"),
        dict(fragment_size=4, embedding_fragment="first", taus=[0], codec="none"),
    ],
    ids=["diloco", "streaming-F1-tau0-none"],
)
def test_one_fragment_tau0_none_equals_diloco_by_hand(corpus, overrides) -> None:
    # Clipping off: it compares the replicas' norms, which DiLoCo's plain mean does not.
    config = small(outer=OuterConfig(**DILOCO_OUTER), inner=CONSTANT_LR, clip_factor=0, **overrides)
    trainer = LocalTrainer(config, corpus)
    summary = trainer.train()
    assert summary["num_fragments"] == 1 and summary["rounds_applied"] == 2 * 3
    expected = diloco_by_hand(corpus, config, trainer.model_config)
    # Two replicas: our FP32 mean (0.5 d0 + 0.5 d1) rounds as torch's (d0 + d1) / 2 does.
    assert torch.equal(params_of(trainer, replica=0), expected)
    assert torch.equal(params_of(trainer, replica=1), expected)
    torch.manual_seed(config.seed)
    assert not torch.allclose(expected, vector(Transformer(trainer.model_config)), atol=1e-3)


def data_parallel_sgd_by_hand(corpus, config: LocalConfig, model_config) -> torch.Tensor:
    """Plain SGD of one model on the union of the replicas' batches, step by step."""
    torch.manual_seed(config.seed)
    model = Transformer(model_config)
    sgd = torch.optim.SGD(model.parameters(), lr=config.inner.lr)
    samplers = samplers_by_hand(corpus, config)
    for _ in range(config.steps):
        batches = [sampler.next_batch() for sampler in samplers]
        inputs = torch.cat([x for x, _ in batches])  # (M * B, T)
        targets = torch.cat([y for _, y in batches])
        _, loss = model(inputs, targets)
        sgd.zero_grad(set_to_none=True)
        loss.backward()
        sgd.step()
    return vector(model)


@pytest.mark.parametrize(
    "overrides",
    [
        dict(method="streaming", fragment_size=1),
        dict(method="streaming", fragment_size=4),
        dict(method="dp"),
    ],
    ids=["streaming-fs1", "streaming-fs4", "dp"],
)
def test_h1_outer_lr1_mu0_sgd_equals_data_parallel_sgd_by_hand(corpus, overrides) -> None:
    # Equal up to float rounding (docs/design.md "Algorithm and schedule"): the mean of per-replica
    # gradients and the gradient of the union batch round differently; lr 0.1 keeps six steps from
    # amplifying that past 1e-6 (lr 0.5 reaches 2e-3) while the weights move by 6e-2. The oracle is
    # the plain mean: one-step gradients of 2 x 16 tokens differ by more than the default
    # C between replicas, so clipping is off here.
    inner = InnerConfig(optimizer="sgd", lr=0.1, warmup_steps=0, grad_clip=0, min_lr_ratio=1.0)
    outer = OuterConfig(sync_every=1, outer_lr=1.0, outer_momentum=0.0, fragment_sync_delay=0)
    config = small(
        taus=[0], codec="none", outer=outer, inner=inner, steps=6, clip_factor=0, **overrides
    )
    trainer = LocalTrainer(config, corpus)
    trainer.train()
    expected = data_parallel_sgd_by_hand(corpus, config, trainer.model_config)
    assert torch.allclose(params_of(trainer), expected, atol=1e-5, rtol=0)
    torch.manual_seed(config.seed)
    assert not torch.allclose(expected, vector(Transformer(trainer.model_config)), atol=1e-2)


def test_alpha1_replicas_train_as_if_isolated(corpus) -> None:
    config = small(
        method="streaming", taus=[1], outer=OuterConfig(sync_every=3, fragment_update_alpha=1.0)
    )
    trainer = LocalTrainer(config, corpus)
    trainer.train()
    assert trainer.rounds_applied > 0
    # The same replica trained alone, written out by hand from the building blocks.
    torch.manual_seed(config.seed)
    model = Transformer(trainer.model_config)
    optimizer = build_inner_optimizer(model.parameters(), config.inner)
    sampler = BatchSampler(corpus.train, config.batch_size, config.seq_len, seed=1)
    for step in range(1, config.steps + 1):
        inputs, targets = sampler.next_batch()
        _, loss = model(inputs, targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.inner.grad_clip)
        set_lr(optimizer, lr_at(step, config.steps, config.inner))
        optimizer.step()
    alone = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert torch.equal(alone, params_of(trainer, replica=1))


class CheckingTrainer(LocalTrainer):
    checked_rounds = 0

    def _streaming_step(self, step: int, lr: float) -> float:
        loss = super()._streaming_step(step, lr)
        assert self.outer_states_identical()
        self.checked_rounds = self.rounds_applied
        return loss


@pytest.mark.parametrize(
    "codec,rounding", [("e3m0", "nearest"), ("e3m0", "stochastic"), ("int8", "nearest")]
)
def test_outer_states_bit_identical_after_every_round(corpus, codec, rounding) -> None:
    trainer = CheckingTrainer(
        small(
            replicas=3,
            taus=[0, 1, 2],
            codec=codec,
            rounding=rounding,
            outer=OuterConfig(sync_every=3),
        ),
        corpus,
    )
    summary = trainer.train()
    assert trainer.checked_rounds >= 3 * 3 and summary["outer_states_identical"]
    hashes: dict[tuple[int, int], dict[int, str]] = {}
    for replica, applied in trainer.round_log:
        assert applied.ok
        hashes.setdefault((applied.key.fragment, applied.key.round), {})[replica] = (
            applied.outer_sha256
        )
    complete = [h for h in hashes.values() if len(h) == 3]
    assert len(complete) >= 3 * 2
    assert all(len(set(h.values())) == 1 for h in complete)
    versions = [s.version for s in trainer.replicas[0].sync.states]
    assert min(versions) >= 1


def test_run_with_tau_ends_with_no_round_pending_and_every_fragment_at_its_last_round(
    corpus,
) -> None:
    # tiny: 4 blocks + the embedding fragment = 5 fragments; H 5 gives offsets 0..4, so
    # fragment p sends at p + 5k. In 12 steps fragments 0-2 send round 2 (at 10, 11, 12)
    # and fragments 3-4 round 1 (at 8, 9). With tau 2, rounds sent at 11 and 12 are
    # received after the last step; with tau 1, the one sent at 12.
    trainer = LocalTrainer(small(taus=[1, 2], outer=OuterConfig(sync_every=5)), corpus)
    summary = trainer.train()
    assert summary["rounds_pending"] == 0
    assert summary["fragment_versions"] == [[2, 2, 2, 1, 1], [2, 2, 2, 1, 1]]
    assert summary["rounds_applied"] == 2 * 8 and summary["outer_states_identical"]


def test_return_codec_encodes_only_the_averaged_half_of_the_bytes(corpus) -> None:
    outer = OuterConfig(sync_every=6)
    quantised = LocalTrainer(small(outer=outer), corpus).train()
    exact = LocalTrainer(small(outer=outer, return_codec="none"), corpus).train()
    assert (quantised["return_codec"], exact["return_codec"]) == ("e3m0", "none")
    # 2 replicas: each sends half its E3M0 delta (4.25 bits a value) and half the mean, in
    # E3M0 or in FP32: 8.5 against 36.25 bits a value, plus headers.
    ratio = exact["bytes_sent_per_replica"] / quantised["bytes_sent_per_replica"]
    assert 4.0 < ratio < 4.5
    assert exact["eval_loss"] != quantised["eval_loss"]


def test_same_seed_same_numbers(corpus) -> None:
    a = LocalTrainer(small(), corpus).train()
    b = LocalTrainer(small(), corpus).train()
    keys = ["eval_loss", "eval_loss_replicas", "bytes_sent_per_replica", "peak_bytes_per_step"]
    assert [a[k] for k in keys] == [b[k] for k in keys]


def test_streaming_sends_far_fewer_bytes_than_dp(corpus) -> None:
    outer = OuterConfig(sync_every=6)
    s = LocalTrainer(small(steps=12, outer=outer), corpus).train()
    d = LocalTrainer(small(method="dp", steps=12), corpus).train()
    di = LocalTrainer(small(method="diloco", steps=12, outer=outer), corpus).train()
    assert d["bytes_sent_per_replica"] > 50 * s["bytes_sent_per_replica"]
    assert di["peak_bytes_per_step"] > 4 * s["peak_bytes_per_step"]
    # 2 replicas: each sends half its encoded delta and half the averaged delta.
    numel = s["num_params"]
    assert d["bytes_sent_per_replica"] == pytest.approx(12 * 4 * numel, rel=1e-3)


def test_cli_local_smoke_run_learns(tmp_path) -> None:
    out = tmp_path / "m.jsonl"
    result = CliRunner().invoke(
        main,
        [
            "local",
            "--steps",
            "40",
            "--batch-size",
            "8",
            "--seq-len",
            "64",
            "--warmup",
            "5",
            "--inner-lr",
            "4e-3",
            "--H",
            "10",
            "--eval-batches",
            "4",
            "--log-every",
            "20",
            "--metrics-out",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "step 20/40 (50%)" in result.output
    assert "rounds pending at end: 0" in result.output
    records = [json.loads(line) for line in out.read_text().splitlines()]
    summary = records[-1]
    assert summary["event"] == "summary" and summary["codec"] == "e3m0"
    assert summary["eval_loss"] < 0.75 * math.log(256)
    assert {
        "eval_loss_replicas",
        "bytes_sent_per_replica",
        "peak_bytes_per_step",
        "tokens",
        "wall_s",
    } <= set(summary)
    assert np.isfinite(summary["eval_loss_replicas"])


def test_cli_local_bad_tau_is_usage_error() -> None:
    result = CliRunner().invoke(main, ["local", "--H", "5", "--tau", "5"])
    assert result.exit_code == 2 and "tau" in result.output


def test_trainers_import_no_hivemind() -> None:
    """The in-process trainer runs without the swarm's dependencies, and the GPU check
    trains a NodeTrainer where hivemind is not installed (one interpreter for both: each
    start imports torch)."""
    import subprocess
    import sys

    code = (
        "import diloco.node.training.local, diloco.node.training.trainer, sys; "
        "assert 'hivemind' not in sys.modules, 'hivemind'"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_local_bf16_micro_batches_keep_outer_states_identical(corpus) -> None:
    def run(compute: ComputeOptions) -> dict:
        config = LocalConfig(
            steps=8, batch_size=2, seq_len=16, eval_batches=1, log_every=1, compute=compute
        )
        config.outer.sync_every = 4
        return LocalTrainer(config, corpus).train()

    bf16 = run(ComputeOptions(precision="bf16", micro_batch_size=1))
    assert bf16["outer_states_identical"] and bf16["rounds_applied"] >= 6
    assert math.isfinite(bf16["eval_loss"])
    fp32 = run(ComputeOptions())
    assert bf16["eval_loss"] != fp32["eval_loss"]  # the precision reached every replica


def test_local_vocab_size_below_the_corpus_names_the_fix(corpus) -> None:
    with pytest.raises(ConfigError, match="--vocab-size 256"):
        LocalTrainer(LocalConfig(vocab_size=100, seq_len=16), corpus)
    with pytest.raises(ConfigError, match="micro_batch_size 3 exceeds batch_size 2"):
        LocalConfig(batch_size=2, compute=ComputeOptions(micro_batch_size=3))


def test_replica_speeds_give_a_slow_replica_fewer_rows_and_weight(corpus) -> None:
    # Full-batch step seconds 1, 1 and 1 / 0.3 = 3.33: the pace (lower median) is 1, so the
    # third trains floor(8 * 1 / 3.33) = 2 sequences per step.
    config = small(
        replicas=3,
        batch_size=8,
        steps=6,
        replica_speeds=[1.0, 1.0, 0.3],
        outer=OuterConfig(sync_every=6, fragment_sync_delay=0),
        taus=[0],
    )
    trainer = LocalTrainer(config, corpus)
    weights: list[list[float]] = []
    reduce = trainer.reducer.reduce

    def remember(key, contributions):  # type: ignore[no-untyped-def]
        weights.append([c.weight for c in contributions])
        return reduce(key, contributions)

    trainer.reducer.reduce = remember  # type: ignore[method-assign]
    summary = trainer.train()
    assert summary["replica_rows"] == [8, 8, 2]
    assert summary["tokens"] == 6 * (8 + 8 + 2) * 16
    # Fragment 0 sends at step 6: six steps of each replica's rows, 16 tokens each.
    assert weights[0] == [6 * 8 * 16, 6 * 8 * 16, 6 * 2 * 16]


def test_replica_speeds_are_checked() -> None:
    with pytest.raises(ConfigError, match="one speed > 0 per replica"):
        small(replica_speeds=[1.0])
    with pytest.raises(ConfigError, match="one speed > 0 per replica"):
        small(replica_speeds=[1.0, 0.0])
    with pytest.raises(ConfigError, match="inner steps"):
        small(method="dp", replica_speeds=[1.0, 0.5])


def test_local_configuration_is_checked_as_a_run_and_a_node_are() -> None:
    """One configuration stack: what an experiment shares with a run is refused as a run
    refuses it (an unknown codec or preset names the choices before any model is built),
    and what it shares with a node as a node refuses it."""
    with pytest.raises(ConfigError, match="unknown codec 'nope'; choose one of none, bf16"):
        small(codec="nope")
    with pytest.raises(ConfigError, match="unknown preset 'huge'; choose one of micro, tiny"):
        small(preset="huge")
    with pytest.raises(ConfigError, match="eval_batches must be >= 1"):
        small(eval_batches=0)
