"""A volunteer's node: the trainer plus the swarm (records, state transfer, healing).

``SwarmNode`` ties ``NodeTrainer`` (one replica, the shared outer loop) to ``Swarm`` and
``SwarmReducer`` (``diloco.protocol``). Training runs in the caller's thread; the swarm has
its own event-loop thread; the node's records are stored by ``Publisher`` on a thread of
its own; healing (checking for divergence, fetching state) runs on its own executor, and
its results are applied between two steps, never in the middle of one. No thread writes
another's state: the publisher sets the matchmaking target through the reducer's
thread-safe setter and leaves the peers' pace claims for the training thread to take
(docs/design.md "The node and its CLI").

Healing (docs/design.md "Healing and joining"; the decisions in ``diloco.node.swarm.healing`` and
``diloco.node.evidence.claims``): after a round of fragment ``p`` fails, and every ``H`` steps, the
node reads the run's records and vouches; if a peer holds a newer vouched version of ``p``
(or the same version with another vouched hash, held by more peers than ours), it
downloads ``p`` and adopts it, once its bytes hash to that vouched state, before ``p`` is
sent again. After applying a round the node vouches for it: it publishes (round, outer hash,
members) of its last applied rounds of each fragment, signed, with its records.

Every node answers RUN_INFO with its run's creator-signed configuration (how a joiner
learns the run: ``diloco.node.swarm.pinned_run``) and republishes it in the DHT for ``status``.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from hivemind import DHT

from diloco import __version__
from diloco.codecs import get_codec
from diloco.node.config import NodeOptions, RoundOptions, RunConfig, return_codec_for
from diloco.node.evidence.witness import Witness, WitnessedRound
from diloco.node.observe.recent_metrics import RecentMetrics
from diloco.node.observe.round_events import round_event
from diloco.node.observe.traffic import data_parallel_bytes
from diloco.node.swarm.before_send import heal_before_send, hold_seconds
from diloco.node.swarm.donors import ahead_of
from diloco.node.swarm.first_step import wait_for_peers
from diloco.node.swarm.healing import SETTLE_TIMEOUT, Healer
from diloco.node.swarm.matchmaking_target import MatchmakingTarget
from diloco.node.swarm.publisher import Publisher
from diloco.node.swarm.round_failures import FailureLog
from diloco.node.swarm.run_end import end_in_line, end_wait_seconds
from diloco.node.swarm.state_source import SwarmStateSource, publish_last
from diloco.node.training.pending import AppliedRound
from diloco.node.training.tau import MAX_AHEAD_SHARE
from diloco.node.training.trainer import NodeTrainer
from diloco.protocol.core.adaptive import round_trip_estimate
from diloco.protocol.core.reducer import RoundKey
from diloco.protocol.records.nodes import MAX_VOUCH_ROUNDS, FragmentVersion, NodeRecord, Vouch
from diloco.protocol.records.run_configs import SignedRunConfig
from diloco.protocol.records.run_info import serve_run_info
from diloco.protocol.runtime.network import NetworkOptions
from diloco.protocol.state.fragment import OuterState
from diloco.protocol.swarm import Swarm
from diloco.protocol.swarm_reducer import SwarmReducer
from diloco.protocol.trust.admission import check_admitted
from diloco.protocol.trust.envelopes import signer
from diloco.protocol.trust.swarm_key import ClosedSwarm, check_swarm_key, load_swarm_key
from diloco.protocol.wire.run_id import make_run_id, run_digest

logger = logging.getLogger(__name__)

JOIN_TIMEOUT = 60.0
"""Seconds a joiner keeps trying donors for the run's state."""


EventCallback = Callable[[dict[str, Any]], None]


class SwarmNode:
    """One node of a run: ``start`` it (first node) or ``join`` with initial peers."""

    def __init__(
        self,
        run: RunConfig,
        options: NodeOptions,
        rounds: RoundOptions,
        net: NetworkOptions,
        *,
        signed: SignedRunConfig,
        dht: DHT,
        metrics_out: str | None = None,
        resume: bool = False,
        on_event: EventCallback | None = None,
    ) -> None:
        self.run, self.options, self.rounds, self.signed = run, options, rounds, signed
        self.run_id = make_run_id(run.name, run.to_dict())
        self.on_event = on_event or (lambda record: None)
        self.recent = RecentMetrics(options.device, options.compute.precision, options.batch_size)
        self.stop_event = threading.Event()
        # The DHT is a forked process (``start_run``, ``discover_run``): it was started
        # before the trainer builds anything.
        try:
            if signed.run_id != self.run_id:
                raise ValueError(f"the signed run {signed.run_id} is not run {self.run_id}")
            key = load_swarm_key(net.swarm_key_path) if net.swarm_key_path else None
            check_swarm_key(self.run_id, run.swarm_key_id, key)
            closed = None if key is None else ClosedSwarm(key, run_digest(self.run_id))
            admitted = run.admitted_peers()
            check_admitted(self.run_id, admitted, signer(dht).peer_id)
        except BaseException:
            dht.shutdown()
            raise
        self.swarm = Swarm(self.run_id, net, dht=dht, closed=closed, admitted=admitted)
        try:
            self.swarm.call(serve_run_info(self.swarm.p2p, signed))
            codec_options = {"rounding": run.rounding} if run.codec == "e3m0" else {}
            codec = get_codec(run.codec, **codec_options)
            self.reducer = SwarmReducer(
                self.swarm,
                codec,
                return_codec_for(run.return_codec, codec, run.rounding),
                timeouts=rounds.timeouts(),
                min_group_size=rounds.min_group_size,
                max_weight=run.round_token_cap(),
                clip_factor=run.clip_factor,
                client=not self.swarm.dialable(),
                max_group_size=run.max_group_size,
                rounds_of_one=True,
            )
            member = self.swarm.peer_id.to_base58()
            self.trainer = NodeTrainer(run, options, self.reducer, member)
            self.witness = Witness(member)
            """The rounds this node applied: whose vouches, steps and step times count
            (docs/design.md "Evidence")."""
            # Version 0 of every fragment is the run's initial state (same seed everywhere):
            # the only unvouched state a joiner or healer adopts.
            initial_hashes = [s.sha256() for s in self.trainer.sync.states]
            self.vouches: dict[int, deque[Vouch]] = {
                p: deque(maxlen=MAX_VOUCH_ROUNDS) for p in range(self.trainer.sync.num_fragments)
            }
            """Fragment -> this node's last applied rounds of it, as it vouches for them."""
            self.trainer.round_timeout = rounds.exit_timeout
            # A stopping node gives up its rounds still in matchmaking, not those its group
            # waits for (docs/design.md "The node and its CLI").
            self.trainer.sync.should_abandon = lambda key: (
                self.stop_event.is_set() and not self.reducer.in_group(key)
            )
            self.healing = concurrent.futures.ThreadPoolExecutor(1, "diloco-node-heal")
            """Healing's checks and downloads, one at a time (``Healer``)."""
            self.publisher = Publisher(self.swarm, signed, self.recent, self._heard)
            self.snapshot_lock = threading.Lock()
            self.snapshot = self._snapshot()
            self.metrics: TextIO | None = open(metrics_out, "a") if metrics_out else None  # noqa: SIM115
            self.resumed_from = self.trainer.resume_latest() if resume else None
            self.reducer.reached_before(self.trainer.reached_before)
            self.witness.restored = frozenset(
                (r.key.fragment, r.key.round) for r in self.trainer.sync.pending
            )
            self._refresh_snapshot()
            self.healer = Healer(
                self.trainer,
                SwarmStateSource(self.swarm),
                member,
                self.healing,
                self._emit,
                self._refresh_snapshot,
                initial_hashes,
                anchors=[a.rsplit("/p2p/", 1)[1] for a in net.initial_peers if "/p2p/" in a],
                witness=self.witness,
                on_behind=lambda: self.reducer.set_behind(True),
            )
            self.trainer.sync.refuse = self.healer.refusal
            self.target = MatchmakingTarget(
                self.healer.evidence, rounds.min_group_size, self.reducer.set_target_group_size
            )
            self.failed_rounds = 0
            self.failures = FailureLog()
            self.diverged: set[RoundKey] = set()
            """Rounds in flight known to have failed on a diverged prior (``_heal``)."""
        except BaseException:
            self.swarm.shutdown()
            raise

    @property
    def maddrs(self) -> list[str]:
        return self.swarm.maddrs

    # -- records and state ------------------------------------------------------------------

    def _snapshot(self, changed: Sequence[int] | None = None) -> OuterState:
        """A consistent copy of the outer state, served to joiners and healers; only the
        ``changed`` fragments are copied anew (None: all)."""
        states = self.trainer.sync.states
        fragments = dict(self.snapshot.fragments) if changed is not None else {}
        for p in range(len(states)) if changed is None else changed:
            fragments[p] = states[p].clone()
        return OuterState(global_step=self.trainer.step, fragments=fragments)

    def _refresh_snapshot(self, changed: Sequence[int] | None = None) -> None:
        with self.snapshot_lock:
            self.snapshot = self._snapshot(changed)

    def _provide(self) -> OuterState:
        with self.snapshot_lock:
            return self.snapshot

    def _record(self, tokens_per_s: float) -> NodeRecord:
        return NodeRecord(
            peer_id=self.swarm.peer_id.to_base58(),
            addrs=tuple(self.maddrs),
            global_step=self.trainer.step,
            fragments=tuple(
                FragmentVersion(p, s.version, self.trainer.sync.state_hash(p))
                for p, s in enumerate(self.trainer.sync.states)
            ),
            throughput=tokens_per_s,
            software_version=__version__,
            step_seconds=self.trainer.pacer.full_seconds,
        )

    def _vouch(self, applied: AppliedRound) -> None:
        """Remember that we applied ``applied`` and reached its outer hash (published with
        the next records), and who worked with us in it (``witness``: docs/design.md
        "Evidence"). A member counted in none of the round's parts is not among its members
        and vouches for nothing."""
        me = self.swarm.peer_id.to_base58()
        if applied.ok and me in applied.members:
            members = tuple(sorted(applied.members))
            key = applied.key
            vouch = Vouch(me, key.fragment, key.round, applied.outer_sha256, members)
            self.vouches[key.fragment].append(vouch)
            self.witness.record(
                WitnessedRound(
                    key.fragment, key.round, members, applied.outer_sha256, applied.member_weights
                )
            )
            self.target.witnessed()  # before the next send step (``matchmaking_target``)

    def _heard(self, records: list[NodeRecord]) -> None:
        """Publisher thread: the run's live records were read; they set how many
        declarations a round waits for (``matchmaking_target``, docs/design.md "Evidence"),
        and whether this node is behind the peers it counts (docs/design.md "The round")."""
        self.target.heard(records)
        evidence = self.healer.evidence()
        self.reducer.set_behind(ahead_of(records, evidence.clock(), self.trainer.step))

    def _vouches(self) -> dict[int, tuple[Vouch, ...]]:
        return {p: tuple(v) for p, v in self.vouches.items()}

    def join_swarm(self, timeout: float = JOIN_TIMEOUT) -> None:
        """Download the outer state from the swarm and start at its step (a joiner's first
        act): only a state that a majority of its rounds' members vouch for, at the swarm's
        robust step (``Healer.join``), then the rounds that were in flight meanwhile.

        Raises:
            DilocoError: no vouched state within ``timeout`` seconds.
        """
        start = time.monotonic()
        deadline = start + timeout
        self.healer.join(deadline)
        self.healer.settle_rounds_in_flight(min(deadline, time.monotonic() + SETTLE_TIMEOUT))
        self._emit(
            {
                "event": "joined",
                "step": self.trainer.step,
                "versions": [s.version for s in self.trainer.sync.states],
                "seconds": time.monotonic() - start,
            }
        )

    # -- the loop ----------------------------------------------------------------------------

    def _emit(self, record: dict[str, Any]) -> None:
        self.recent.observe(record)
        if self.metrics:
            self.metrics.write(json.dumps(record) + "\n")
            self.metrics.flush()
        self.on_event(record)

    def train(self) -> dict[str, Any]:
        """Train until the run's last step or ``stop_event``; returns the summary."""
        t = self.trainer
        self.swarm.serve_state(self._provide)
        self.publisher.offer(self._record(0.0), self._vouches())
        self.publisher.start()
        if wanted := self.rounds.wait_for_peers:  # docs/design.md "The node and its CLI"
            waited = wait_for_peers(self.swarm, wanted, self.stop_event, self._heard)
            self._emit({"event": "waited", "seconds": waited})
        self._hear_claims()
        tokens_per_step = self.options.batch_size * self.run.seq_len
        self._emit(
            {
                "event": "config",
                "run_id": self.run_id,
                "creator": self.run.creator,
                "peer_id": self.swarm.peer_id.to_base58(),
                "sync_every": self.run.outer.sync_every,
                "num_fragments": t.sync.num_fragments,
                "tau": t.sync.tau,
                "codec": self.run.codec,
                "return_codec": self.reducer.return_codec.name,
                "fragment_numel": [s.outer.numel() for s in t.sync.states],
                "start_step": t.step,
                "tokens_per_step": tokens_per_step,
            }
        )
        start, start_rows, start_step = time.perf_counter(), t.rows_trained, t.step
        losses: list[float] = []
        tokens_per_s = 0.0
        step_end = time.perf_counter()
        while t.step < self.run.steps and not self.stop_event.is_set():
            step_start = time.perf_counter()
            between = step_start - step_end  # the last step's records, eval, heal, checkpoint
            compute_before = t.compute_seconds
            rows = t.pacer.rows
            self._bound_tau()
            loss, applied = t.train_step()
            step_end = time.perf_counter()
            losses.append(loss)
            self._emit(
                {
                    "event": "step",
                    "step": t.step,
                    "loss": loss,
                    "rows": rows,
                    "step_seconds": t.compute_seconds - compute_before,
                    "wall_seconds": step_end - step_start,
                    "between_seconds": between,
                    "tau": t.sync.tau,
                }
            )
            self._record_rounds(applied)
            if self.options.eval_every and t.step % self.options.eval_every == 0:
                self._emit({"event": "eval", "step": t.step, "loss_outer": t.evaluate()})
            if applied:
                self._refresh_snapshot([r.key.fragment for r in applied if r.ok])
            else:
                with self.snapshot_lock:
                    self.snapshot = OuterState(t.step, self.snapshot.fragments)
            self._heal(applied)
            elapsed = time.perf_counter() - start
            tokens = (t.rows_trained - start_rows) * self.run.seq_len
            tokens_per_s = tokens / max(elapsed, 1e-9)
            if t.step % self.options.log_every == 0 or t.step == self.run.steps:
                self._progress(losses, tokens_per_s, elapsed / max(1, t.step - start_step))
                losses = []
            self.publisher.offer(self._record(tokens_per_s), self._vouches(), now=bool(applied))
            self._hear_claims()
            if self.options.checkpoint_every and t.step % self.options.checkpoint_every == 0:
                t.save_checkpoint()
        if not self.stop_event.is_set():
            # The run's end (not Ctrl-C): the rounds of the last tau steps count too.
            finished = t.finish_rounds()
            self._record_rounds(finished, final=True)
            self._refresh_snapshot([r.key.fragment for r in finished if r.ok])
            self._end_in_line(tokens_per_s)
        else:  # a stop: finish the rounds whose groups wait for this node, before leaving
            t.sync.wait_kept()
        return self._finish(time.perf_counter() - start)

    def _end_in_line(self, tokens_per_s: float) -> None:
        """The run's end in line with the swarm (``run_end``, docs/design.md "The run's end")."""

        def publish() -> None:
            self.publisher.offer(self._record(tokens_per_s).as_done(), self._vouches(), now=True)

        wait_s = end_wait_seconds(self.rounds.matchmaking_window, self.rounds.round_timeout)
        read, stopped = self.swarm.read_records, self.stop_event.is_set
        end_in_line(self.healer, publish, read, wait_s, stopped, serves=not self.reducer.client)

    def _bound_tau(self) -> None:
        """tau auto: the measured round trip (what a round's matchmaking costs the network,
        the rest is waiting for later peers), and never so far ahead of the peers that
        matchmaking misses them: half the window the peers give this node's rounds, which
        follows the round trip (2.4 s at 300 ms, not the configured 2 s)."""
        auto = self.trainer.tau_auto
        if auto is not None:
            auto.round_trip = round_trip_estimate(tuple(self.reducer.rtt_samples)) or 0.0
            auto.max_ahead = self.reducer.peers_window(auto.round_trip) * MAX_AHEAD_SHARE

    def _hear_claims(self) -> None:
        """The others' pace claims the publisher read last, counted only as far as their
        witnessed work backs them (docs/design.md "Pace"); the trainer adds its own figure
        as it is at each step."""
        claims = self.publisher.take_claims()
        if claims is not None:
            self.trainer.hear_claims(claims, self.witness.weights())

    def _heal(self, applied: list[AppliedRound]) -> None:
        """Hand healing the rounds that failed: those applied now, and those in flight that
        failed already (refused by their leader, or most of their peers start from another
        state: ``PriorDiverged``, logged): that fragment is checked now, not at the round's
        receive step (``Healer.maybe_heal``). A fragment about to be sent that lacks its
        last round is healed first (``before_send``), held no longer than the peers can
        still take it (``hold_seconds``)."""
        diverged = self.trainer.sync.diverged()
        for key in diverged.keys() - self.diverged:
            event = {"event": "prior_diverged", "step": self.trainer.step, "prior": diverged[key]}
            self._emit(event | {"fragment": key.fragment, "round": key.round})
        self.diverged = set(diverged)
        self.healer.maybe_heal([r.key for r in applied if not r.ok])  # and those in flight
        # The peers wait for us a window from their send step, less what we still need then.
        round_trip = round_trip_estimate(tuple(self.reducer.rtt_samples)) or 0.0
        window = self.reducer.peers_window(round_trip)
        heal_before_send(self.healer, hold_seconds(window, round_trip))

    def _record_rounds(self, applied: list[AppliedRound], final: bool = False) -> None:
        for round_ in applied:
            self._emit(round_event(round_, self.trainer.step, final))
            self.failed_rounds += not round_.ok
            if round_.ok:
                self.failures.succeeded(len(round_.members))
            else:
                others = (self.reducer.matchmaker.target_group_size or 1) - 1
                self.failures.failed(round_.error or "", others)
            self._vouch(round_)

    def _progress(self, losses: list[float], tokens_per_s: float, step_wall_s: float) -> None:
        """A progress record; ``step_wall_s``: mean wall seconds per step so far, for the
        estimated time left."""
        t = self.trainer
        self._emit(
            {
                "event": "progress",
                "step": t.step,
                "steps": self.run.steps,
                "eta_s": step_wall_s * (self.run.steps - t.step),
                "loss": sum(losses) / max(1, len(losses)),
                "tokens_per_s": tokens_per_s,
                "cu": t.compute_utilisation,
                "mb_sent": t.bytes_sent / 1e6,
                "mb_received": t.bytes_received / 1e6,
                "peers_last_round": t.last_round_members,
                "rows_share": t.pacer.share,
                "pace_seconds": t.pacer.pace,
                "tau": t.sync.tau,
            }
        )

    def _finish(self, wall_s: float) -> dict[str, Any]:
        # First, before the checkpoint and evaluations: the peers stop waiting for this node
        # in their rounds at once (docs/design.md "The node and its CLI").
        self.publisher.leave()
        t = self.trainer
        interrupted = self.stop_event.is_set()
        checkpoint = t.save_checkpoint() if t.checkpoints else None
        num_params = sum(p.numel() for p in t.model.parameters())
        # M = members of this node's last round (2 if none): what a data-parallel swarm of
        # the same size would all-reduce, at the accountant's widths (diloco.node.observe.traffic).
        dp = data_parallel_bytes(
            num_params=num_params, steps=t.step, num_replicas=max(2, t.last_round_members)
        )
        summary = {
            "event": "summary",
            "run_id": self.run_id,
            "step": t.step,
            "interrupted": interrupted,
            "eval_loss": t.evaluate(outer=True),
            "eval_loss_local": t.evaluate(outer=False),
            "cu": t.compute_utilisation,
            "compute_seconds": t.compute_seconds,
            "blocked_seconds": t.blocked_seconds,
            "rows_trained": t.rows_trained,
            "tokens_trained": t.rows_trained * self.run.seq_len,
            "bytes_sent": t.bytes_sent,
            "bytes_received": t.bytes_received,
            "dp_bytes_estimate": dp.bytes_sent,
            "dp_bytes_assumption": dp.assumption,
            "failed_rounds": self.failed_rounds,
            "failed_causes": dict(self.failures.total),
            "rounds_alone": self.failures.alone_rounds,
            "healed_fragments": self.healer.healed_fragments,
            "outer_sha256": [s.sha256() for s in t.sync.states],
            "versions": [s.version for s in t.sync.states],
            "rounds_pending": len(t.sync.pending),
            "tau_range": list(t.tau_range),
            "checkpoint": str(checkpoint) if checkpoint else None,
            "wall_s": wall_s,
        }
        self._emit(summary)
        publish_last(self.swarm, self.run_id, self.recent.record())
        return summary

    def close(self) -> None:
        """Leave the swarm in bounded time: drop queued healing work, then shut the swarm
        down (``Swarm.shutdown`` cancels the calls in flight of the healer and the
        publisher, and stops the DHT and p2pd), then wait for the publisher's thread.

        The reducer's handlers are not removed one by one first: each removal is a round
        trip to the daemon, which a loaded daemon can stall, and stopping our client and
        p2pd ends them all.
        """
        self.publisher.stop()
        self.healing.shutdown(wait=False, cancel_futures=True)
        try:
            self.swarm.shutdown()
        finally:
            self.publisher.join()
            if self.metrics:
                self.metrics.close()
