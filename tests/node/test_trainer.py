import pytest
import torch

from diloco.codecs import get_codec
from diloco.errors import ConfigError
from diloco.node.checkpoint import CheckpointManager
from diloco.node.config import NodeOptions, RunConfig
from diloco.node.data import load_corpus
from diloco.node.inner import InnerConfig
from diloco.node.outer import OuterConfig
from diloco.node.trainer import NodeTrainer
from diloco.protocol.reducer import InProcessReducer


@pytest.fixture(scope="module")
def corpus():
    return load_corpus(None)


def make(corpus, tmp_path, **options) -> NodeTrainer:
    run = RunConfig(
        steps=40,
        seq_len=16,
        outer=OuterConfig(sync_every=6, fragment_sync_delay=2),
        inner=InnerConfig(warmup_steps=5),
        codec="e3m0",
        rounding="stochastic",
    )
    node = NodeOptions(
        batch_size=2, eval_batches=2, data_seed=0, checkpoint_dir=str(tmp_path), **options
    )
    return NodeTrainer(run, node, InProcessReducer(get_codec("e3m0")), "me", corpus)


def weights(trainer: NodeTrainer) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in trainer.model.parameters()])


def test_resume_equals_uninterrupted_run(corpus, tmp_path) -> None:
    straight = make(corpus, tmp_path / "a")
    for _ in range(40):
        straight.train_step()

    first = make(corpus, tmp_path / "b")
    while first.step < 17:
        first.train_step()
    assert first.sync.pending  # the checkpoint carries rounds in flight
    saved = first.save_checkpoint()
    assert saved is not None
    resumed = make(corpus, tmp_path / "b")
    resumed.load_checkpoint(CheckpointManager(tmp_path / "b").latest())
    assert resumed.step == first.step
    while resumed.step < 40:
        resumed.train_step()
    assert torch.equal(weights(resumed), weights(straight))
    for a, b in zip(resumed.sync.states, straight.sync.states, strict=True):
        assert a.sha256() == b.sha256() and a.version == b.version >= 5


def test_checkpoint_refuses_other_run(corpus, tmp_path) -> None:
    trainer = make(corpus, tmp_path)
    for _ in range(5):
        trainer.train_step()
    path = trainer.save_checkpoint()
    other = NodeTrainer(
        RunConfig(steps=41, seq_len=16),
        NodeOptions(batch_size=2),
        InProcessReducer(get_codec("none")),
        "x",
        corpus,
    )
    with pytest.raises(ConfigError, match="another run"):
        other.load_checkpoint(path)


def test_failed_disk_write_keeps_previous_checkpoint(corpus, tmp_path) -> None:
    trainer = make(corpus, tmp_path)
    trainer.train_step()
    first = trainer.save_checkpoint()
    (tmp_path / ".tmp-step_000000002-x").write_text("")
    manager = CheckpointManager(tmp_path / "missing" / "file-as-parent")
    (tmp_path / "missing").write_text("a file where a folder should be")
    assert manager.save(2, {}, {}) is None
    assert CheckpointManager(tmp_path).latest() == first


def test_run_config_round_trips_and_rejects_unknown_keys() -> None:
    run = RunConfig(steps=99, outer=OuterConfig(sync_every=7))
    assert RunConfig.from_dict(run.to_dict()) == run
    with pytest.raises(ConfigError, match="unknown"):
        RunConfig.from_dict(run.to_dict() | {"evil": 1})


def test_export_outer_is_plain_safetensors(corpus, tmp_path) -> None:
    from safetensors.torch import load_file

    trainer = make(corpus, tmp_path)
    for _ in range(8):
        trainer.train_step()
    trainer.export_outer(tmp_path / "outer.safetensors")
    tensors = load_file(str(tmp_path / "outer.safetensors"))
    # fragment 0 (block 0) synced at step 6 (received at 8): its outer differs from theta.
    assert not torch.equal(
        tensors["blocks.0.attn.qkv.weight"], trainer.model.blocks[0].attn.qkv.weight.detach()
    )
    names = [n for n, _ in trainer.fragments[0]]
    exported = torch.cat([tensors[n].reshape(-1) for n in names])
    assert torch.equal(exported, trainer.sync.states[0].outer)


def test_resume_latest_skips_a_checkpoint_that_does_not_fit(corpus, tmp_path) -> None:
    import json

    trainer = make(corpus, tmp_path)
    for _ in range(3):
        trainer.train_step()
    older = trainer.save_checkpoint()
    for _ in range(2):
        trainer.train_step()
    newer = trainer.save_checkpoint()
    assert older is not None and newer is not None
    state_file = newer / "state.json"
    tree = json.loads(state_file.read_text())
    tree["dict"]["sync"]["dict"]["fragments"] = []  # readable, but not this model's
    state_file.write_text(json.dumps(tree))
    resumed = make(corpus, tmp_path)
    assert resumed.resume_latest() == older
    assert resumed.step == 3
