"""What one in-process experiment of ``diloco-node local`` runs (``LocalTrainer``).

One configuration stack with the swarm node (docs/design.md "The node and its CLI"): the
fields an experiment shares with a run are named as ``RunConfig``'s and ``NodeOptions``'s,
checked by them (``run_config``, ``node_options``), set by the same command-line flags
(``diloco.node.flags``), and the replicas train the model ``RunConfig.model_config``
describes. What only an experiment has (method, replicas, per-replica tau and speed,
ablation codecs) is checked here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from diloco.errors import ConfigError
from diloco.node.config import NodeOptions, ReturnCodec, RunConfig
from diloco.node.model.compute import ComputeOptions
from diloco.node.model.fragments import EmbeddingPlacement, Pattern
from diloco.node.training.inner import InnerConfig
from diloco.node.training.outer_config import OuterConfig, check_tau
from diloco.node.training.pace import swarm_pace, target_rows
from diloco.protocol.core.aggregation import CLIP_FACTOR

Method = Literal["dp", "diloco", "streaming"]


@dataclass(kw_only=True, slots=True)
class LocalConfig:
    """One in-process experiment."""

    method: Method = "streaming"
    replicas: int = 2
    """M: number of replicas (workers)."""
    preset: str = "tiny"
    steps: int = 600
    """T: inner steps per replica."""
    batch_size: int = 8
    """Sequences per replica per inner step."""
    seq_len: int = 64
    """Tokens per sequence."""
    fragment_size: int = 1
    """Transformer blocks per fragment (docs/design.md "Algorithm and schedule")."""
    pattern: Pattern = "strided"
    embedding_fragment: EmbeddingPlacement = "own"
    taus: list[int] = field(default_factory=lambda: [1])
    """tau per replica; one value applies to all."""
    codec: str | None = None
    """Outer-gradient codec; None picks e3m0 for streaming and none for diloco."""
    rounding: Literal["nearest", "stochastic"] = "nearest"
    return_codec: ReturnCodec | None = None
    """Codec of the averaged outer gradient (``RunConfig.return_codec``); None: ``codec``'s."""
    keep: float | None = None
    """Keep fraction q of the value-dropping codecs (drop, topk); None is the codec's default."""
    freeze_unsynced: bool = False
    """FedPart-style: train only the fragment that is synchronised next, freeze the others."""
    outer: OuterConfig = field(default_factory=OuterConfig)
    inner: InnerConfig = field(default_factory=InnerConfig)
    eval_every: int = 0
    """Evaluate every this many steps (0: only at the end)."""
    eval_batches: int = 8
    log_every: int = 25
    seed: int = 0
    data: str | None = None
    """Corpus path (see ``diloco.node.data.corpus``); None is the embedded corpus."""
    max_round_tokens: int | None = None
    """Cap on a replica's weight in one round, in tokens (``RunConfig.max_round_tokens``)."""
    clip_factor: float = CLIP_FACTOR
    """C of the norm clipping of outer gradients (``RunConfig.clip_factor``; 0: off)."""
    vocab_size: int | None = None
    """Model vocabulary; None: the preset's, raised to the corpus's if it needs more."""
    compute: ComputeOptions = field(default_factory=ComputeOptions)
    """How every replica computes its inner steps (precision, micro-batches, compile)."""
    replica_speeds: list[float] | None = None
    """Speed of each replica's device, relative (e.g. 1,1,0.33: the third takes 3x as long
    per step); None: all alike. A replica's full-batch step takes ``1 / speed``; the pace is
    the lower median of those, and each replica trains the rows ``pace.target_rows`` gives
    it (docs/design.md "Pace", as a swarm node with ``--pace adaptive`` would), so every replica
    does
    every step and a slow one fewer rows, weighted by its tokens."""

    def __post_init__(self) -> None:
        if self.method not in ("dp", "diloco", "streaming"):
            raise ConfigError(f"unknown method {self.method!r}; use dp, diloco or streaming")
        if self.replicas < 1 or self.steps < 1 or self.batch_size < 1 or self.seq_len < 2:
            raise ConfigError("need replicas >= 1, steps >= 1, batch_size >= 1, seq_len >= 2")
        if len(self.taus) not in (1, self.replicas):
            raise ConfigError(
                f"give one tau or one per replica ({self.replicas}), got {len(self.taus)}"
            )
        if self.freeze_unsynced and self.method == "dp":
            raise ConfigError("--freeze-unsynced needs fragments; use diloco or streaming")
        if self.compute.micro_batch_size and self.method == "dp":
            raise ConfigError("--micro-batch-size needs an inner step; use diloco or streaming")
        if self.method == "diloco":
            self.fragment_size = 10**6
            self.embedding_fragment = "first"
            self.taus = [0]
        for tau in self.taus:
            check_tau(tau, self.outer.sync_every)
        self.node_options()
        self.run_config()
        speeds = self.replica_speeds
        if speeds is not None:
            if self.method == "dp":
                raise ConfigError("--replica-speeds needs inner steps; use diloco or streaming")
            if len(speeds) != self.replicas or not all(0 < v <= 1e6 for v in speeds):
                raise ConfigError(f"give one speed > 0 per replica ({self.replicas}), got {speeds}")

    def run_config(self) -> RunConfig:
        """The run every replica trains, as a swarm's nodes would (its checks are the run's:
        ranges, codec, weight cap, clipping, vocabulary)."""
        return RunConfig(
            preset=self.preset,
            seq_len=self.seq_len,
            steps=self.steps,
            fragment_size=self.fragment_size,
            pattern=self.pattern,
            embedding_fragment=self.embedding_fragment,
            codec=self.codec_name,
            rounding=self.rounding,
            return_codec=self.return_codec,
            outer=self.outer,
            inner=self.inner,
            seed=self.seed,
            max_round_tokens=self.max_round_tokens,
            clip_factor=self.clip_factor,
            vocab_size=self.vocab_size,
        )

    def node_options(self) -> NodeOptions:
        """What each replica would choose as a swarm node (its checks are the node's: batch,
        micro-batches, evaluation, logging, data path); every replica alike but its data
        seed and its rows (``replica_rows``)."""
        return NodeOptions(
            batch_size=self.batch_size,
            data=self.data,
            log_every=self.log_every,
            eval_batches=self.eval_batches,
            eval_every=self.eval_every,
            compute=self.compute,
        )

    def tau_of(self, replica: int) -> int:
        return self.taus[replica] if len(self.taus) > 1 else self.taus[0]

    def replica_rows(self) -> list[int]:
        """Sequences each replica trains per inner step (``replica_speeds``)."""
        if self.replica_speeds is None:
            return [self.batch_size] * self.replicas
        full_seconds = [1 / v for v in self.replica_speeds]
        pace = swarm_pace(full_seconds)
        assert pace is not None
        return [target_rows(self.batch_size, pace, s) for s in full_seconds]

    @property
    def codec_name(self) -> str:
        if self.codec is not None:
            return self.codec
        return "none" if self.method == "diloco" else "e3m0"
