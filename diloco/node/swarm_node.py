"""A volunteer's node: the trainer plus the swarm (records, state transfer, healing).

``SwarmNode`` ties ``NodeTrainer`` (one replica, the shared outer loop) to ``Swarm`` and
``SwarmReducer`` (``diloco.protocol``). Training runs in the caller's thread; the swarm has
its own event-loop thread; slow DHT work (publishing records, checking for divergence,
fetching state to heal) runs on one worker thread and its results are applied between two
steps, never in the middle of one.

Healing (SPEC 4 "State transfer"): after a round of fragment ``p`` fails, and every ``H``
steps, the node reads the run's records; if a peer holds a newer version of ``p`` (or the
same version with another hash, held by more peers than ours), it downloads ``p`` and
adopts it before ``p`` is sent again.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from hivemind import DHT
from hivemind.p2p import PeerID

from diloco import __version__
from diloco.codecs import get_codec
from diloco.errors import ConfigError, DilocoError, ProtocolError
from diloco.node.fragments import fragment_offset, send_step
from diloco.node.outer import AppliedRound, FragmentState
from diloco.node.trainer import NodeOptions, NodeTrainer, RunConfig
from diloco.protocol.discovery import find_run_configs, publish_run_config
from diloco.protocol.group import RoundTimeouts
from diloco.protocol.records import FragmentVersion, NodeRecord, divergent_peers
from diloco.protocol.reducer import RoundKey
from diloco.protocol.run_id import make_run_id
from diloco.protocol.state_transfer import FragmentState as WireFragmentState
from diloco.protocol.state_transfer import OuterState
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
MAX_LAG_STEPS = 2
"""A node further behind its donor than this skips ahead to the donor's step when healing."""
SETTLE_TIMEOUT = 10.0
"""Seconds a joiner waits for the rounds that were in flight during its download."""
HEAL_CHECK_EVERY = 1.0
"""Seconds between two checks of the records while a fragment is suspect."""


@dataclass(kw_only=True, slots=True)
class NetworkOptions:
    """How this node reaches the swarm (local choices, not part of the run id)."""

    initial_peers: list[str] = field(default_factory=list)
    """Multiaddrs of running nodes; empty for the first node."""
    host_maddrs: list[str] = field(default_factory=lambda: ["/ip4/127.0.0.1/tcp/0"])
    """Addresses to listen on; loopback by default (``/ip4/0.0.0.0/tcp/PORT`` for others)."""
    announce_maddrs: list[str] = field(default_factory=list)
    identity_path: str | None = None
    """Private key file for a stable peer id (created if missing)."""
    use_relay: bool = False
    nat_port_map: bool = False
    auto_nat: bool = False
    min_group_size: int = 2
    """A round needs this many members, else it fails (1: a lone node averages alone)."""
    matchmaking_window: float = 2.0
    """Seconds a node waits for others to declare themselves for a round."""
    round_timeout: float = 10.0
    """Seconds a reducer waits for parts (and a member for averaged parts)."""
    exit_timeout: float = 5.0
    """On Ctrl-C, seconds to let rounds in flight finish before abandoning them."""

    def timeouts(self) -> RoundTimeouts:
        return RoundTimeouts(
            matchmaking_window=self.matchmaking_window,
            join_timeout=max(1.0, self.matchmaking_window),
            sender_timeout=self.round_timeout,
            reducer_timeout=self.round_timeout,
            connect_timeout=min(5.0, self.round_timeout),
        )


def _node_dht(net: NetworkOptions) -> DHT:
    """This node's DHT; a joiner starts it to read the run configuration, then trains on it."""
    return make_dht(
        net.initial_peers,
        host_maddrs=net.host_maddrs,
        announce_maddrs=net.announce_maddrs,
        identity_path=net.identity_path,
        use_relay=net.use_relay,
        nat_port_map=net.nat_port_map,
        auto_nat=net.auto_nat,
    )


def discover_run(net: NetworkOptions, run_name: str | None = None) -> tuple[RunConfig, DHT]:
    """Read the run configuration from the swarm at ``net.initial_peers``; returns it with
    the running DHT, which the node then keeps (shut it down if the node is not built).

    Raises:
        ConfigError: no run found, or several and no ``run_name`` to choose.
    """
    for attempt in range(DISCOVERY_ATTEMPTS):
        try:
            dht = _node_dht(net)
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


def config_mismatch(mine: RunConfig, theirs: RunConfig) -> list[str]:
    """Human-readable differences between two run configurations (empty if equal)."""
    a, b = mine.to_dict(), theirs.to_dict()
    diffs = []
    for key in sorted(set(a) | set(b)):
        if isinstance(a.get(key), dict) and isinstance(b.get(key), dict):
            for sub in sorted(set(a[key]) | set(b[key])):
                if a[key].get(sub) != b[key].get(sub):
                    diffs.append(
                        f"{key}.{sub}: yours {a[key].get(sub)!r}, swarm's {b[key].get(sub)!r}"
                    )
        elif a.get(key) != b.get(key):
            diffs.append(f"{key}: yours {a.get(key)!r}, swarm's {b.get(key)!r}")
    return diffs


EventCallback = Callable[[dict[str, Any]], None]


class SwarmNode:
    """One node of a run: ``start`` it (first node) or ``join`` with initial peers."""

    def __init__(
        self,
        run: RunConfig,
        options: NodeOptions,
        net: NetworkOptions,
        *,
        metrics_out: str | None = None,
        resume: bool = False,
        on_event: EventCallback | None = None,
        dht: DHT | None = None,
    ) -> None:
        self.run, self.options, self.net = run, options, net
        self.run_id = make_run_id(run.name, run.to_dict())
        self.on_event = on_event or (lambda record: None)
        self.stop_event = threading.Event()
        # The DHT is a forked process: start it before the trainer builds anything.
        self.swarm = Swarm(
            self.run_id,
            initial_peers=net.initial_peers,
            host_maddrs=net.host_maddrs,
            announce_maddrs=net.announce_maddrs,
            identity_path=net.identity_path,
            use_relay=net.use_relay,
            nat_port_map=net.nat_port_map,
            auto_nat=net.auto_nat,
            dht=dht,
        )
        try:
            codec_options = {"rounding": run.rounding} if run.codec == "e3m0" else {}
            self.reducer = SwarmReducer(
                self.swarm,
                get_codec(run.codec, **codec_options),
                timeouts=net.timeouts(),
                min_group_size=net.min_group_size,
            )
            member = self.swarm.peer_id.to_base58()
            self.trainer = NodeTrainer(run, options, self.reducer, member)
            self.trainer.round_timeout = net.exit_timeout
            self.trainer.sync.should_abandon = self.stop_event.is_set
            self.worker = concurrent.futures.ThreadPoolExecutor(1, "diloco-node-dht")
            self.publish_future: concurrent.futures.Future[Any] | None = None
            self.published_at = 0.0
            self.heal_future: concurrent.futures.Future[OuterState | None] | None = None
            self.snapshot_lock = threading.Lock()
            self.snapshot = self._snapshot()
            self.metrics: TextIO | None = open(metrics_out, "a") if metrics_out else None  # noqa: SIM115
            self.resumed_from: Path | None = None
            if resume and self.trainer.checkpoints and self.trainer.checkpoints.latest():
                self.resumed_from = self.trainer.checkpoints.latest()
                assert self.resumed_from is not None
                self.trainer.load_checkpoint(self.resumed_from)
                self.snapshot = self._snapshot()
            self.healed_fragments = 0
            self.suspects: dict[int, int] = {}
            """Fragment -> the round that failed for it, until healed or superseded."""
            self.diverged: set[int] = set()
            """Fragments a check found behind or in the minority whose fetched state could not
            be adopted (a round was in flight, or a round was applied meanwhile): checked
            again, like suspects, until a check finds them in line."""
            self.checked_at = 0.0
            self.checking: list[int] = []
            """The fragments of the check in ``heal_future``."""
            self.failed_rounds = 0
        except BaseException:
            self.swarm.shutdown()
            raise

    @property
    def maddrs(self) -> list[str]:
        return self.swarm.maddrs

    # -- records and state ------------------------------------------------------------------

    def _snapshot(self) -> OuterState:
        """A consistent copy of the outer state, served to joiners and healers."""
        return OuterState(
            global_step=self.trainer.step,
            fragments={
                p: WireFragmentState(s.outer.clone(), s.momentum.clone(), s.version)
                for p, s in enumerate(self.trainer.sync.states)
            },
        )

    def _provide(self) -> OuterState:
        with self.snapshot_lock:
            return self.snapshot

    def _record(self, tokens_per_s: float) -> NodeRecord:
        return NodeRecord(
            peer_id=self.swarm.peer_id.to_base58(),
            addrs=tuple(self.maddrs),
            global_step=self.trainer.step,
            fragments=tuple(
                FragmentVersion(p, s.version, s.sha256())
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
        self.reducer.matchmaker.target_group_size = max(self.net.min_group_size, alive)

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
        self._adopt(state, take_step=True)
        self._settle_rounds_in_flight(min(deadline, time.monotonic() + SETTLE_TIMEOUT))
        self._emit(
            {
                "event": "joined",
                "step": self.trainer.step,
                "versions": [s.version for s in self.trainer.sync.states],
            }
        )

    def _missed_rounds(self) -> dict[int, int]:
        """Fragment -> the last round sent by the current step, for fragments whose state is
        older: downloaded while that round was in flight, the state lacks its result."""
        t = self.trainer
        H, F = self.run.outer.sync_every, t.sync.num_fragments
        missed = {}
        for p in range(F):
            k = (t.step - fragment_offset(p, H, F)) // H
            if k >= 1 and t.sync.states[p].version < k:
                missed[p] = k
        return missed

    def _settle_rounds_in_flight(self, deadline: float) -> None:
        """A joiner's download can predate a round in flight: fetch those fragments again
        once a peer has applied that round (until ``deadline``; a round that failed for
        everyone never shows up). What is still missing then is healed while training."""
        while missed := self._missed_rounds():
            if time.monotonic() > deadline:
                self.suspects.update(missed)
                return
            records = self.swarm.read_records()
            for p, k in missed.items():
                donors = [r for r in records if (f := r.fragment(p)) is not None and f.version >= k]
                if donors:
                    numel = {p: self.trainer.sync.states[p].outer.numel()}
                    peers = [PeerID.from_base58(r.peer_id) for r in donors]
                    with contextlib.suppress(ProtocolError):
                        self._adopt(self.swarm.fetch_state([p], numel, peers))
            if self._missed_rounds():
                time.sleep(0.5)

    def _adopt(self, state: OuterState, take_step: bool = False) -> list[int]:
        """Take fetched fragments that are newer than ours, or that the majority holds at
        our version; fragments with a round in flight are left for a later check."""
        busy = {r.key.fragment for r in self.trainer.sync.pending}
        adopted = {}
        for p, f in state.fragments.items():
            mine = self.trainer.sync.states[p]
            newer = f.version > mine.version
            conflict = f.version == mine.version and f.state_hash != mine.sha256()
            if p not in busy and (take_step or newer or conflict):
                adopted[p] = FragmentState(f.params.clone(), f.momentum.clone(), f.version)
        self.trainer.adopt_outer_state(adopted, state.global_step if take_step else None)
        with self.snapshot_lock:
            self.snapshot = self._snapshot()
        return sorted(adopted)

    def _check_and_fetch(
        self, fragments: list[int], mine: dict[int, tuple[int, str]], my_step: int
    ) -> OuterState | None:
        """Worker thread: fetch the fragments on which peers are ahead of us, or on which
        the majority at our version holds another state (SPEC 4 "compares the state hash
        the others publish and heals from a peer if it differs").

        A node whose step lags the swarm's by more than ``MAX_LAG_STEPS`` misses every round
        (its peers leave the matchmaking window before it arrives), so it also fetches from
        the peer furthest ahead, whose fresh global step it then skips to.
        """
        me = self.swarm.peer_id.to_base58()
        records = [r for r in self.swarm.read_records() if r.peer_id != me]
        ahead_of_me = [r for r in records if r.global_step > my_step + MAX_LAG_STEPS]
        if ahead_of_me:
            fragments = list(range(self.trainer.sync.num_fragments))
        fetched, global_step = {}, 0
        for p in fragments:
            version, state_hash = mine[p]
            ahead, conflicting = divergent_peers(records, p, version, state_hash)
            donors = sorted(ahead, key=lambda r: -_version(r, p))
            if not ahead and conflicting:
                counts = Counter(_hash(r, p) for r in conflicting)
                best, holders = min(counts.items(), key=lambda item: (-item[1], item[0]))
                agreeing = 1 + sum(
                    _version(r, p) == version and _hash(r, p) == state_hash for r in records
                )
                if holders > agreeing or (holders == agreeing and best < state_hash):
                    donors = [r for r in conflicting if _hash(r, p) == best]
            if not donors and ahead_of_me:
                donors = sorted(ahead_of_me, key=lambda r: -r.global_step)[:1]
            if not donors:
                continue
            numel = {p: self.trainer.sync.states[p].outer.numel()}
            peers = [PeerID.from_base58(r.peer_id) for r in donors]
            state = self.swarm.fetch_state(fragments=[p], expected_numel=numel, donors=peers)
            fetched[p] = state.fragments[p]
            global_step = state.global_step
        return OuterState(global_step, fetched) if fetched else None

    def _maybe_heal(self, failed: list[RoundKey]) -> None:
        """Between steps: apply a finished heal check, or start one when there is reason to.

        A fragment whose round failed stays suspect until its version catches up with that
        round (peers publish their versions every few seconds) or its next round is sent;
        every ``H`` steps all fragments are checked. A fragment found out of line whose
        fetched state could not be adopted (its round was in flight, or a round was applied
        meanwhile: a joiner that arrives while a round is in flight misses that round) is
        checked again every ``HEAL_CHECK_EVERY`` seconds until a check finds it in line.
        Before, such a fragment waited for the next ``H``-step check, which falls on
        fragment 0's send step: a joiner could stay diverged on it for the whole run.
        """
        t = self.trainer
        for key in failed:
            self.suspects[key.fragment] = key.round
        if self.heal_future is not None and self.heal_future.done():
            try:
                state = self.heal_future.result()
                self.diverged -= set(self.checking)
            except Exception as error:  # a donor that fails is the donor's problem
                logger.warning("healing failed: %s", error)
                state = None
            self.heal_future = None
            if state is not None:
                adopted = self._adopt(state)
                self.diverged |= set(state.fragments) - set(adopted)
                if adopted:
                    self.healed_fragments += len(adopted)
                    self._emit({"event": "healed", "step": t.step, "fragments": adopted})
                if state.global_step > t.step + MAX_LAG_STEPS:
                    # A slow node skips ahead rather than miss every round from now on.
                    self._emit(
                        {"event": "caught_up", "from_step": t.step, "to_step": state.global_step}
                    )
                    t.step = state.global_step
                    self.suspects.update(self._missed_rounds())
        H, F = self.run.outer.sync_every, t.sync.num_fragments
        for p, k in list(self.suspects.items()):
            if t.sync.states[p].version >= k or t.step >= send_step(p, k + 1, H, F):
                del self.suspects[p]
        periodic = t.step % H == 0
        rested = time.monotonic() - self.checked_at > HEAL_CHECK_EVERY
        recheck = set(self.suspects) | self.diverged
        if self.heal_future is None and ((recheck and rested) or periodic):
            self.checked_at = time.monotonic()
            wanted = sorted(recheck) if not periodic else list(range(F))
            self.checking = wanted
            mine = {p: (t.sync.states[p].version, t.sync.states[p].sha256()) for p in range(F)}
            self.heal_future = self.worker.submit(self._check_and_fetch, wanted, mine, t.step)

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
                with self.snapshot_lock:
                    self.snapshot = self._snapshot()
            else:
                with self.snapshot_lock:
                    self.snapshot = OuterState(t.step, self.snapshot.fragments)
            self._maybe_heal([r.key for r in applied if not r.ok])
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
            "dp_bytes_estimate": 2 * 4 * num_params * t.step,
            "failed_rounds": self.failed_rounds,
            "healed_fragments": self.healed_fragments,
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


def _version(record: NodeRecord, fragment: int) -> int:
    entry = record.fragment(fragment)
    return entry.version if entry else -1


def _hash(record: NodeRecord, fragment: int) -> str:
    entry = record.fragment(fragment)
    return entry.state_hash if entry else ""
