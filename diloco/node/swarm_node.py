"""A volunteer's node: the trainer plus the swarm (records, state transfer, healing).

``SwarmNode`` ties ``NodeTrainer`` (one replica, the shared outer loop) to ``Swarm`` and
``SwarmReducer`` (``diloco.protocol``). Training runs in the caller's thread; the swarm has
its own event-loop thread; slow DHT work (publishing records, checking for divergence,
fetching state to heal) runs on one worker thread and its results are applied between two
steps, never in the middle of one.

Healing (SPEC 4 "State transfer"; the decisions in ``diloco.node.healing``): after a round
of fragment ``p`` fails, and every ``H`` steps, the node reads the run's records; if a peer
holds a newer version of ``p`` (or the same version with another hash, held by more peers
than ours), it downloads ``p`` and adopts it before ``p`` is sent again.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TextIO

from hivemind import DHT
from hivemind.p2p import PeerID

from diloco import __version__
from diloco.codecs import get_codec
from diloco.errors import ConfigError, DilocoError, ProtocolError
from diloco.node.config import NodeOptions, RoundOptions, RunConfig
from diloco.node.healing import SETTLE_TIMEOUT, Healer
from diloco.node.outer import AppliedRound
from diloco.node.traffic import data_parallel_bytes
from diloco.node.trainer import NodeTrainer
from diloco.protocol.discovery import find_run_configs, publish_run_config
from diloco.protocol.fragment_state import OuterState
from diloco.protocol.network import NetworkOptions
from diloco.protocol.records import FragmentVersion, NodeRecord
from diloco.protocol.run_id import make_run_id
from diloco.protocol.swarm import Swarm, SwarmReducer, make_dht

logger = logging.getLogger(__name__)

RECORD_TTL = 30.0
"""Seconds a node's DHT records live unless refreshed (they expire after a clean exit)."""
PUBLISH_EVERY = 5.0
"""Seconds between two refreshes of a node's records (sooner after a round)."""
DISCOVERY_ATTEMPTS = 3
"""Tries to reach the bootstrap peers before ``join`` gives up (p2pd's first dial can fail)."""
JOIN_TIMEOUT = 60.0
"""Seconds a joiner keeps trying donors for the run's state."""


def discover_run(net: NetworkOptions, run_name: str | None = None) -> tuple[RunConfig, DHT]:
    """Read the run configuration from the swarm at ``net.initial_peers``; returns it with
    the running DHT, which the node then keeps (shut it down if the node is not built).

    Raises:
        ConfigError: no run found, or several and no ``run_name`` to choose.
    """
    for attempt in range(DISCOVERY_ATTEMPTS):
        try:
            dht = make_dht(net)
            break
        except ConfigError:  # e.g. an identity file that is not an Ed25519 key
            raise
        except Exception as error:  # p2pd says why in its message; the user needs that line
            if attempt + 1 == DISCOVERY_ATTEMPTS:
                where = " ".join(net.initial_peers)
                raise ConfigError(f"cannot reach the swarm at {where}: {error}") from error
            logger.warning("cannot reach the swarm yet (%s); retrying", error)
            time.sleep(2.0)
    try:
        configs = asyncio.run(asyncio.wait_for(find_run_configs(dht), 30.0))
    except BaseException:
        dht.shutdown()
        raise
    if run_name is not None:
        configs = {k: v for k, v in configs.items() if v.get("name") == run_name}
    if len(configs) != 1:
        dht.shutdown()
    if not configs:
        raise ConfigError(
            "no run found in the swarm at "
            + " ".join(net.initial_peers)
            + (f" with name {run_name!r}" if run_name else "")
            + "; is a node started there, and is its address complete?"
        )
    if len(configs) > 1:
        names = ", ".join(sorted(str(c.get("name")) for c in configs.values()))
        raise ConfigError(f"the swarm runs several runs ({names}); choose one with --run-name")
    try:
        return RunConfig.from_dict(next(iter(configs.values()))), dht
    except ConfigError:
        dht.shutdown()
        raise


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
        metrics_out: str | None = None,
        resume: bool = False,
        on_event: EventCallback | None = None,
        dht: DHT | None = None,
    ) -> None:
        self.run, self.options, self.rounds = run, options, rounds
        self.run_id = make_run_id(run.name, run.to_dict())
        self.on_event = on_event or (lambda record: None)
        self.stop_event = threading.Event()
        # The DHT is a forked process: start it before the trainer builds anything.
        self.swarm = Swarm(self.run_id, net, dht=dht)
        try:
            codec_options = {"rounding": run.rounding} if run.codec == "e3m0" else {}
            self.reducer = SwarmReducer(
                self.swarm,
                get_codec(run.codec, **codec_options),
                timeouts=rounds.timeouts(),
                min_group_size=rounds.min_group_size,
            )
            member = self.swarm.peer_id.to_base58()
            self.trainer = NodeTrainer(run, options, self.reducer, member)
            self.trainer.round_timeout = rounds.exit_timeout
            self.trainer.sync.should_abandon = self.stop_event.is_set
            self.worker = concurrent.futures.ThreadPoolExecutor(1, "diloco-node-dht")
            self.publish_future: concurrent.futures.Future[Any] | None = None
            self.published_at = 0.0
            self.snapshot_lock = threading.Lock()
            self.snapshot = self._snapshot()
            self.metrics: TextIO | None = open(metrics_out, "a") if metrics_out else None  # noqa: SIM115
            self.resumed_from = self.trainer.resume_latest() if resume else None
            self._refresh_snapshot()
            self.healer = Healer(
                self.trainer,
                _SwarmSource(self.swarm),
                member,
                self.worker,
                self._emit,
                self._refresh_snapshot,
            )
            self.failed_rounds = 0
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
        )

    def _publish(self, record: NodeRecord) -> None:
        """Worker thread: refresh our records and learn how many nodes are alive.

        Matchmaking then ends as soon as every live node declared itself for a round,
        instead of always waiting out the window.
        """
        self.swarm.publish_record(record, ttl=RECORD_TTL)
        self.swarm.call(
            publish_run_config(self.swarm.dht, self.run_id, self.run.to_dict(), RECORD_TTL)
        )
        alive = len(self.swarm.read_records())
        self.reducer.matchmaker.target_group_size = max(self.rounds.min_group_size, alive)

    def _in_background(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future[Any]:
        future = self.worker.submit(fn, *args)
        future.add_done_callback(_log_failure)
        return future

    def join_swarm(self, timeout: float = JOIN_TIMEOUT) -> None:
        """Download the outer state and global step from the swarm (a joiner's first act).

        Donors are retried until ``timeout``: a fresh daemon's first dials can fail (libp2p
        then backs off for a few seconds) and a busy donor may answer late.
        """
        numel = {p: s.outer.numel() for p, s in enumerate(self.trainer.sync.states)}
        deadline = time.monotonic() + timeout
        while True:
            try:
                state = self.swarm.fetch_state(expected_numel=numel)
                break
            except ProtocolError as error:
                if time.monotonic() > deadline:
                    raise DilocoError(f"could not download the run's state: {error}") from error
                logger.warning("no state yet (%s); retrying", error)
                time.sleep(2.0)
        self.healer.adopt(state, take_step=True)
        self.healer.settle_rounds_in_flight(min(deadline, time.monotonic() + SETTLE_TIMEOUT))
        self._emit(
            {
                "event": "joined",
                "step": self.trainer.step,
                "versions": [s.version for s in self.trainer.sync.states],
            }
        )

    # -- the loop ----------------------------------------------------------------------------

    def _emit(self, record: dict[str, Any]) -> None:
        if self.metrics:
            self.metrics.write(json.dumps(record) + "\n")
            self.metrics.flush()
        self.on_event(record)

    def _round_record(self, applied: AppliedRound) -> dict[str, Any]:
        if not applied.ok:
            return {
                "event": "round_failed",
                "step": self.trainer.step,
                "fragment": applied.key.fragment,
                "round": applied.key.round,
                "error": applied.error,
            }
        return {
            "event": "round",
            "step": self.trainer.step,
            "fragment": applied.key.fragment,
            "round": applied.key.round,
            "members": len(applied.members),
            "bytes_sent": applied.bytes_sent,
            "bytes_received": applied.bytes_received,
            "seconds": applied.seconds,
            "blocked_seconds": applied.blocked_seconds,
            "outer_sha256": applied.outer_sha256,
        }

    def train(self) -> dict[str, Any]:
        """Train until the run's last step or ``stop_event``; returns the summary."""
        t = self.trainer
        self.swarm.serve_state(self._provide)
        self._publish(self._record(0.0))
        self._emit(
            {
                "event": "config",
                "run_id": self.run_id,
                "peer_id": self.swarm.peer_id.to_base58(),
                "sync_every": self.run.outer.sync_every,
                "num_fragments": t.sync.num_fragments,
                "tau": t.sync.tau,
                "codec": self.run.codec,
                "fragment_numel": [s.outer.numel() for s in t.sync.states],
                "start_step": t.step,
            }
        )
        tokens_per_step = self.options.batch_size * self.run.seq_len
        start, start_step = time.perf_counter(), t.step
        losses: list[float] = []
        while t.step < self.run.steps and not self.stop_event.is_set():
            step_start = time.perf_counter()
            compute_before = t.compute_seconds
            loss, applied = t.train_step()
            losses.append(loss)
            self._emit(
                {
                    "event": "step",
                    "step": t.step,
                    "loss": loss,
                    "step_seconds": t.compute_seconds - compute_before,
                    "wall_seconds": time.perf_counter() - step_start,
                }
            )
            for round_ in applied:
                self._emit(self._round_record(round_))
                self.failed_rounds += not round_.ok
            if applied:
                self._refresh_snapshot([r.key.fragment for r in applied if r.ok])
            else:
                with self.snapshot_lock:
                    self.snapshot = OuterState(t.step, self.snapshot.fragments)
            self.healer.maybe_heal([r.key for r in applied if not r.ok])
            elapsed = time.perf_counter() - start
            tokens_per_s = (t.step - start_step) * tokens_per_step / max(elapsed, 1e-9)
            if t.step % self.options.log_every == 0 or t.step == self.run.steps:
                self._progress(losses, tokens_per_s)
                losses = []
            due = bool(applied) or time.monotonic() - self.published_at > PUBLISH_EVERY
            if self.publish_future is None or (self.publish_future.done() and due):
                self.published_at = time.monotonic()
                self.publish_future = self._in_background(self._publish, self._record(tokens_per_s))
            if self.options.checkpoint_every and t.step % self.options.checkpoint_every == 0:
                t.save_checkpoint()
        return self._finish(time.perf_counter() - start)

    def _progress(self, losses: list[float], tokens_per_s: float) -> None:
        t = self.trainer
        self._emit(
            {
                "event": "progress",
                "step": t.step,
                "loss": sum(losses) / max(1, len(losses)),
                "tokens_per_s": tokens_per_s,
                "cu": t.compute_utilisation,
                "mb_sent": t.bytes_sent / 1e6,
                "mb_received": t.bytes_received / 1e6,
                "peers_last_round": t.last_round_members,
            }
        )

    def _finish(self, wall_s: float) -> dict[str, Any]:
        t = self.trainer
        interrupted = self.stop_event.is_set()
        checkpoint = t.save_checkpoint() if t.checkpoints else None
        num_params = sum(p.numel() for p in t.model.parameters())
        # M = members of this node's last round (2 if none): what a data-parallel swarm of
        # the same size would all-reduce, at the accountant's widths (diloco.node.traffic).
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
            "bytes_sent": t.bytes_sent,
            "bytes_received": t.bytes_received,
            "dp_bytes_estimate": dp.bytes_sent,
            "dp_bytes_assumption": dp.assumption,
            "failed_rounds": self.failed_rounds,
            "healed_fragments": self.healer.healed_fragments,
            "outer_sha256": [s.sha256() for s in t.sync.states],
            "versions": [s.version for s in t.sync.states],
            "checkpoint": str(checkpoint) if checkpoint else None,
            "wall_s": wall_s,
        }
        self._emit(summary)
        return summary

    def close(self) -> None:
        """Leave the swarm in bounded time: drop queued DHT work, then shut the swarm down
        (``Swarm.shutdown`` cancels the worker's call in flight and stops the DHT and p2pd).

        The reducer's handlers are not removed one by one first: each removal is a round
        trip to the daemon, which a loaded daemon can stall, and stopping our client and
        p2pd ends them all.
        """
        self.worker.shutdown(wait=False, cancel_futures=True)
        try:
            self.swarm.shutdown()
        finally:
            if self.metrics:
                self.metrics.close()


def _log_failure(future: concurrent.futures.Future[Any]) -> None:
    if future.cancelled():
        return
    error = future.exception()
    # A call cancelled by Swarm.shutdown is the node leaving, not a failure.
    if error is not None and not isinstance(error, concurrent.futures.CancelledError):
        logger.warning("background swarm task failed: %r", error)


class _SwarmSource:
    """``Swarm`` as healing's ``StateSource`` (peer ids as strings)."""

    def __init__(self, swarm: Swarm) -> None:
        self.swarm = swarm

    def read_records(self) -> list[NodeRecord]:
        return self.swarm.read_records()

    def fetch_state(
        self, fragments: Sequence[int], expected_numel: Mapping[int, int], donors: Sequence[str]
    ) -> OuterState:
        peers = [PeerID.from_base58(d) for d in donors]
        return self.swarm.fetch_state(fragments, expected_numel, peers)
