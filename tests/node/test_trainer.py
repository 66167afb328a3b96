import dataclasses
import math
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch
from bpe_corpus import write_bpe_corpus
from tokenizers import Tokenizer

from diloco.codecs import get_codec
from diloco.errors import ConfigError
from diloco.node.config import NodeOptions, RunConfig
from diloco.node.data.corpus import load_corpus
from diloco.node.data.prepare import PrepareConfig, prepare
from diloco.node.model.compute import ComputeOptions
from diloco.node.model.fragments import send_step
from diloco.node.training.checkpoint import CheckpointManager
from diloco.node.training.inner import InnerConfig
from diloco.node.training.outer_config import OuterConfig
from diloco.node.training.trainer import NodeTrainer
from diloco.protocol.core.reducer import (
    Contribution,
    InProcessReducer,
    Reducer,
    RoundKey,
    RoundResult,
)


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


def test_a_resumed_trainer_knows_the_rounds_its_earlier_process_reached(corpus, tmp_path) -> None:
    """A process killed at step 16 after a checkpoint at 12; the one resumed from it finds
    the rounds the first sent after 12 in the notes, those to sit out (H 6, 5 fragments:
    fragment p sends round k at step p + 6k, so 13-16 sent round 2 of fragments 1-4), and
    keeps them in the file when it notes its own."""
    first = make(corpus, tmp_path)
    assert first.sync.num_fragments == 5
    while first.step < 12:
        first.train_step()
    assert first.save_checkpoint() is not None
    while first.step < 16:
        first.train_step()
    expected = {RoundKey(1, 2), RoundKey(2, 2), RoundKey(3, 2), RoundKey(4, 2)}
    second = make(corpus, tmp_path)
    assert second.resume_latest() is not None and second.step == 12
    assert second.reached_before == expected
    second.train_step()  # sends round 2 of fragment 1 again, a note of its own
    third = make(corpus, tmp_path)
    assert third.resume_latest() is not None and third.reached_before == expected
    assert make(corpus, tmp_path / "fresh").reached_before == set()


def test_slow_down_multiplies_compute_not_a_stop_of_the_process(corpus, tmp_path) -> None:
    """``--slow-down``: a step's sleep follows its compute; a step a SIGSTOP stretched to 6 s
    among steps of 0.1 s sleeps as a step of 0.4 s (four times the recent median)."""
    trainer = make(corpus, tmp_path, slow_down=3.0)
    seen = [trainer._compute(s) for s in (0.1, 0.12, 0.08, 0.1, 6.0, 0.1)]
    assert seen == [0.1, 0.12, 0.08, 0.1, pytest.approx(0.4), 0.1]


class WeightsReducer(InProcessReducer):
    """Remembers the weight of every contribution it is handed."""

    def __init__(self) -> None:
        super().__init__(get_codec("none"))
        self.weights: list[float] = []

    def reduce(self, key: RoundKey, contributions: Sequence[Contribution]) -> Future[RoundResult]:
        self.weights.extend(c.weight for c in contributions)
        return super().reduce(key, contributions)


def test_fewer_rows_count_fewer_tokens(corpus, tmp_path) -> None:
    reducer = WeightsReducer()
    run = RunConfig(steps=12, seq_len=16, outer=OuterConfig(sync_every=6, fragment_sync_delay=0))
    node = NodeOptions(batch_size=4, eval_batches=1, data_seed=0)
    trainer = NodeTrainer(run, node, reducer, "me", corpus)
    # As if the swarm's pace had brought the node down to one sequence per step.
    trainer.pacer.share, trainer.pacer.rows = 1.0, 1
    trainer.peer_step_seconds = (1e-9, 1e-9)
    seen: list[int] = []
    original = trainer.model.forward

    def forward(inputs: torch.Tensor, targets: torch.Tensor | None = None):  # type: ignore[no-untyped-def]
        seen.append(inputs.size(0))
        return original(inputs, targets)

    trainer.model.forward = forward  # type: ignore[method-assign]
    for _ in range(6):
        trainer.train_step()
    assert seen == [1] * 6
    assert trainer.rows_trained == 6
    # Fragment 0 sends first at step H = 6, weighing steps 1-6: 6 rows x 16 tokens (the
    # full batch would weigh 4 x 96).
    assert reducer.weights[0] == 96


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


class PairReducer(Reducer):
    """Both trainers of a test hold this one reducer: a round is reduced in process (the
    swarm's arithmetic, members in the order they sent) once both have sent it."""

    def __init__(self) -> None:
        self.reducer = InProcessReducer(get_codec("e3m0"))
        self.waiting: dict[RoundKey, list[tuple[Contribution, Future[RoundResult]]]] = {}

    def reduce(self, key: RoundKey, contributions: Sequence[Contribution]) -> Future[RoundResult]:
        future: Future[RoundResult] = Future()
        entries = self.waiting.setdefault(key, [])
        entries.append((contributions[0], future))
        if len(entries) == 2:
            result = self.reducer.reduce(key, [c for c, _ in entries]).result()
            for _, waiting in entries:
                waiting.set_result(result)
        return future


def test_bf16_micro_batched_nodes_learn_and_keep_bit_identical_fp32_outer_states(corpus) -> None:
    run = RunConfig(
        preset="micro", steps=30, seq_len=32, outer=OuterConfig(sync_every=6, fragment_sync_delay=2)
    )
    compute = ComputeOptions(precision="bf16", micro_batch_size=2)
    pair = PairReducer()
    nodes = [
        NodeTrainer(
            run,
            # The run's tau: tau auto follows each node's measured round and step times,
            # so the two could apply the last round at different steps (once, under load,
            # b applied it before the run's end and a after).
            NodeOptions(batch_size=4, data_seed=seed, compute=compute, tau=None),
            pair,
            name,
            corpus,
        )
        for seed, name in ((1, "a"), (2, "b"))
    ]
    losses: list[float] = []
    applied: dict[str, dict[RoundKey, str]] = {"a": {}, "b": {}}
    for _ in range(run.steps):
        for node in nodes:
            loss, rounds = node.train_step()
            if node.member == "a":
                losses.append(loss)
            applied[node.member].update({r.key: r.outer_sha256 for r in rounds if r.ok})
    assert len(applied["a"]) >= 10 and applied["a"] == applied["b"]
    a, b = (node.sync.states for node in nodes)
    assert [s.sha256() for s in a] == [s.sha256() for s in b]
    assert all(s.outer.dtype == s.momentum.dtype == torch.float32 for s in a)
    assert sum(losses[:5]) / 5 > sum(losses[-5:]) / 5 + 0.5


def test_bf16_and_micro_batches_reach_the_inner_step(corpus) -> None:
    def first_loss(compute: ComputeOptions) -> float:
        node = NodeTrainer(
            RunConfig(steps=5, seq_len=16),
            NodeOptions(batch_size=4, data_seed=0, compute=compute),
            InProcessReducer(get_codec("none")),
            "x",
            corpus,
        )
        return node.train_step()[0]

    fp32 = first_loss(ComputeOptions())
    assert first_loss(ComputeOptions(micro_batch_size=1)) == pytest.approx(fp32, abs=1e-5)
    assert first_loss(ComputeOptions(micro_batch_size=1)) != fp32  # 4 passes, summed
    assert first_loss(ComputeOptions(precision="bf16")) != pytest.approx(fp32, abs=1e-5)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> tuple[Path, int]:
    """A folder prepared with a small BPE tokenizer, and that tokenizer's vocabulary."""
    root = tmp_path_factory.mktemp("bpe")
    write_bpe_corpus(root)
    out = root / "tokens"
    prepare(
        PrepareConfig(
            inputs=[str(root / "docs.jsonl")],
            output=str(out),
            tokenizer=str(root / "tokenizer.json"),
            processes=1,
        )
    )
    return out, Tokenizer.from_file(str(root / "tokenizer.json")).get_vocab_size()


def test_node_refuses_a_corpus_beyond_the_runs_vocabulary(prepared) -> None:
    folder, vocab = prepared
    corpus = load_corpus(folder)
    assert corpus.vocab_size == vocab > 300

    def node(run: RunConfig) -> NodeTrainer:
        options = NodeOptions(batch_size=2, data=str(folder))
        return NodeTrainer(run, options, InProcessReducer(get_codec("none")), "x", corpus)

    with pytest.raises(ConfigError, match=f"vocabulary of {vocab} tokens but the model only 256"):
        node(RunConfig(seq_len=16))
    with pytest.raises(ConfigError, match=f"--vocab-size {vocab}"):
        node(RunConfig(seq_len=16, vocab_size=300))
    pinned = {"dataset_fingerprint": corpus.fingerprint, "tokenizer": corpus.tokenizer}
    fits = node(RunConfig(seq_len=16, vocab_size=vocab, **pinned))
    assert fits.model.tok_emb.weight.shape[0] == vocab
    assert math.isfinite(fits.train_step()[0])
    with pytest.raises(ConfigError, match="prepared corpus 000000000000"):
        node(
            RunConfig(
                seq_len=16,
                vocab_size=vocab,
                tokenizer=corpus.tokenizer,
                dataset_fingerprint="0" * 64,
            )
        )
    with pytest.raises(ConfigError, match="64 lowercase hex"):
        RunConfig(dataset_fingerprint="abc")
    with pytest.raises(ConfigError, match="tokenizer must be 'bytes', 'unrecorded' or the 64"):
        RunConfig(tokenizer="tokenizer.json")  # a path names nothing: a hash does
    with pytest.raises(ConfigError, match=r"tokens of the tokenizer\.json with sha256 0000"):
        node(RunConfig(seq_len=16, vocab_size=vocab, tokenizer="0" * 64))


class SlowRoundsReducer(InProcessReducer):
    """An in-process reducer whose rounds report ``seconds`` each (a round of one that
    waited out a matchmaking window, or a group over a slow network)."""

    def __init__(self, seconds: float) -> None:
        super().__init__(get_codec("none"))
        self.seconds = seconds

    def reduce(self, key: RoundKey, contributions: Sequence[Contribution]) -> Future[RoundResult]:
        future: Future[RoundResult] = Future()
        result = super().reduce(key, contributions).result()
        future.set_result(dataclasses.replace(result, seconds=self.seconds))
        return future


def test_tau_auto_does_not_learn_from_rounds_of_one(corpus) -> None:
    # Alone, a round lasts as long as the matchmaking window: no latency of the network.
    run = RunConfig(steps=40, seq_len=16, outer=OuterConfig(sync_every=6, fragment_sync_delay=1))
    options = NodeOptions(batch_size=2, data_seed=0, tau="auto")
    node = NodeTrainer(run, options, SlowRoundsReducer(30.0), "me", corpus)
    start = node.sync.tau
    rounds = [r for _ in range(36) for r in node.train_step()[1]]
    assert len(rounds) >= 8 and all(r.ok and r.members == ("me",) for r in rounds)
    assert node.tau_range == (start, start)


class AnnouncedReducer(InProcessReducer):
    """Remembers the rounds announced to it and those it is told were skipped."""

    def __init__(self) -> None:
        super().__init__(get_codec("none"))
        self.prepared: list[RoundKey] = []
        self.forgone: list[RoundKey] = []

    def prepare(self, key: RoundKey, numel: int, weight: float, prior: str, lead: float) -> None:
        self.prepared.append(key)

    def forgo(self, key: RoundKey) -> None:
        self.forgone.append(key)


def test_steps_skipped_by_catching_up_forgo_the_rounds_announced_for_them(corpus) -> None:
    """A node that catches up with the swarm's step skips send steps; the rounds it had
    announced for them are given up at once (its peers would wait for it), the others not."""
    reducer = AnnouncedReducer()
    run = RunConfig(steps=40, seq_len=16, outer=OuterConfig(sync_every=6, fragment_sync_delay=2))
    node = NodeOptions(batch_size=2, eval_batches=1, data_seed=0)
    trainer = NodeTrainer(run, node, reducer, "me", corpus)
    trainer.train_step()
    h, fragments = run.outer.sync_every, trainer.sync.num_fragments
    sends = {key: send_step(key.fragment, key.round, h, fragments) for key in reducer.prepared}
    assert len(set(sends.values())) > 1  # rounds announced for different send steps
    first = min(sends.values())
    trainer.adopt_outer_state({}, step=first)  # the first send step is skipped, no other
    assert reducer.forgone == [key for key, send in sends.items() if send == first]
    trainer.adopt_outer_state({}, step=first)  # no step skipped: nothing more
    assert len(reducer.forgone) == len([s for s in sends.values() if s == first])


class LastReducer(InProcessReducer):
    """Remembers, for every round it is handed, whether it came marked its fragment's last."""

    def __init__(self) -> None:
        super().__init__(get_codec("none"))
        self.last: dict[tuple[int, int], bool] = {}

    def reduce(self, key: RoundKey, contributions: Sequence[Contribution]) -> Future[RoundResult]:
        self.last[(key.fragment, key.round)] = contributions[0].last
        return super().reduce(key, contributions)


def test_the_runs_last_round_of_each_fragment_is_marked_last(corpus) -> None:
    """No heal follows a fragment's last round: the swarm waits the widest window for it."""
    reducer = LastReducer()
    run = RunConfig(steps=20, seq_len=16, outer=OuterConfig(sync_every=6, fragment_sync_delay=0))
    trainer = NodeTrainer(run, NodeOptions(batch_size=1, eval_batches=1), reducer, "me", corpus)
    assert trainer.sync.num_fragments == 5  # the tiny model's: offsets 0-4 at H 6
    for _ in range(20):
        trainer.train_step()
    # Fragment p sends at steps p + 6, p + 12 and, while within the 20 steps, p + 18.
    assert reducer.last == {
        (0, 1): False, (0, 2): False, (0, 3): True,
        (1, 1): False, (1, 2): False, (1, 3): True,
        (2, 1): False, (2, 2): False, (2, 3): True,
        (3, 1): False, (3, 2): True,
        (4, 1): False, (4, 2): True,
    }  # fmt: skip
