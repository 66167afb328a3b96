"""``diloco-node bench allreduce``: real OS processes averaging random vectors.

The driver starts ``peers`` processes (forked by a fork server that imported torch,
hivemind and this module once); the first starts the DHT and the others bootstrap from its
multiaddr only. Every round, every peer reduces its own seeded random FP32 vector through
``SwarmReducer`` (or, with ``compare_hivemind``, through hivemind's ``DecentralizedAverager``
with FP16 compression) and reports its time, bytes and the sha256 of its result. Peer 0
also computes the max absolute error against the exact FP32 weighted mean of all inputs.

With ``bandwidth_mbit`` each peer runs in its own network namespace, joined to a bridge by
a veth pair throttled with ``tc tbf`` in both directions (root only; ``netns``). Namespaces,
links and the bridge are removed also on Ctrl-C; then the byte counts of the links (what
really crossed the wire, libp2p framing and encryption included) are reported next to our
own stream counters.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import logging
import multiprocessing as mp
import os
import signal
import socket
import statistics
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import torch

from diloco.bench import launcher, netns
from diloco.errors import ConfigError, RoundFailed
from diloco.protocol.core.budget import RoundBudget
from diloco.protocol.core.group import RoundTimeouts
from diloco.protocol.runtime.parent_end import end_with_parent
from diloco.protocol.staged.grid import num_stages

logger = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class BenchConfig:
    """One benchmark: ``peers`` processes, ``rounds`` rounds of ``numel`` values."""

    peers: int = 4
    rounds: int = 3
    numel: int = 10_000_000
    codec: str = "e3m0"
    compare_hivemind: bool = False
    unverified: bool = False
    """Ours without signatures and checks of the reducers (what they cost is the difference)."""
    bandwidth_mbit: float | None = None
    """Per-link rate limit in Mbit/s (each direction); None: plain loopback."""
    matchmaking_window: float = 2.0
    """Seconds (ours) or ``min_matchmaking_time`` (hivemind)."""
    round_timeout: float = 300.0
    """Seconds a peer waits for one all-reduce before the round counts as failed."""
    log_level: int = logging.WARNING
    """Logging level inside the peer processes."""
    max_group_size: int | None = None
    """Ours in stages on a grid of groups of at most this many (``staged_runner``)."""

    def __post_init__(self) -> None:
        if self.peers < 2 or self.rounds < 1 or self.numel < 1:
            raise ConfigError("need --peers >= 2, --rounds >= 1 and --numel >= 1")
        if self.max_group_size is not None and self.max_group_size < 2:
            raise ConfigError("--max-group-size must be >= 2")
        if self.bandwidth_mbit is not None and not self.bandwidth_mbit > 0:
            raise ConfigError("--bandwidth-mbit must be > 0")


@dataclass(slots=True)
class BenchResult:
    """What ``bench allreduce`` prints and writes with ``--json``."""

    implementation: str
    config: dict[str, Any]
    seconds_per_round: list[float] = field(default_factory=list)
    """Per round, the slowest peer's all-reduce time (matchmaking excluded for ours)."""
    round_seconds_with_matchmaking: list[float] = field(default_factory=list)
    bytes_sent_per_peer: list[int] = field(default_factory=list)
    """Per peer, average per round, counted on our streams (ours) or estimated (hivemind)."""
    bytes_received_per_peer: list[int] = field(default_factory=list)
    link_bytes_sent_per_peer: list[int] = field(default_factory=list)
    """Per peer, average per round, veth counters (only with --bandwidth-mbit)."""
    result_sha256: list[str] = field(default_factory=list)
    max_abs_error: float = float("nan")
    failed_rounds: int = 0
    part_streams_per_peer: list[int] = field(default_factory=list)
    """Per peer, PART streams it opened in its last successful round (one per other member
    of each of its groups; as many REPORT streams again)."""
    stage_members_per_peer: list[list[int]] = field(default_factory=list)
    """Per peer, the members of each of its stage groups in its last successful round
    (one entry: the round ran flat; ``[8, 6]``: staged in 8s, then across 6 cells)."""
    ok_peers_per_round: list[int] = field(default_factory=list)
    """Per round, the peers whose all-reduce succeeded."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def make_input(index: int, round_: int, numel: int) -> torch.Tensor:
    """The seeded outer-gradient stand-in of peer ``index`` in round ``round_``."""
    generator = torch.Generator().manual_seed(1_000 * round_ + index)
    return torch.randn(numel, generator=generator) * 1e-3


def exact_mean(num_peers: int, round_: int, numel: int) -> torch.Tensor:
    """The exact FP32 mean of every peer's input (equal weights)."""
    acc = torch.zeros(numel, dtype=torch.float64)
    for index in range(num_peers):
        acc += make_input(index, round_, numel).double()
    return (acc / num_peers).float()


def run_allreduce_bench(config: BenchConfig) -> BenchResult:
    """Run the benchmark; always tears down processes and network namespaces."""
    implementation = "hivemind-fp16" if config.compare_hivemind else f"diloco-{config.codec}"
    if config.unverified and not config.compare_hivemind:
        implementation += "-unverified"
    result = BenchResult(implementation, asdict(config))
    sockets_before = set(glob.glob(_SOCKETS))
    with _network(config) as namespaces, _remove_stale_sockets(sockets_before):
        peers, processes = _start_peers(config, namespaces)
        try:
            for round_ in range(config.rounds):
                for peer in peers:  # inputs first, so that no peer starts while others compute
                    peer.send(("prepare", round_))
                for peer in peers:
                    _recv(peer, 600)
                for peer in peers:
                    peer.send(("round", round_))
                replies = [_recv(peer, _round_wait(config)) for peer in peers]
                ok = [r for r in replies if r["ok"]]
                result.ok_peers_per_round.append(len(ok))
                if len(ok) < len(replies):
                    result.failed_rounds += 1
                    logger.warning("round %d: %s", round_, [r.get("reason") for r in replies])
                if ok:
                    result.seconds_per_round.append(max(r["seconds"] for r in ok))
                    result.round_seconds_with_matchmaking.append(max(r["total"] for r in ok))
            for peer in peers:
                peer.send(("finish", None))
            finals = [_recv(peer, 600) for peer in peers]
        finally:
            _stop(peers, processes)
    rounds = max(1, config.rounds - result.failed_rounds)
    result.bytes_sent_per_peer = [f["bytes_sent"] // rounds for f in finals]
    result.bytes_received_per_peer = [f["bytes_received"] // rounds for f in finals]
    if namespaces:
        result.link_bytes_sent_per_peer = [f["link_tx"] // rounds for f in finals]
    result.result_sha256 = [f["sha256"] for f in finals]
    result.part_streams_per_peer = [f["streams"] for f in finals]
    result.stage_members_per_peer = [f["stages"] for f in finals]
    result.max_abs_error = finals[0]["max_abs_error"]
    return result


def round_timeouts(config: BenchConfig) -> RoundTimeouts:
    """The peers' round timeouts (ours)."""
    return RoundTimeouts(
        matchmaking_window=config.matchmaking_window,
        join_timeout=max(2.0, config.matchmaking_window),
        sender_timeout=config.round_timeout / 2,
        reducer_timeout=config.round_timeout / 2,
        report_timeout=10.0,
        connect_timeout=10.0,
    )


def _round_wait(config: BenchConfig) -> float:
    """Seconds the driver waits for a peer's round: the peer's own bound
    (``RoundBudget.round_end``), and a minute. Waiting ``round_timeout`` only gave up on a
    flat 48-peer round that was still in its checks."""
    budget = RoundBudget.of(round_timeouts(config))
    size = config.max_group_size
    stages = None if size is None else num_stages(config.peers, size)
    return budget.round_end(0.0, stages) + 60


_SOCKETS = "/tmp/hivemind-*.sock"


@contextlib.contextmanager
def _remove_stale_sockets(before: set[str]) -> Iterator[None]:
    """On exit, remove the hivemind socket files that appeared meanwhile and that nobody
    listens on any more (hivemind's averager replicas leave theirs behind)."""
    try:
        yield
    finally:
        for path in set(glob.glob(_SOCKETS)) - before:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                try:
                    probe.connect(path)
                except ConnectionRefusedError:
                    with contextlib.suppress(FileNotFoundError):
                        os.remove(path)
                except OSError:
                    pass


def _recv(conn: Connection, timeout: float) -> dict[str, Any]:
    if not conn.poll(timeout):
        raise RuntimeError(f"a benchmark peer did not answer in {timeout:.0f} s")
    reply: dict[str, Any] = conn.recv()
    if "error" in reply:
        raise RuntimeError(f"a benchmark peer failed: {reply['error']}")
    return reply


STARTING = 8
"""Peers started at once: 48 starting together on 2 cores (each imports torch and starts
its DHT and p2pd) took over the 120 s a peer has to come up."""
PRELOAD = ["diloco.bench.allreduce"]
"""What the peers' fork server imports once (torch, hivemind and the protocol with it)."""


def _start_peers(
    config: BenchConfig, namespaces: list[str]
) -> tuple[list[Connection], list[mp.process.BaseProcess]]:
    ctx = launcher.fork_server(PRELOAD)
    conns: list[Connection] = []
    processes: list[mp.process.BaseProcess] = []
    initial: list[str] = []
    starting: list[Connection] = []
    for index in range(config.peers):
        if len(starting) == STARTING:  # no more than STARTING at once
            for conn in starting:
                _recv(conn, 120)
            starting.clear()
        parent, child = ctx.Pipe()
        namespace = namespaces[index] if namespaces else None
        host = f"/ip4/{netns.address(index)}/tcp/0" if namespace else "/ip4/127.0.0.1/tcp/0"
        process = ctx.Process(
            target=_peer_main, args=(child, index, config, initial, host, namespace)
        )
        process.start()
        processes.append(process)
        conns.append(parent)
        if index == 0:
            initial = _recv(parent, 120)["maddrs"][:1]
        else:
            starting.append(parent)
    for conn in starting:
        _recv(conn, 120)
    return conns, processes


def _stop(conns: list[Connection], processes: list[mp.process.BaseProcess]) -> None:
    """Ask every peer to exit; SIGKILL the session of any that does not (its DHT, p2pd)."""
    for conn in conns:
        with contextlib.suppress(OSError):
            conn.send(("exit", None))
    for process in processes:
        process.join(20)
        if process.is_alive() and process.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.join(5)


def _peer_main(
    conn: Connection,
    index: int,
    config: BenchConfig,
    initial: list[str],
    host: str,
    namespace: str | None,
) -> None:
    """One benchmark peer: one process, its own DHT, rounds on command.

    It leaves the driver's session (``_stop`` kills its own, DHT and p2pd included), so a
    terminal's signal does not reach it: it exits once the driver has ended, however, as
    its parent, the fork server, ends with the driver (``end_with_parent``), and its DHT
    process and p2pd follow it (``TiedDHT``).
    """
    os.setsid()
    end_with_parent(os.getppid(), lambda: None)
    mp.set_start_method("fork", force=True)  # hivemind's DHT and averager processes fork
    logging.basicConfig(level=config.log_level, format=f"[peer {index}] %(levelname)s %(message)s")
    torch.set_num_threads(1)
    try:
        if namespace:
            netns.enter(namespace)
        peer = _HivemindPeer if config.compare_hivemind else _DilocoPeer
        runner = peer(index, config, initial, host)
    except Exception as exc:
        conn.send({"error": repr(exc)})
        return
    conn.send({"maddrs": runner.maddrs})
    last: torch.Tensor | None = None
    delta = torch.empty(0)
    link_start = 0
    try:
        while True:
            command, arg = conn.recv()
            if command == "exit":
                break
            if command == "prepare":
                delta = make_input(index, arg, config.numel)
                conn.send({"ready": arg})
            elif command == "round":
                if arg == 0 and namespace:
                    link_start = netns.link_tx_bytes()
                start = time.perf_counter()
                try:
                    last, seconds = runner.round(arg, delta)
                    total = time.perf_counter() - start
                    conn.send({"ok": True, "seconds": seconds, "total": total})
                except RoundFailed as exc:
                    conn.send({"ok": False, "reason": exc.reason})
            elif command == "finish":
                error = float("nan")
                if index == 0 and last is not None:
                    exact = exact_mean(config.peers, config.rounds - 1, config.numel)
                    error = float((last - exact).abs().max())
                sha = hashlib.sha256(last.numpy().tobytes()).hexdigest() if last is not None else ""
                conn.send(
                    {
                        "sha256": sha,
                        "max_abs_error": error,
                        "bytes_sent": runner.bytes_sent,
                        "bytes_received": runner.bytes_received,
                        "link_tx": netns.link_tx_bytes() - link_start if namespace else 0,
                        "streams": runner.streams,
                        "stages": runner.stage_members,
                    }
                )
    finally:
        runner.close()


class _DilocoPeer:
    def __init__(self, index: int, config: BenchConfig, initial: list[str], host: str) -> None:
        from diloco.codecs import get_codec
        from diloco.protocol.runtime.network import NetworkOptions
        from diloco.protocol.swarm import Swarm
        from diloco.protocol.swarm_reducer import SwarmReducer
        from diloco.protocol.wire.run_id import make_run_id

        self.config = config
        run_id = make_run_id("bench", {"numel": config.numel, "codec": config.codec})
        net = NetworkOptions(initial_peers=tuple(initial), host_maddrs=(host,))
        self.swarm = Swarm(run_id, net)
        timeouts = round_timeouts(config)
        self.reducer = SwarmReducer(
            self.swarm,
            get_codec(config.codec),
            timeouts=timeouts,
            target_group_size=config.peers,
            verify=not config.unverified,
            max_group_size=config.max_group_size,
            # the plain weighted mean: the benchmark's error is against the exact FP32 mean,
            # and its inputs are honest (median clipping would shorten them, by design)
            clip_factor=0.0,
        )
        self.maddrs = self.swarm.maddrs
        self.bytes_sent = self.bytes_received = self.streams = 0
        self.stage_members: list[int] = []

    def round(self, round_: int, delta: torch.Tensor) -> tuple[torch.Tensor, float]:
        from diloco.protocol.core.reducer import Contribution, RoundKey

        key = RoundKey(0, round_ + 1)
        result = self.reducer.reduce(key, [Contribution("me", delta, 1.0)]).result()
        self.bytes_sent += result.bytes_sent
        self.bytes_received += result.bytes_received
        stages = [m.members for m in result.stages] or [len(result.members)]
        self.streams = sum(m - 1 for m in stages)
        self.stage_members = stages
        return result.delta, self.reducer.timings[key][1]

    def close(self) -> None:
        self.swarm.shutdown()


class _HivemindPeer:
    """hivemind's own averager, FP16 on the wire, on the same peers and sizes."""

    def __init__(self, index: int, config: BenchConfig, initial: list[str], host: str) -> None:
        from hivemind.averaging import DecentralizedAverager
        from hivemind.compression import Float16Compression

        from diloco.protocol.runtime.network import NetworkOptions
        from diloco.protocol.swarm import make_dht

        self.config = config
        self.dht = make_dht(NetworkOptions(initial_peers=tuple(initial), host_maddrs=(host,)))
        self.tensor = torch.zeros(config.numel)
        self.averager = DecentralizedAverager(
            [self.tensor],
            self.dht,
            prefix="bench",
            start=True,
            target_group_size=config.peers,
            min_group_size=config.peers,
            min_matchmaking_time=config.matchmaking_window,
            request_timeout=1.0,
            compression=Float16Compression(),
            allreduce_timeout=config.round_timeout,
        )
        self.maddrs = [str(a) for a in self.dht.get_visible_maddrs()]
        # FP16 both phases: (M-1)/M of the vector out as sender, as much out as reducer.
        self._per_round = int(2 * (config.peers - 1) / config.peers * config.numel * 2)
        self.bytes_sent = self.bytes_received = self.streams = 0
        self.stage_members = [config.peers]

    def round(self, round_: int, delta: torch.Tensor) -> tuple[torch.Tensor, float]:
        with self.averager.get_tensors() as tensors:
            tensors[0].copy_(delta)
        start = time.perf_counter()
        gathered = self.averager.step(timeout=self.config.round_timeout)
        seconds = time.perf_counter() - start
        if gathered is None or len(gathered) < self.config.peers:
            raise RoundFailed(0, round_ + 1, "hivemind averager step failed")
        self.bytes_sent += self._per_round
        self.bytes_received += self._per_round
        with self.averager.get_tensors() as tensors:
            return tensors[0].clone(), seconds

    def close(self) -> None:
        self.averager.shutdown()
        self.dht.shutdown()


@contextlib.contextmanager
def _network(config: BenchConfig) -> Iterator[list[str]]:
    """Per-peer namespaces behind links throttled both ways; removed on exit."""
    if config.bandwidth_mbit is None:
        yield []
        return
    shaping = netns.Shaping(rate=f"{config.bandwidth_mbit}mbit")
    with netns.hosts(f"{os.getpid() % 100000}", config.peers, shaping) as names:
        yield names


def summary(result: BenchResult) -> str:
    """A few human lines for the terminal."""
    seconds = result.seconds_per_round
    with_matchmaking = ", ".join(f"{s:.3f}" for s in result.round_seconds_with_matchmaking)
    config = result.config
    lines = [
        f"{result.implementation}: {config['peers']} peers, {config['numel']:,} values",
        f"  seconds per round (all-reduce): {', '.join(f'{s:.3f}' for s in seconds)}"
        + (f"  (median {statistics.median(seconds):.3f})" if seconds else ""),
        f"  with matchmaking: {with_matchmaking}",
        f"  bytes sent per peer per round: {result.bytes_sent_per_peer}",
        f"  bytes received per peer per round: {result.bytes_received_per_peer}",
    ]
    if result.link_bytes_sent_per_peer:
        lines.append(f"  link bytes sent per peer per round: {result.link_bytes_sent_per_peer}")
    lines += [
        f"  identical results: {len(set(result.result_sha256)) == 1}",
        f"  result sha256 per peer: {[sha[:16] + '...' for sha in result.result_sha256]}",
        f"  max abs error vs exact FP32 mean: {result.max_abs_error:.3g}",
        f"  failed rounds: {result.failed_rounds}",
        f"  part streams per peer: {sorted(set(result.part_streams_per_peer))}",
        f"  stage group sizes: {sorted({tuple(m) for m in result.stage_members_per_peer})}",
        f"  peers that applied each round: {result.ok_peers_per_round}",
    ]
    return "\n".join(lines)
