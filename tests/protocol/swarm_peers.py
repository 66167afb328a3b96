"""Real peer processes for the swarm tests: spawn, command, fault-inject, kill, clean up.

Each peer is a ``forkserver``-context process in its own session (so SIGKILL of its process
group takes its DHT process and p2pd along, like a machine that dies). Faults are
``AllReduceRunner``, ``PartServer`` and ``Matchmaker`` subclasses chosen by the ``Fault``
enum (``faults`` holds those the in-process tests share); the runner's and server's reach
the peer's rounds through the reducer's fault hook (``SwitchedFaults``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing as mp
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import torch
from faults import (
    LYING_REDUCER,
    Fault,
    Injected,
    Member,
    ScaledContribution,
    SilentLeader,
    SilentSender,
    corrupt_sender,
    injected,
)
from hivemind.p2p import PeerID
from hivemind.utils.mpfuture import MPFuture

from diloco.bench import launcher
from diloco.codecs import get_codec
from diloco.errors import ProtocolError, RoundFailed
from diloco.protocol.allreduce.member import AllReduceRunner
from diloco.protocol.allreduce.part_server import PartServer
from diloco.protocol.core.demotion import Demotion
from diloco.protocol.core.group import GroupInfo, RoundTimeouts
from diloco.protocol.core.reducer import Contribution, RoundKey
from diloco.protocol.matchmaking.late import LatePeers
from diloco.protocol.matchmaking.lobby import leader_rank
from diloco.protocol.matchmaking.matchmaker import Matchmaker
from diloco.protocol.records.nodes import FragmentVersion, NodeRecord
from diloco.protocol.runtime.network import NetworkOptions
from diloco.protocol.runtime.streams import write_frame
from diloco.protocol.state.fragment import FragmentState, OuterState
from diloco.protocol.swarm import Swarm
from diloco.protocol.swarm_reducer import SwarmReducer
from diloco.protocol.wire.frames import Kind
from diloco.protocol.wire.run_id import make_run_id

UNIT = float(os.environ.get("DILOCO_TEST_TIME_UNIT", "1.0"))
"""One scaled time unit (seconds); raise it on a slow machine."""

TIMEOUTS = RoundTimeouts(
    matchmaking_window=1.0,
    join_timeout=2.0,
    sender_timeout=8.0,
    reducer_timeout=6.0,
    report_timeout=3.0,
    connect_timeout=3.0,
    start_floor=3.0,
).scaled(UNIT)
"""The start bound's floor at 3 s (the node's is 1 s): the peers share two cores with the
suite's other lanes, and one descheduled past 1 s was dropped from a round that every test
here expects all of them in (twice, in work-tree runs of the whole suite)."""
LOG_LEVEL = os.environ.get("DILOCO_TEST_LOG_LEVEL", "WARNING")
"""The peers' level for diloco's log (the "log" command changes it for a while)."""
RUN_ID = make_run_id("test", {"purpose": "protocol tests"})


_notify_lock = threading.Lock()
_conn: Connection | None = None


_reducer: SwarmReducer | None = None
"""This peer's reducer (one per process), for the faults that report what it holds."""


def _notify(message: tuple[Any, ...]) -> None:
    assert _conn is not None
    with _notify_lock:
        _conn.send(message)


class StallMember(AllReduceRunner):
    """Joins the group, then sends and averages nothing (frozen, as under SIGSTOP); its
    server still reads what others send it.

    It says it is stalled only once every other member has sent it a chunk, so is in the
    round (and says whether its reducer counts the round as in a group, as a stopping node
    asks it): as leader it may have handed its GROUP to p2pd but not yet to every follower,
    and a kill then would split the group instead (a leader dying during matchmaking is
    another test's case, ``test_dead_leader_followers_take_over_and_complete``).
    """

    async def run(self) -> Any:
        while len(self.server.reducer.received) < self.num_members - 1:
            await asyncio.sleep(0.02)
        assert _reducer is not None
        _notify(("stalled", "member", _reducer.in_group(self.group.key)))
        await asyncio.sleep(1e6)


class DyingLeader(Matchmaker):
    """Leads, and as soon as the first member has JOINed dies like a machine losing power
    (SIGKILL of its whole session: process, DHT process, p2pd)."""

    async def _lead(self, key: RoundKey, lobby: Any, view: set[PeerID], wait: float) -> Any:
        await lobby.changed.wait()
        os.killpg(os.getpid(), signal.SIGKILL)


class CutFirstJoin(Matchmaker):
    """Its first JOIN stream of every round is cut right after the JOIN went out (a stream
    lost in transit); it then asks again, as any follower does after a transport error."""

    async def _call_join(self, leader: PeerID, request: Any) -> tuple[Kind, bytes]:
        cut: set[Any] = self.__dict__.setdefault("_cut", set())
        if request.tag in cut:
            return await super()._call_join(leader, request)
        cut.add(request.tag)
        _, _, writer = await self.p2p.call_binary_stream_handler(leader, self.handler_name)
        await write_frame(writer, Kind.JOIN, request.serialize())
        await asyncio.sleep(0.05)
        writer.close()
        raise ConnectionResetError("test fault: JOIN stream cut")


def dying_in_stage(stage: int) -> type[AllReduceRunner]:
    """A runner that, in stage ``stage`` of a staged round, dies like a machine losing power
    once its own part has a contribution (mid-stage); its earlier stages run as usual."""
    started: dict[Any, int] = {}

    class DyingInStage(AllReduceRunner):
        async def run(self) -> Any:
            started[self.group.key] = started.get(self.group.key, 0) + 1
            if started[self.group.key] != stage + 1:
                return await super().run()
            running = asyncio.create_task(super().run())
            while not self.server.reducer.received and not running.done():
                await asyncio.sleep(0.01)
            _notify(("dying", stage))
            os.killpg(os.getpid(), signal.SIGKILL)

    return DyingInStage


def matchmaker_type(fault: Fault) -> type[Matchmaker]:
    return {
        Fault.DIE_AS_LEADER: DyingLeader,
        Fault.CUT_FIRST_JOIN: CutFirstJoin,
        Fault.SILENT_LEADER: SilentLeader,
    }.get(fault, Matchmaker)


def write_leading_identity(path: str, others: list[str], key: str) -> str:
    """Write an Ed25519 identity (libp2p protobuf) that ranks before every peer of
    ``others`` to lead the round of DHT key ``key`` (``leader_rank``); return its peer id
    (base58). About ``len(others) + 1`` keys are drawn."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from hivemind.proto import crypto_pb2

    raw = serialization.Encoding.Raw
    first = min(leader_rank(key, PeerID.from_base58(peer)) for peer in others)
    while True:
        private_key = Ed25519PrivateKey.generate()
        private = private_key.private_bytes(
            raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
        )
        public = private_key.public_key().public_bytes(raw, serialization.PublicFormat.Raw)
        marshalled = crypto_pb2.PublicKey(key_type=crypto_pb2.KeyType.Ed25519, data=public)
        peer_id = bytes([0x00, 0x24]) + marshalled.SerializeToString()  # identity multihash
        if leader_rank(key, PeerID(peer_id)) < first:
            break
    message = crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.Ed25519, data=private + public)
    with open(path, "wb") as f:
        f.write(message.SerializeToString())
    return PeerID(peer_id).to_base58()


class SwitchedFaults:
    """A test peer's fault hook (``runners.Faults``): what it runs now, switched between
    rounds by the test's commands."""

    def __init__(self) -> None:
        self.now = Injected()

    def runner_type(self, group: GroupInfo) -> type[AllReduceRunner]:
        return self.now.runner_type(group)

    def server_type(self, group: GroupInfo) -> type[PartServer]:
        return self.now.server_type(group)


def member_fault(fault: Fault) -> Member:
    if fault in (Fault.NONE, Fault.DIE_AS_LEADER, Fault.CUT_FIRST_JOIN, Fault.SILENT_LEADER):
        return AllReduceRunner
    if fault == Fault.SILENT_SENDER:
        return SilentSender
    if fault == Fault.STALL_MEMBER:
        return StallMember
    if fault == Fault.LYING_REDUCER:
        return LYING_REDUCER
    if fault == Fault.SCALED_CONTRIBUTION:
        return ScaledContribution
    return corrupt_sender(fault)


def make_delta(numel: int, seed: int) -> torch.Tensor:
    """The deterministic contribution of a test peer (the test recomputes it)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(numel, generator=generator) * 1e-2


def make_state(num_fragments: int, numel: int, seed: int) -> OuterState:
    """A deterministic outer state (donor side and test side compute the same)."""
    generator = torch.Generator().manual_seed(seed)
    frags = {
        p: FragmentState(
            torch.randn(numel, generator=generator), torch.randn(numel, generator=generator), p + 3
        )
        for p in range(num_fragments)
    }
    return OuterState(global_step=1234, fragments=frags)


def _summary(result: Any) -> dict[str, Any]:
    import hashlib

    return {
        "ok": True,
        "sha256": hashlib.sha256(result.delta.numpy().tobytes()).hexdigest(),
        "members": list(result.members),
        "bytes_sent": result.bytes_sent,
        "bytes_received": result.bytes_received,
        "seconds": result.seconds,
        "stages": [(m.stage, m.members, m.bytes_sent, m.bytes_received) for m in result.stages],
    }


def peer_main(
    conn: Connection,
    initial_peers: list[str],
    codec: str,
    run_id: str = RUN_ID,
    identity_path: str | None = None,
) -> None:
    """Body of one peer process: serve commands from the test until "exit"."""
    global _conn, _reducer
    os.setsid()
    mp.set_start_method("fork", force=True)  # the DHT process forks, as in a real node
    # hivemind's MPFuture locks were made when the fork server imported it, so every peer
    # forked from it shares them: a peer killed holding one would stall the others. Its
    # own, as a spawned peer had.
    MPFuture.reset_backend()
    _conn = conn
    logging.basicConfig(
        level=logging.WARNING,
        format=f"%(created).3f [peer {os.getpid()}] %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("diloco").setLevel(LOG_LEVEL)
    if "GOLOG_LOG_LEVEL" in os.environ:  # diagnostics: p2pd's own log, e.g. "error,p2pd=debug"
        logging.getLogger("hivemind.p2p.p2p_daemon").setLevel(logging.DEBUG)
    # Each peer on its own loopback address: libp2p limits connections per source IP.
    pid = os.getpid()
    host = f"/ip4/127.{(pid >> 16) & 255}.{(pid >> 8) & 255}.{pid % 254 + 1}/tcp/0"
    net = NetworkOptions(
        initial_peers=tuple(initial_peers), host_maddrs=(host,), identity_path=identity_path
    )
    swarm = Swarm(run_id, net)
    sockets = [str(swarm.p2p._client_listen_maddr), *swarm.dht.run_coroutine(_daemon_sockets)]
    faults = SwitchedFaults()
    reducer = _reducer = SwarmReducer(swarm, get_codec(codec), timeouts=TIMEOUTS, faults=faults)
    _notify(("ready", swarm.peer_id.to_base58(), swarm.maddrs, sockets))
    served: list[OuterState] = []
    try:
        while True:
            command, args = conn.recv()
            if command == "exit":
                break
            if command == "codec":
                send, _, back = args.partition("/")  # "e3m0" or "none/e3m0"
                reducer.codec, reducer.return_codec = get_codec(send), get_codec(back or send)
                _notify(("ok",))
            elif command == "fault":
                faults.now = injected(member_fault(Fault(args)))
                reducer.matchmaker.__class__ = matchmaker_type(Fault(args))
                _notify(("ok",))
            elif command == "cap":  # the run's weight cap (a hostile peer ignores it: inf)
                reducer.max_weight = reducer.matchmaker.max_weight = args
                _notify(("ok",))
            elif command == "role":  # "client": nobody can dial it; "demoted": its parts failed
                reducer.client = args == "client"
                reducer.demotion = Demotion()
                if args == "demoted":
                    reducer.demotion.remaining = reducer.demotion.cooldown
                _notify(("ok",))
            elif command == "staged":  # (max group size, group size to wait for, verify, die in)
                reducer.max_group_size, target, verify, die = args
                reducer.matchmaker.target_group_size = target
                reducer.identity = swarm.dht.identity if verify else None
                faults.now = Injected() if die is None else Injected(dying_in_stage(die))
                _notify(("ok",))
            elif command == "timeouts":  # the rounds' timeouts from the next one on (alike on all)
                reducer.timeouts = args
                _notify(("ok",))
            elif command == "log":  # the level of diloco's log: "INFO" for a round to read
                logging.getLogger("diloco").setLevel(args)
                _notify(("ok",))
            elif command == "banned":
                _notify(("banned", swarm.bans.banned(PeerID.from_base58(args))))
            elif command == "forgive":  # a fresh start between tests of the shared pool
                swarm.bans._peers.clear()
                reducer.demotion = Demotion()  # faults of earlier tests failed its parts
                # late JOINs of earlier tests would keep it on the widest window for a minute,
                # and so would the peers it served state to, taken at its next round
                reducer.matchmaker.late = LatePeers()
                swarm.take_state_takers()
                # a slow test's round trips would stretch the next tests' windows
                reducer.rtt_samples.clear()
                _notify(("ok",))
            elif command == "reduce":
                futures = [
                    reducer.reduce(
                        RoundKey(f, k), [Contribution("me", make_delta(n, seed), w, *prior)]
                    )
                    for f, k, n, seed, w, *prior in args
                ]
                results = []
                for (f, k, *_), future in zip(args, futures, strict=True):
                    try:
                        results.append(_summary(future.result()))
                    except RoundFailed as exc:
                        results.append({"ok": False, "reason": exc.reason})
                    results[-1]["in_group"] = reducer.in_group(RoundKey(f, k))  # ended: False
                _notify(("done", results))
            elif command == "serve_state":
                num_fragments, numel, seed, poisoned = args
                state = make_state(num_fragments, numel, seed)
                if poisoned:  # a donor whose momentum went non-finite: must be refused
                    state.fragments[0].momentum[0] = float("nan")
                if not served:
                    swarm.serve_state(lambda: served[-1])
                served.append(state)
                record = NodeRecord(
                    swarm.peer_id.to_base58(),
                    tuple(swarm.maddrs),
                    state.global_step,
                    tuple(
                        FragmentVersion(p, s.version, s.sha256())
                        for p, s in state.fragments.items()
                    ),
                    100.0,
                    "test",
                )
                _notify(("ok", swarm.publish_record(record, ttl=60.0)))
            elif command == "fetch_state":
                fragments, expected, donors = args
                donor_ids = None if donors is None else [PeerID.from_base58(d) for d in donors]
                try:
                    state = swarm.fetch_state(fragments, expected, donor_ids)
                except ProtocolError as exc:
                    _notify(("error", str(exc)))
                    continue
                _notify(
                    (
                        "state",
                        state.global_step,
                        {p: (s.version, s.sha256()) for p, s in state.fragments.items()},
                    )
                )
            elif command == "records":
                _notify(("records", [r.peer_id for r in swarm.read_records()]))
    finally:
        reducer.close()
        swarm.shutdown()


async def _daemon_sockets(_dht: Any, node: Any) -> list[str]:
    return [str(node.p2p.daemon_listen_maddr), str(node.p2p._client_listen_maddr)]


@dataclass
class PeerProcess:
    process: mp.process.BaseProcess
    conn: Connection
    peer_id: str = ""
    maddrs: list[str] = field(default_factory=list)
    sockets: list[str] = field(default_factory=list)

    def send(self, command: str, args: Any = None) -> None:
        self.conn.send((command, args))

    def recv(self, timeout: float) -> tuple[Any, ...]:
        deadline = time.monotonic() + timeout
        while not self.conn.poll(0.2):
            if not self.process.is_alive():
                raise RuntimeError(f"peer {self.process.pid} died ({self.process.exitcode})")
            if time.monotonic() > deadline:
                raise TimeoutError(f"peer {self.process.pid} did not answer in {timeout:.0f} s")
        return self.conn.recv()

    def kill(self) -> None:
        """SIGKILL the peer's whole session: the process, its DHT process and p2pd."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.join(10)


PRELOAD = ["diloco.protocol.swarm_reducer", "diloco.protocol.swarm"]
"""What the peers' fork server (``launcher.fork_server``) imports once, torch and hivemind
with them: a spawned peer also exited through the interpreter's full finalization, seconds
for a swarm on two cores."""


def start_peer(
    initial_peers: list[str],
    codec: str = "none",
    timeout: float = 120.0,
    run_id: str = RUN_ID,
    identity_path: str | None = None,
) -> PeerProcess:
    ctx = launcher.fork_server(PRELOAD)
    parent, child = ctx.Pipe()
    process = ctx.Process(
        target=peer_main, args=(child, initial_peers, codec, run_id, identity_path), daemon=False
    )
    process.start()
    peer = PeerProcess(process, parent)
    _, peer.peer_id, peer.maddrs, peer.sockets = peer.recv(timeout)
    return peer


def start_swarm(num_peers: int, codec: str = "none") -> list[PeerProcess]:
    first = start_peer([], codec)
    rest = [_start_async(first.maddrs[:1], codec) for _ in range(num_peers - 1)]
    return [first, *[finish() for finish in rest]]


def _start_async(initial_peers: list[str], codec: str) -> Any:
    ctx = launcher.fork_server(PRELOAD)
    parent, child = ctx.Pipe()
    process = ctx.Process(target=peer_main, args=(child, initial_peers, codec), daemon=False)
    process.start()

    def finish() -> PeerProcess:
        peer = PeerProcess(process, parent)
        _, peer.peer_id, peer.maddrs, peer.sockets = peer.recv(120.0)
        return peer

    return finish


def stop_peers(peers: list[PeerProcess]) -> None:
    """Ask every peer to exit, then SIGKILL what is left and remove its socket files."""
    for peer in peers:
        with contextlib.suppress(OSError, BrokenPipeError):
            peer.send("exit")
    deadline = time.monotonic() + 15
    for peer in peers:
        peer.process.join(max(0.1, deadline - time.monotonic()))
        peer.kill()
        for maddr in peer.sockets:
            path = maddr.removeprefix("/unix")
            if path.startswith("/tmp/hivemind-"):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(path)


def run_rounds(
    peers: list[PeerProcess], specs: list[list[tuple[int, int, int, int, float]]], timeout: float
) -> list[list[dict[str, Any]]]:
    """Send each peer its round specs ``(fragment, round, numel, seed, weight)`` at once."""
    for peer, spec in zip(peers, specs, strict=True):
        peer.send("reduce", spec)
    return [peer.recv(timeout)[1] for peer in peers]


def command(peers: list[PeerProcess], name: str, args: object, timeout: float = 30.0) -> None:
    """Send the same command to ``peers`` and check every one acknowledged it."""
    for peer in peers:
        peer.send(name, args)
    for peer in peers:
        assert peer.recv(timeout)[0] == "ok"
