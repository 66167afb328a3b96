"""The node's trainer: one replica, any ``Reducer`` (the swarm's, in practice).

Training runs in the calling (main) thread; the reducer works in the background and returns
futures, so communication blocks a step only at a round's receive step ``s + tau``. The time
spent blocked there is measured: compute utilisation (CU) is the share of wall time not
blocked on the network.

``state_dict`` holds everything a resumed run needs to continue exactly (same step, same
schedule, same data position, same outer state). Rounds in flight are waited for and saved
with their results, to be applied at their receive steps after a resume.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from diloco.errors import CheckpointError, ConfigError
from diloco.node.config import NodeOptions, RunConfig
from diloco.node.data.corpus import (
    BatchSampler,
    Corpus,
    eval_batches,
    export_tokenizer,
    held_out_loss,
    load_corpus,
)
from diloco.node.model.compute import compile_model, configure_backends
from diloco.node.model.fragments import last_send, model_fragments
from diloco.node.model.hf_export import export_hf
from diloco.node.model.transformer import Transformer
from diloco.node.swarm.ahead import Announcer
from diloco.node.training.checkpoint import Checkpoint, CheckpointManager, export_weights
from diloco.node.training.inner import build_inner_optimizer, lr_at, sampled_inner_step
from diloco.node.training.outer import FragmentSync
from diloco.node.training.outer_config import check_tau
from diloco.node.training.pace import PaceController, weigh_claims
from diloco.node.training.pending import AppliedRound
from diloco.node.training.sent_rounds import SentRounds
from diloco.node.training.tau import LATENCY_QUANTILE, TauAuto, nearest_rank, tau_bounds
from diloco.protocol.core.reducer import Contribution, Reducer, RoundKey, RoundResult
from diloco.protocol.state.fragment import FragmentState
from diloco.protocol.wire.run_id import make_run_id

logger = logging.getLogger(__name__)

SLOW_DOWN_STALL = 4.0
"""A step longer than this many times the recent median is slowed down by that bound."""
SLOW_DOWN_MEMORY = 16
"""Steps whose compute seconds the bound's median is taken over."""


RoundCallback = Callable[[AppliedRound], None]
PACE_WARNING_EVERY = 60.0
"""Seconds between two warnings that this node, at its fewest rows, slows the swarm."""


class NodeTrainer:
    """One replica: inner steps in this thread, rounds through ``reducer``."""

    def __init__(
        self,
        run: RunConfig,
        options: NodeOptions,
        reducer: Reducer,
        member: str,
        corpus: Corpus | None = None,
    ) -> None:
        self.run = run
        self.options = options
        self.reducer = reducer
        self.member = member
        fixed = options.fixed_tau
        tau = run.outer.fragment_sync_delay if fixed is None else fixed
        check_tau(tau, run.outer.sync_every)
        self.tau_auto = TauAuto(run.outer.sync_every, tau) if options.tau == "auto" else None
        """``--tau auto``: this node's tau from its round latency and step time; None for a
        fixed tau."""
        self.period_warned = False
        """Whether the node said that its sync period is too short to hide its rounds."""
        if self.tau_auto is not None:
            tau = self.tau_auto.tau
        self.corpus = corpus or load_corpus(options.data)
        corpus = self.corpus
        run.check_corpus(
            corpus.vocab_size, corpus.fingerprint, corpus.description, tokenizer=corpus.tokenizer
        )
        self.device = torch.device(options.device)
        if options.threads:
            torch.set_num_threads(options.threads)
        configure_backends(self.device, options.compute.tf32)
        torch.manual_seed(run.seed)
        self.model = Transformer(run.model_config()).to(self.device)
        self.optimizer = build_inner_optimizer(self.model.parameters(), run.inner)
        data_seed = options.data_seed
        if data_seed is None:
            data_seed = int.from_bytes(os.urandom(4), "little")
        self.sampler = BatchSampler(self.corpus.train, options.batch_size, run.seq_len, data_seed)
        self.fragments = model_fragments(
            self.model, self.model.blocks, run.fragment_size, run.pattern, run.embedding_fragment
        )
        self.sync = FragmentSync(
            self.fragments, run.outer, member=member, tau=tau, outer_device=options.outer_device
        )
        self.announcer = Announcer(reducer)
        """Starts each fragment's next round's matchmaking before its send step."""
        if options.compute.compile:
            compile_model(self.model)
        self.eval_set = eval_batches(
            self.corpus.held_out, options.eval_batches, options.batch_size, run.seq_len
        )
        self.checkpoints = (
            CheckpointManager(options.checkpoint_dir) if options.checkpoint_dir else None
        )
        self.sent_rounds = (
            SentRounds(options.checkpoint_dir, make_run_id(run.name, run.to_dict()))
            if options.checkpoint_dir
            else None
        )
        """Each round noted before it starts (``diloco.node.training.sent_rounds``)."""
        self.reached_before: set[RoundKey] = set()
        """Rounds an earlier process reached past the checkpoint this one resumed from."""
        self._recent_compute: deque[float] = deque(maxlen=SLOW_DOWN_MEMORY)
        """The last steps' compute seconds, for ``--slow-down`` (``_compute``)."""
        self.step = 0
        self.compute_seconds = 0.0
        self.blocked_seconds = 0.0
        self.bytes_sent = 0
        self.bytes_received = 0
        self.last_round_members = 0
        self.pacer = PaceController(options.batch_size)
        """Rows per inner step (``diloco.node.training.pace``); the full batch in ``fixed`` mode."""
        self.peer_step_seconds: tuple[float, ...] = ()
        """The other live nodes' full-batch step seconds that count (``hear_claims``); with
        this node's own current figure they give the pace."""
        self.ignored_claims: dict[str, bool] = {}
        """Peers whose pace claims do not count -> whether they worked with this node (each
        logged once, and again only if that changes)."""
        self.rows_trained = 0
        """Sequences trained by this node's inner steps (tokens: times ``seq_len``)."""
        self.warned_at = -PACE_WARNING_EVERY
        self.round_timeout: float | None = None
        """Longest wait for an in-flight round when saving (None: the reducer's own bound)."""

    # -- the loop -------------------------------------------------------------------------

    def train_step(self) -> tuple[float, list[AppliedRound]]:
        """One inner step, then this step's sends and receives (docs/design.md "Algorithm and
        schedule")."""
        self.step += 1
        start = time.perf_counter()
        rows = self.pacer.rows
        lr = lr_at(self.step, self.run.steps, self.run.inner)
        loss = sampled_inner_step(
            self.model,
            self.optimizer,
            self.sampler,
            rows,
            lr,
            self.run.inner,
            self.options.compute,
            self.device,
        )
        if self.options.slow_down > 1:
            time.sleep((self.options.slow_down - 1) * self._compute(time.perf_counter() - start))
        self._pace(time.perf_counter() - start)  # the sleep's overshoot on a busy CPU too
        self.rows_trained += rows
        self.sync.record_tokens(rows * self.run.seq_len)
        self.sync.send_due(self.step, self._reduce)
        seconds = time.perf_counter() - start
        self.compute_seconds += seconds
        applied = self.sync.apply_due(self.step)
        self._count(applied)
        wall = time.perf_counter() - start
        tokens = rows * self.run.seq_len
        self.announcer.announce(self.sync, self.step, self.run.steps, tokens, wall)
        self._choose_tau(seconds, applied)
        return loss, applied

    def _compute(self, seconds: float) -> float:
        """What ``--slow-down`` multiplies: this step's ``seconds``, but at most
        ``SLOW_DOWN_STALL`` times the median of the last steps'. A step that a stop of the
        process (SIGSTOP, a machine asleep) stretched is no slower device: multiplied, a
        6 s stop in a chaos run on slowed steps held the node 12 s more."""
        recent = sorted(self._recent_compute)
        self._recent_compute.append(seconds)
        if not recent:
            return seconds
        return min(seconds, SLOW_DOWN_STALL * recent[len(recent) // 2])

    def _reduce(self, key: RoundKey, contribution: Contribution) -> Future[RoundResult]:
        """Start round ``key``, noted first (a process resumed later sits it out), marked
        ``last`` when it is the run's last of its fragment."""
        if self.sent_rounds is not None:
            self.sent_rounds.note(key)
        sync_every, fragments = self.run.outer.sync_every, self.sync.num_fragments
        if last_send(self.step, key.fragment, sync_every, fragments, self.run.steps):
            contribution = replace(contribution, last=True)
        return self.reducer.reduce(key, [contribution])

    def _choose_tau(self, step_seconds: float, applied: list[AppliedRound]) -> None:
        """``--tau auto``: count this step's compute and its applied rounds' latencies (send
        to result, ``AppliedRound.seconds``), and change tau for the rounds sent from the next
        step on when they call for it (``diloco.node.training.tau``)."""
        if self.tau_auto is None:
            return
        self.tau_auto.observe_step(step_seconds)
        for round_ in applied:
            if not round_.ok or len(round_.members) < 2:  # alone: a window waited out
                continue
            change = self.tau_auto.observe_round(round_.seconds, round_.matchmaking_seconds)
            if change is not None:
                logger.info(
                    "tau %d -> %d: %d%% of the last %d round(s) took <= %.2f s (not waiting for "
                    "later peers), a step %.3f s (median)",
                    change.old,
                    change.new,
                    round(LATENCY_QUANTILE * 100),
                    len(self.tau_auto.latencies),
                    change.latency,
                    change.step_seconds,
                )
                self.sync.set_tau(change.new)
        if self.tau_auto.period_short and not self.period_warned:
            self.period_warned = True
            auto = self.tau_auto
            logger.warning(
                "rounds take %.2f s on this network, %.3f s a step: more steps than tau may "
                "be (H/2 = %d of H = %d), so they block training; a run with a larger --H "
                "would hide them",
                nearest_rank(auto.latencies, LATENCY_QUANTILE),
                nearest_rank(auto.step_seconds, 0.5),
                tau_bounds(auto.sync_every)[1],
                auto.sync_every,
            )

    def _pace(self, seconds: float) -> None:
        """Rows for the next step from this one's ``seconds``; warn (rate-limited) when even
        the fewest rows leave this node far slower than the swarm."""
        adaptive = self.options.pace == "adaptive"
        self.pacer.observe(seconds, self.peer_step_seconds if adaptive else None)
        pace = self.pacer.pace
        ratio = self.pacer.slower_than_pace(pace)
        now = time.monotonic()
        if ratio is not None and now - self.warned_at >= PACE_WARNING_EVERY:
            self.warned_at = now
            logger.warning(
                "this node is %.1fx slower per step than the swarm's pace (%.3f s) even at "
                "%d sequence(s) per step, so the others wait for it at every round: stop it, "
                "or run it in a swarm with fewer fragments (a larger --fragment-size)",
                ratio,
                pace,
                self.pacer.rows,
            )

    def hear_claims(
        self, claims: Mapping[str, float], worked: Mapping[str, Sequence[float]]
    ) -> None:
        """Set the pace's peer figures from the live nodes' claimed step seconds: only
        those of peers this node saw work, agreeing with their tokens (``worked``: each
        peer's weights in rounds this node applied; docs/design.md "Pace"). A peer
        ignored is logged once (a warning if it worked with this node: its claim
        contradicts its tokens), not at every publish."""
        evidence = weigh_claims(
            claims,
            worked,
            self.pacer.full_seconds,
            self.options.batch_size,
            self.run.seq_len * self.run.outer.sync_every,
        )
        ignored = {peer: bool(worked.get(peer)) for peer in evidence.ignored}
        for peer, witnessed in ignored.items():
            if self.ignored_claims.get(peer) != witnessed:
                log = logger.warning if witnessed else logger.info
                log("pace: ignoring the step time claimed by %s: %s", peer, evidence.ignored[peer])
        self.ignored_claims = ignored
        self.peer_step_seconds = tuple(evidence.counted.values())

    def finish_rounds(self) -> list[AppliedRound]:
        """The run's end: apply the rounds sent in the last tau steps (``FragmentSync.finish``),
        so the final evaluation, checkpoint and export hold them."""
        applied = self.sync.finish()
        self._count(applied)
        return applied

    def _count(self, applied: list[AppliedRound]) -> None:
        for round_ in applied:
            self.blocked_seconds += round_.blocked_seconds
            if round_.ok:
                self.bytes_sent += round_.bytes_sent
                self.bytes_received += round_.bytes_received
                self.last_round_members = len(round_.members)

    @property
    def tau_range(self) -> tuple[int, int]:
        """The smallest and largest tau this node used (one value for a fixed tau)."""
        used = self.tau_auto.used if self.tau_auto is not None else {self.sync.tau}
        return min(used), max(used)

    @property
    def compute_utilisation(self) -> float:
        total = self.compute_seconds + self.blocked_seconds
        return self.compute_seconds / total if total else 1.0

    # -- evaluation and weights -----------------------------------------------------------

    def evaluate(self, outer: bool = True) -> float:
        """Held-out cross-entropy of the outer parameters (default) or the live weights."""
        model = self.outer_model() if outer else self.model
        return held_out_loss(model, self.eval_set, self.device)

    def outer_model(self) -> Transformer:
        """A copy of the model holding each fragment's outer parameters (docs/design.md "Algorithm
        and schedule")."""
        model = Transformer(self.run.model_config()).to(self.device)
        model.load_state_dict(self.model.state_dict())
        fragments = model_fragments(
            model,
            model.blocks,
            self.run.fragment_size,
            self.run.pattern,
            self.run.embedding_fragment,
        )
        self.sync.load_outer_into(fragments)
        return model

    def export_outer(self, path: str | Path) -> None:
        """The outer weights as a plain safetensors file, with the model config as metadata."""
        export_weights(
            self.outer_model().state_dict(),
            path,
            metadata={
                "model_config": json.dumps(asdict(self.run.model_config())),
                "step": str(self.step),
            },
        )

    def export_hf(self, folder: str | Path) -> Path:
        """The outer weights as a ``transformers`` folder (``diloco.node.model.hf_export``), with
        the tokenizer of its corpus (``data.export_tokenizer``)."""
        state = self.outer_model().state_dict()
        tokenizer = export_tokenizer(self.options.data, self.corpus.tokenizer)
        return export_hf(state, self.run.model_config(), folder, tokenizer)

    # -- state -----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Progress and state beyond the live weights (which ``save_checkpoint`` adds)."""
        return {
            "step": self.step,
            "sync": self.sync.state_dict(timeout=self.round_timeout),
            "optimizer": self.optimizer.state_dict(),
            "sampler": self.sampler.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "run": self.run.to_dict(),
            "compute_seconds": self.compute_seconds,
            "blocked_seconds": self.blocked_seconds,
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "rows_trained": self.rows_trained,
        }

    def save_checkpoint(self) -> Path | None:
        if self.checkpoints is None:
            return None
        return self.checkpoints.save(self.step, self.model.state_dict(), self.state_dict())

    def load_checkpoint(self, path: Path) -> None:
        """Continue exactly from the checkpoint at ``path``, of the same run.

        Raises:
            CheckpointError: a file of it is missing or damaged, or it does not fit the model.
            ConfigError: it belongs to another run configuration.
        """
        self._restore(path, CheckpointManager.load(path))

    def resume_latest(self) -> Path | None:
        """Continue from the newest usable checkpoint; returns its path (None: none saved).

        Raises:
            CheckpointError: checkpoints exist and none is usable (each one's reason logged).
            ConfigError: the newest readable one belongs to another run configuration.
        """
        if self.checkpoints is None or self.sent_rounds is None:
            return None
        path = self.checkpoints.load_latest(self._restore)
        if path is not None:
            h, fragments = self.run.outer.sync_every, self.sync.num_fragments
            self.reached_before = self.sent_rounds.reached_after(self.step, h, fragments)
        return path

    def _restore(self, path: Path, checkpoint: Checkpoint) -> None:
        state = checkpoint.state
        if "run" not in state:
            raise CheckpointError(path, "no run configuration in it")
        theirs, mine = state["run"], self.run.to_dict()
        if theirs != mine:
            if isinstance(theirs, dict) and theirs | {"creator": None} == mine | {"creator": None}:
                raise ConfigError(
                    f"checkpoint {path} belongs to the run created by {theirs.get('creator')}, "
                    f"and this node is {mine['creator']}: resume with the creator's identity "
                    "(--identity; `start` keeps it in CHECKPOINT_DIR/identity.key)"
                )
            raise ConfigError(f"checkpoint {path} belongs to another run configuration")
        try:
            self.model.load_state_dict(checkpoint.model)
            self.optimizer.load_state_dict(state["optimizer"])
            self.sampler.load_state_dict(state["sampler"])
            torch.set_rng_state(state["torch_rng"])
            self.sync.load_state_dict(state["sync"])
            self.step = int(state["step"])
            self.compute_seconds = float(state["compute_seconds"])
            self.blocked_seconds = float(state["blocked_seconds"])
            self.bytes_sent = int(state["bytes_sent"])
            self.bytes_received = int(state["bytes_received"])
            self.rows_trained = int(state.get("rows_trained", 0))
        except (KeyError, TypeError, ValueError, RuntimeError, IndexError) as error:
            raise CheckpointError(path, f"does not fit this node: {error!r:.300}") from error

    def adopt_outer_state(self, states: Mapping[int, FragmentState], *, step: int) -> None:
        """Take fragments' outer state from a peer (join or heal; none: a lagging node that
        only skips ahead) and go on from global step ``step``: the one way healing changes
        this trainer, called between two steps."""
        for p, state in states.items():
            self.sync.adopt(p, state)
        if step > self.step:  # the rounds announced for the steps skipped go on without us
            self.announcer.skipped(self.sync, self.step, step)
        self.step = step
