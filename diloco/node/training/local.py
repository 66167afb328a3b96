"""The in-process multi-replica trainer behind ``diloco-node local`` (experiments).

``M`` replicas of one model live in this process, each with its own data stream and inner
optimizer. ``dp`` averages gradients every step (FP32, one model, the same global batch);
``diloco`` and ``streaming`` run each replica's unchanged inner loop wrapped in
``FragmentSync`` and reduce rounds with ``InProcessReducer``, which follows the swarm's wire
path (same encodings, FP32 weighted mean in group order, the mean encoded once), so
experiments see exactly the quantisation the swarm applies. Byte counts are not the
swarm's: they are the encoded payloads of both all-reduce phases, averaged over members,
while a swarm node counts its own PART and AVERAGED frames with their frame and part
headers (a little more per chunk); matchmaking, DHT and libp2p traffic count in neither.
``diloco`` is streaming with one fragment holding everything, tau 0 and (unless asked
otherwise) no compression: DiLoCo (Douillard et al. 2024).

Same seed and options give the same numbers, exactly.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from diloco.codecs import get_codec
from diloco.node.config import check_corpus_fits, resolve_vocab, return_codec_for
from diloco.node.data.corpus import (
    BatchSampler,
    Corpus,
    eval_batches,
    export_tokenizer,
    held_out_loss,
    load_corpus,
)
from diloco.node.model.compute import autocast, compile_model
from diloco.node.model.fragments import (
    model_fragments,
    next_synced_fragment,
    train_only,
)
from diloco.node.model.hf_export import export_hf
from diloco.node.model.transformer import Transformer, preset
from diloco.node.training.inner import build_inner_optimizer, lr_at, sampled_inner_step, set_lr
from diloco.node.training.local_config import LocalConfig as LocalConfig
from diloco.node.training.local_config import Method as Method
from diloco.node.training.outer import FragmentSync
from diloco.node.training.pending import AppliedRound
from diloco.protocol.core.reducer import Contribution, InProcessReducer, RoundKey

logger = logging.getLogger(__name__)


@dataclass
class Replica:
    model: Transformer
    optimizer: torch.optim.Optimizer
    sampler: BatchSampler
    sync: FragmentSync | None
    rows: int
    """Sequences trained per inner step (``LocalConfig.replica_rows``)."""


ProgressCallback = Callable[[dict[str, Any]], None]


class LocalTrainer:
    """Runs one ``LocalConfig``; ``train()`` returns the summary record."""

    def __init__(self, config: LocalConfig, corpus: Corpus | None = None) -> None:
        self.config = config
        self.corpus = corpus or load_corpus(config.data)
        vocab = resolve_vocab(
            preset(config.preset).vocab_size, config.vocab_size, self.corpus.vocab_size
        )
        self.run = dataclasses.replace(config.run_config(), vocab_size=vocab)
        """The run the replicas train, as a swarm's nodes would (``LocalConfig.run_config``),
        with the vocabulary this corpus needs."""
        # One corpus for every replica: only the vocabulary can be wrong here.
        check_corpus_fits(
            self.run.model_config().vocab_size, self.corpus.vocab_size, self.corpus.description
        )
        model_config = self.run.model_config()
        self.model_config = model_config
        torch.manual_seed(config.seed)
        initial = Transformer(model_config)
        self.eval_model = Transformer(model_config)
        self.eval_model.load_state_dict(initial.state_dict())
        self.eval_set = eval_batches(
            self.corpus.held_out, config.eval_batches, config.batch_size, config.seq_len
        )
        num_models = 1 if config.method == "dp" else config.replicas
        self.replicas = [self._make_replica(initial, m) for m in range(num_models)]
        self.dp_samplers = [self._sampler(m) for m in range(config.replicas)]
        codec = get_codec(config.codec_name, **self._codec_options())
        self.reducer = InProcessReducer(
            codec,
            return_codec_for(config.return_codec, codec, config.rounding),
            max_weight=self.run.round_token_cap(),
            clip_factor=config.clip_factor,
        )
        # Data-parallel gradients are no outer gradients: their mean stays plain.
        self.dp_reducer = InProcessReducer(get_codec("none"), clip_factor=0)
        self.bytes_sent = [0] * config.replicas
        self.bytes_received = [0] * config.replicas
        self.peak_bytes_per_step = 0
        self.rounds_applied = 0
        self.round_log: list[tuple[int, AppliedRound]] = []
        """(replica, round) for every round each replica applied or failed."""
        self.cosine_log: list[dict[str, float]] = []
        """Per round: step, fragment and mean pairwise cosine similarity of the outer gradients."""
        self.history: list[dict[str, Any]] = []

    def _codec_options(self) -> dict[str, Any]:
        name = self.config.codec_name
        if name == "e3m0":
            return {"rounding": self.config.rounding}
        if name in ("drop", "topk") and self.config.keep is not None:
            return {"keep": self.config.keep}
        return {}

    def _sampler(self, m: int) -> BatchSampler:
        c = self.config
        return BatchSampler(self.corpus.train, c.batch_size, c.seq_len, seed=c.seed * 1000 + m)

    def _make_replica(self, initial: Transformer, m: int) -> Replica:
        c = self.config
        model = Transformer(self.model_config)
        model.load_state_dict(initial.state_dict())
        optimizer = build_inner_optimizer(model.parameters(), c.inner)
        if c.compute.compile:
            compile_model(model)
        sync = None
        if c.method != "dp":
            fragments = model_fragments(
                model, model.blocks, c.fragment_size, c.pattern, c.embedding_fragment
            )
            sync = FragmentSync(fragments, c.outer, member=f"replica{m}", tau=c.tau_of(m))
        return Replica(model, optimizer, self._sampler(m), sync, c.replica_rows()[m])

    @property
    def num_fragments(self) -> int:
        sync = self.replicas[0].sync
        return sync.num_fragments if sync else 1

    def train(
        self, metrics_out: Path | None = None, on_progress: ProgressCallback | None = None
    ) -> dict[str, Any]:
        c = self.config
        sink = metrics_out.open("w") if metrics_out else None
        start = time.perf_counter()
        tokens_per_step = c.seq_len * (
            c.batch_size * c.replicas if c.method == "dp" else sum(c.replica_rows())
        )
        try:
            for step in range(1, c.steps + 1):
                lr = lr_at(step, c.steps, c.inner)
                if c.method == "dp":
                    loss = self._dp_step(lr)
                else:
                    loss = self._streaming_step(step, lr)
                record: dict[str, Any] = {"event": "step", "step": step, "loss": loss, "lr": lr}
                if c.eval_every and step % c.eval_every == 0 and step != c.steps:
                    record.update(self.evaluate())
                if step % c.log_every == 0 or step == c.steps or "eval_loss" in record:
                    elapsed = time.perf_counter() - start
                    record["tokens_per_s"] = step * tokens_per_step / elapsed
                    record["mb_sent_per_replica"] = self._mean(self.bytes_sent) / 1e6
                    record["steps"], record["eta_s"] = c.steps, elapsed / step * (c.steps - step)
                    self._emit(record, sink, on_progress)
            self._finish_rounds()
            summary = self._summary(time.perf_counter() - start, step * tokens_per_step)
            self._emit(summary, sink, on_progress)
            return summary
        finally:
            if sink:
                sink.close()

    def _emit(
        self, record: dict[str, Any], sink: Any, on_progress: ProgressCallback | None
    ) -> None:
        self.history.append(record)
        if sink:
            sink.write(json.dumps(record) + "\n")
            sink.flush()
        if on_progress:
            on_progress(record)

    def _streaming_step(self, step: int, lr: float) -> float:
        c = self.config
        losses = []
        for replica in self.replicas:
            if c.freeze_unsynced:
                assert replica.sync is not None
                train_only(
                    replica.sync.fragments,
                    next_synced_fragment(step, c.outer.sync_every, replica.sync.num_fragments),
                )
            losses.append(
                sampled_inner_step(
                    replica.model,
                    replica.optimizer,
                    replica.sampler,
                    replica.rows,
                    lr,
                    c.inner,
                    c.compute,
                )
            )
            assert replica.sync is not None
            replica.sync.record_tokens(replica.rows * c.seq_len)
        rounds: dict[RoundKey, list[Contribution]] = defaultdict(list)
        for replica in self.replicas:
            assert replica.sync is not None
            for key, contribution in replica.sync.contributions_due(step):
                rounds[key].append(contribution)
        step_bytes = [0] * c.replicas
        for key, contributions in rounds.items():
            if len(contributions) > 1:
                self.cosine_log.append(
                    {
                        "step": step,
                        "fragment": key.fragment,
                        "cosine": mean_pairwise_cosine([x.delta for x in contributions]),
                    }
                )
            future = self.reducer.reduce(key, contributions)
            for replica, contribution in zip(self.replicas, contributions, strict=True):
                assert replica.sync is not None
                replica.sync.submit(key, future, step, contribution.weight)
            result = future.result()
            for m in range(c.replicas):
                step_bytes[m] += result.bytes_sent
                self.bytes_sent[m] += result.bytes_sent
                self.bytes_received[m] += result.bytes_received
        self.peak_bytes_per_step = max(self.peak_bytes_per_step, *step_bytes)
        for m, replica in enumerate(self.replicas):
            assert replica.sync is not None
            for applied in replica.sync.apply_due(step):
                self.rounds_applied += applied.ok
                self.round_log.append((m, applied))
        return sum(losses) / len(losses)

    def _finish_rounds(self) -> None:
        """The run's end: every replica applies the rounds sent in its last tau steps
        (``FragmentSync.finish``), so the summary evaluates and exports them."""
        for m, replica in enumerate(self.replicas):
            if replica.sync is not None:
                for applied in replica.sync.finish():
                    self.rounds_applied += applied.ok
                    self.round_log.append((m, applied))

    def rounds_pending(self) -> int:
        """Rounds sent and not yet applied, over all replicas (0 after ``train``)."""
        return sum(len(r.sync.pending) for r in self.replicas if r.sync is not None)

    def _dp_step(self, lr: float) -> float:
        """One data-parallel step: M micro-batches, FP32 gradient mean, one update."""
        c = self.config
        replica = self.replicas[0]
        params = [p for p in replica.model.parameters()]
        contributions: list[Contribution] = []
        losses: list[float] = []
        for m, sampler in enumerate(self.dp_samplers):
            inputs, targets = sampler.next_batch()
            replica.model.zero_grad(set_to_none=True)
            with autocast(inputs.device.type, c.compute.precision):
                _, loss = replica.model(inputs, targets)
            assert loss is not None
            loss.backward()
            losses.append(loss.item())
            grads = torch.cat([p.grad.reshape(-1) for p in params])  # type: ignore[union-attr]
            contributions.append(Contribution(f"replica{m}", grads, float(c.batch_size)))
        result = self.dp_reducer.reduce(RoundKey(0, 0), contributions).result()
        offset = 0
        for p in params:
            p.grad = result.delta[offset : offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        if c.inner.grad_clip:
            torch.nn.utils.clip_grad_norm_(params, c.inner.grad_clip)
        set_lr(replica.optimizer, lr)
        replica.optimizer.step()
        for m in range(c.replicas):
            self.bytes_sent[m] += result.bytes_sent
            self.bytes_received[m] += result.bytes_received
        self.peak_bytes_per_step = max(self.peak_bytes_per_step, result.bytes_sent)
        return sum(losses) / len(losses)

    def _eval_loss(self, model: Transformer) -> float:
        return held_out_loss(model, self.eval_set)

    def outer_model(self) -> Transformer:
        """A model holding the outer parameters (each fragment as of its last sync)."""
        first = self.replicas[0]
        if first.sync is None:
            return first.model
        c = self.config
        fragments = model_fragments(
            self.eval_model,
            self.eval_model.blocks,
            c.fragment_size,
            c.pattern,
            c.embedding_fragment,
        )
        first.sync.load_outer_into(fragments)
        return self.eval_model

    def export_hf(self, folder: str | Path) -> Path:
        """The outer weights as a ``transformers`` folder, with the corpus's tokenizer.json
        when its prepared folder holds it."""
        state = self.outer_model().state_dict()
        tokenizer = export_tokenizer(self.config.data, self.corpus.tokenizer)
        return export_hf(state, self.model_config, folder, tokenizer)

    def replica_average_model(self) -> Transformer:
        """A model holding the mean of the replicas' live weights (one averaged model)."""
        states = [r.model.state_dict() for r in self.replicas]
        self.eval_model.load_state_dict(
            {
                name: torch.stack([s[name].float() for s in states]).mean(0).to(value.dtype)
                for name, value in states[0].items()
            }
        )
        return self.eval_model

    def evaluate(self) -> dict[str, float]:
        """Eval loss of the outer parameters, of the replicas (mean, first) and of their average.

        ``eval_loss_replicas`` is the mean of the replicas' own losses;
        ``eval_loss_replica_average`` is the loss of one model holding their averaged weights.
        """
        replica_losses = [self._eval_loss(r.model) for r in self.replicas]
        return {
            "eval_loss": self._eval_loss(self.outer_model()),
            "eval_loss_replicas": sum(replica_losses) / len(replica_losses),
            "eval_loss_first_replica": replica_losses[0],
            "eval_loss_replica_average": self._eval_loss(self.replica_average_model()),
        }

    @staticmethod
    def _mean(values: list[int]) -> float:
        return sum(values) / len(values)

    def fragment_versions(self) -> list[list[int]]:
        """Per replica, the round each fragment last applied (empty for dp)."""
        return [[s.version for s in r.sync.states] for r in self.replicas if r.sync is not None]

    def outer_states_identical(self) -> bool:
        """True when replicas that applied the same rounds hold bit-identical outer states.

        With heterogeneous tau a replica may be a round behind at a given step, so states
        are compared fragment by fragment between replicas at the same version.
        """
        syncs = [r.sync for r in self.replicas if r.sync is not None]
        for p in range(self.num_fragments):
            by_version: dict[int, str] = {}
            for sync in syncs:
                state = sync.states[p]
                if by_version.setdefault(state.version, state.sha256()) != state.sha256():
                    return False
        return True

    def _summary(self, wall_s: float, tokens: int) -> dict[str, Any]:
        c = self.config
        num_params = sum(p.numel() for p in self.replicas[0].model.parameters())
        summary: dict[str, Any] = {
            "event": "summary",
            "method": c.method,
            "replicas": c.replicas,
            "steps": c.steps,
            "codec": c.codec_name if c.method != "dp" else "none",
            "return_codec": self.reducer.return_codec.name if c.method != "dp" else "none",
            "num_params": num_params,
            "num_fragments": self.num_fragments,
            **self.evaluate(),
            "bytes_sent_per_replica": self._mean(self.bytes_sent),
            "bytes_received_per_replica": self._mean(self.bytes_received),
            "peak_bytes_per_step": self.peak_bytes_per_step,
            "rounds_applied": self.rounds_applied,
            "rounds_pending": self.rounds_pending(),
            "fragment_versions": self.fragment_versions(),
            "clipped_contributions": self.reducer.clipped,
            "combined_contributions": self.reducer.combined,
            "outer_states_identical": self.outer_states_identical(),
            "outer_grad_cosine": self.cosine_log,
            "tokens": tokens,
            "replica_rows": [r.rows for r in self.replicas],
            "wall_s": wall_s,
            "config": json.loads(json.dumps(asdict(c), default=str)),
        }
        if not math.isfinite(summary["eval_loss"]):
            logger.warning("eval loss is not finite: the run diverged")
        return summary


def mean_pairwise_cosine(deltas: list[torch.Tensor]) -> float:
    """Mean cosine similarity over all pairs of the replicas' outer gradients (nan if < 2)."""
    pairs = [
        torch.nn.functional.cosine_similarity(a, b, dim=0).item()
        for i, a in enumerate(deltas)
        for b in deltas[i + 1 :]
    ]
    return sum(pairs) / len(pairs) if pairs else math.nan
