"""The ablation sweeps (benchmarks/ablations.py) and the trainer options they need.

Every sweep runs end to end at a toy size (4 steps) and writes its JSON and PNG; the
trainer options (FedPart freezing, replica average, outer-gradient cosine, drop/topk
codecs) are checked on short real runs.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from dataclasses import replace
from pathlib import Path
from types import ModuleType

import pytest
import torch
from click.testing import CliRunner

from diloco.cli import main
from diloco.node.data.corpus import load_corpus
from diloco.node.model.fragments import fragment_blocks, next_synced_fragment, sends_at
from diloco.node.training.local import LocalConfig, LocalTrainer, mean_pairwise_cosine
from diloco.node.training.outer_config import OuterConfig

ROOT = Path(__file__).resolve().parents[1]


def _load_ablations() -> ModuleType:
    spec = importlib.util.spec_from_file_location("ablations", ROOT / "benchmarks/ablations.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["ablations"] = module  # dataclasses resolve annotations through it
    spec.loader.exec_module(module)
    return module


ablations = _load_ablations()


@pytest.fixture(scope="module")
def corpus():
    return load_corpus(None)


@pytest.fixture(scope="module")
def toy_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One runs cache for every sweep, as in real use (sweeps share runs)."""
    return tmp_path_factory.mktemp("abl") / "abl_runs.jsonl"


@pytest.mark.parametrize("name", ablations.SWEEP_ORDER)
def test_sweep_runs_at_toy_size_and_writes_json_and_png(
    name: str, toy_cache: Path, tmp_path: Path
) -> None:
    # Two seeds for the first sweep (a point's mean, min and max over seeds), one for the
    # rest: each sweep's runs, files and points are what this checks.
    seeds = [0, 1] if name == ablations.SWEEP_ORDER[0] else [0]
    ablations.run([name], seeds, tmp_path, tmp_path, toy_cache, ablations.toy)
    results = json.loads((tmp_path / f"abl_{name}.json").read_text())
    assert (tmp_path / f"abl_{name}.png").read_bytes()[:4] == b"\x89PNG"
    sweep = ablations.SWEEPS[name]
    points = sweep.points(ablations.base_config())
    assert results["sweep"] == name and results["seeds"] == seeds
    assert [(p["series"], p["x"]) for p in results["points"]] == [(p.series, p.x) for p in points]
    assert len(results["runs"]) == len(seeds) * len(points)
    toy_tokens = 4 * 2 * 16  # steps x sequences x tokens, per replica
    assert all(
        r["tokens"] % toy_tokens == 0 and r["tokens"] <= 8 * toy_tokens for r in results["runs"]
    )
    for point in results["points"]:
        if name == "cosine":
            assert "cosine_by_fragment" in point
        else:
            assert math.isfinite(point["mean"]) and point["min"] <= point["mean"] <= point["max"]
    assert ablations.markdown(results).count("\n") >= 1


def test_sweep_rerun_reads_the_cache(toy_cache: Path, tmp_path: Path, corpus) -> None:
    config = ablations.toy(ablations.base_config())
    cache = ablations.RunCache(tmp_path / "runs.jsonl")
    first = ablations.run_config(config, corpus, cache)
    cache.put(config, first | {"eval_loss": -1.0})  # a later line wins: proves it is read
    assert ablations.run_config(config, corpus, cache)["eval_loss"] == -1.0
    assert ablations.run_config(replace(config, seed=5), corpus, cache)["eval_loss"] > 0


def test_toy_sizes_are_small() -> None:
    config = ablations.toy(ablations.base_config())
    assert (config.steps, config.batch_size, config.seq_len, config.eval_batches) == (4, 2, 16, 1)


def test_base_config_is_the_documented_setting() -> None:
    base = ablations.base_config()
    assert (base.replicas, base.steps, base.batch_size, base.seq_len) == (2, 300, 8, 64)
    assert (base.inner.lr, base.inner.warmup_steps) == (1e-3, 30)
    assert (base.outer.sync_every, base.outer.outer_lr, base.outer.outer_momentum) == (30, 0.7, 0.9)


def test_fragments_sweep_reuses_equal_partitions() -> None:
    points = ablations.SWEEPS["fragments"].points(ablations.base_config())
    by_label = {(p.series, p.x): p.config for p in points}
    # 4 blocks: one block each, or all in one, is the same partition for both patterns;
    # strided fragments of 3 are two fragments, as strided fragments of 2.
    assert by_label[("sequential", "1")] == by_label[("strided", "1")]
    assert by_label[("sequential", "all")] == by_label[("strided", "all")]
    assert by_label[("strided", "3")] == by_label[("strided", "2")]
    assert by_label[("sequential", "3")] != by_label[("sequential", "2")]
    seq3 = by_label[("sequential", "3")]
    assert fragment_blocks(4, seq3.fragment_size, seq3.pattern) == [[0, 1, 2], [3]]


def test_replicas_sweep_keeps_global_batch_and_eval_tokens() -> None:
    points = ablations.SWEEPS["replicas"].points(ablations.base_config())
    assert [p.x for p in points] == [2, 4, 8]
    for p in points:
        c = p.config
        assert c.replicas * c.batch_size == 16 and c.steps == 300
        assert c.eval_batches * c.batch_size == 16 * 8


def test_compression_sweep_value_droppers_at_e3m0_budget() -> None:
    from diloco.codecs import get_codec

    points = ablations.SWEEPS["compression"].points(ablations.base_config())
    e3m0 = get_codec("e3m0").encoded_size(10**6)
    for p in points:
        if p.config.codec in ("drop", "topk"):
            size = get_codec(p.config.codec, keep=p.config.keep).encoded_size(10**6)
            assert size == pytest.approx(e3m0, rel=0.01)


def test_next_synced_fragment_follows_the_send_schedule() -> None:
    # H 10, 5 fragments: offsets 0, 2, 4, 6, 8; first sends at 10, 12, 14, 16, 18.
    assert [next_synced_fragment(t, 10, 5) for t in range(1, 23)] == (
        [0] * 10 + [1, 1, 2, 2, 3, 3, 4, 4, 0, 0, 1, 1]
    )
    for step in range(10, 60):
        for fragment, _ in sends_at(step, 10, 5):
            assert next_synced_fragment(step, 10, 5) == fragment


def test_freeze_unsynced_trains_only_the_next_fragment(corpus) -> None:
    config = LocalConfig(
        steps=1,
        batch_size=2,
        seq_len=16,
        eval_batches=1,
        freeze_unsynced=True,
        outer=OuterConfig(sync_every=10),
    )
    trainer = LocalTrainer(config, corpus)
    replica = trainer.replicas[0]
    assert replica.sync is not None
    before = [[p.detach().clone() for _, p in params] for params in replica.sync.fragments]
    trainer.train()
    for index, params in enumerate(replica.sync.fragments):
        changed = any(
            not torch.equal(old, p) for old, (_, p) in zip(before[index], params, strict=True)
        )
        assert changed == (index == 0), index


def test_freeze_unsynced_with_dp_is_a_config_error() -> None:
    from diloco.errors import ConfigError

    with pytest.raises(ConfigError, match="freeze-unsynced"):
        LocalConfig(method="dp", freeze_unsynced=True)


def test_replica_average_is_the_loss_of_the_averaged_weights(corpus) -> None:
    config = LocalConfig(
        steps=3,
        batch_size=2,
        seq_len=16,
        eval_batches=2,
        taus=[1],
        outer=OuterConfig(sync_every=10, fragment_update_alpha=1.0),
    )
    trainer = LocalTrainer(config, corpus)
    summary = trainer.train()
    a, b = (r.model.state_dict() for r in trainer.replicas)
    averaged = LocalTrainer(config, corpus).replicas[0].model
    averaged.load_state_dict({k: (a[k] + b[k]) / 2 for k in a})
    assert summary["eval_loss_replica_average"] == pytest.approx(
        trainer._eval_loss(averaged), rel=1e-6
    )
    assert summary["eval_loss_replica_average"] != summary["eval_loss_first_replica"]


def test_outer_grad_cosine_logged_per_round(corpus) -> None:
    config = LocalConfig(
        steps=12, batch_size=2, seq_len=16, eval_batches=1, outer=OuterConfig(sync_every=5)
    )
    summary = LocalTrainer(config, corpus).train()
    expected = [(s, p) for s in range(1, 13) for p, _ in sends_at(s, 5, 5)]
    log = summary["outer_grad_cosine"]
    assert [(e["step"], e["fragment"]) for e in log] == expected
    assert all(-1.0 <= e["cosine"] <= 1.0 for e in log)


def test_mean_pairwise_cosine_values() -> None:
    x = torch.tensor([1.0, 0.0])
    y = torch.tensor([0.0, 2.0])
    assert mean_pairwise_cosine([x, 3 * x]) == pytest.approx(1.0)
    assert mean_pairwise_cosine([x, -x]) == pytest.approx(-1.0)
    assert mean_pairwise_cosine([x, y]) == pytest.approx(0.0)
    assert mean_pairwise_cosine([x, x, y]) == pytest.approx(1 / 3)
    assert math.isnan(mean_pairwise_cosine([x]))


def test_cli_local_freeze_and_drop_codec(tmp_path: Path) -> None:
    metrics = tmp_path / "m.jsonl"
    result = CliRunner().invoke(
        main,
        [
            "local",
            "--steps",
            "6",
            "--H",
            "3",
            "--batch-size",
            "2",
            "--seq-len",
            "16",
            "--eval-batches",
            "1",
            "--codec",
            "topk",
            "--keep",
            "0.25",
            "--freeze-unsynced",
            "--metrics-out",
            str(metrics),
        ],
    )
    assert result.exit_code == 0, result.output
    summary = json.loads(metrics.read_text().splitlines()[-1])
    assert summary["codec"] == "topk"
    assert summary["config"]["freeze_unsynced"] is True
    assert summary["config"]["keep"] == 0.25
    assert summary["bytes_sent_per_replica"] > 0
