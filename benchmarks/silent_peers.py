"""Rounds with one silent peer among ``--peers`` real processes (docs/design.md "Liveness").

Spawns ``--peers`` peer processes (real p2pd, loopback) with a node's default round
timeouts (``RoundOptions``) and network options (adaptive part deadlines on), every peer
waiting for all (``target_group_size``); peer 0 is hostile:

- ``silent-leader``: honest as a follower; as leader it takes the JOINs and never sends
  GROUP (it holds them until its matchmaking bound);
- ``silent-member``: matchmakes honestly, reduces its own part, but sends no PART;
- ``none``: honest (the reference).

Every round all peers reduce a seeded vector at once, ``--pause`` seconds after the last
round ended (a silent member is charged at the sender deadline, 10 s: pause for its bans
to land before the next round, as rounds of a fragment are minutes apart in a run). A
round *succeeds* when every honest peer got a result and their results are identical.
Per round it records the honest peers' slowest round seconds (matchmaking included) and at
how many honest peers the silent one is banned by then. The JSON output records the
commit measured::

    flock /tmp/diloco-heavy.lock python benchmarks/silent_peers.py --fault silent-leader \
        --rounds 6 --json benchmarks/results/silent_leader.json

Run it with ``PYTHONPATH`` pointing at the tree to measure (before / after a change).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import logging
import multiprocessing as mp
import os
import signal
import statistics
import subprocess
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

FAULTS = ("none", "silent-leader", "silent-member")


def _hostile_types() -> tuple[type[Any], Any]:
    """The silent leader's matchmaker and the silent member's faults (``runners.Faults``;
    built in the peer process, from the tree measured)."""
    from diloco.errors import RoundFailed
    from diloco.protocol.allreduce.member import AllReduceRunner
    from diloco.protocol.allreduce.part_server import PartServer
    from diloco.protocol.matchmaking.matchmaker import Matchmaker

    class SilentLeader(Matchmaker):
        async def _lead(self, key: Any, lobby: Any, view: Any, wait: float) -> Any:
            await asyncio.sleep(self.timeouts.matchmaking)  # the JOINs wait, unanswered
            raise RoundFailed(key.fragment, key.round, "silent leader")

    class SilentSender(AllReduceRunner):
        async def _exchange(self, j: int) -> None:
            return None  # no PART to any reducer

    class SilentFaults:
        def runner_type(self, group: Any) -> type[AllReduceRunner]:
            return SilentSender

        def server_type(self, group: Any) -> type[PartServer]:
            return PartServer

    return SilentLeader, SilentFaults()


def _peer(conn: Connection, index: int, fault: str, peers: int, initial: list[str]) -> None:
    """One peer process: a swarm node's reducer; rounds on command."""
    os.setsid()
    mp.set_start_method("fork", force=True)
    logging.basicConfig(level=logging.ERROR)
    import torch

    from diloco.codecs import get_codec
    from diloco.errors import RoundFailed
    from diloco.node.config import RoundOptions
    from diloco.protocol.core.reducer import Contribution, RoundKey
    from diloco.protocol.runtime.network import NetworkOptions
    from diloco.protocol.swarm import Swarm
    from diloco.protocol.swarm_reducer import SwarmReducer
    from diloco.protocol.wire.run_id import make_run_id

    torch.set_num_threads(1)
    host = f"/ip4/127.0.{index // 200}.{index % 200 + 1}/tcp/0"
    swarm = Swarm(
        make_run_id("silent-peers", {"peers": peers}),
        NetworkOptions(initial_peers=tuple(initial), host_maddrs=(host,)),
    )
    leader, sender = _hostile_types()
    hostile = index == 0 and fault != "none"
    reducer = SwarmReducer(
        swarm,
        get_codec("e3m0"),
        timeouts=RoundOptions().timeouts(),
        target_group_size=peers,
        faults=sender if hostile and fault == "silent-member" else None,
    )
    if hostile and fault == "silent-leader":
        reducer.matchmaker.__class__ = leader
    conn.send({"maddrs": swarm.maddrs, "peer_id": swarm.peer_id.to_base58()})
    try:
        while True:
            command, arg = conn.recv()
            if command == "exit":
                break
            if command == "banned":
                from hivemind.p2p import PeerID

                conn.send({"banned": swarm.bans.banned(PeerID.from_base58(arg))})
                continue
            round_, numel = arg
            delta = torch.randn(numel, generator=torch.Generator().manual_seed(round_ * 97 + index))
            start = time.perf_counter()
            try:
                result = reducer.reduce(RoundKey(0, round_), [Contribution("me", delta, 1.0)])
                out = result.result()
                sha = hashlib.sha256(out.delta.numpy().tobytes()).hexdigest()
                reply = {"ok": True, "sha256": sha, "members": len(out.members)}
            except RoundFailed as exc:
                reply = {"ok": False, "reason": exc.reason}
            conn.send({**reply, "seconds": time.perf_counter() - start})
    finally:
        reducer.close()
        swarm.shutdown()


def _recv(conn: Connection, timeout: float) -> dict[str, Any]:
    if not conn.poll(timeout):
        raise RuntimeError(f"a peer did not answer in {timeout:.0f} s")
    reply: dict[str, Any] = conn.recv()
    return reply


def run(fault: str, peers: int, rounds: int, numel: int, pause: float) -> dict[str, Any]:
    """One swarm of ``peers``, ``rounds`` rounds with peer 0 ``fault``; rows and totals."""
    ctx = mp.get_context("spawn")
    conns: list[Connection] = []
    processes: list[Any] = []
    ids: list[str] = []
    initial: list[str] = []
    rows: list[dict[str, Any]] = []
    try:
        for index in range(peers):
            parent, child = ctx.Pipe()
            process = ctx.Process(target=_peer, args=(child, index, fault, peers, initial))
            process.start()
            conns.append(parent)
            processes.append(process)
            hello = _recv(parent, 180)
            ids.append(hello["peer_id"])
            initial = initial or hello["maddrs"][:1]
        for round_ in range(1, rounds + 1):
            time.sleep(pause if round_ > 1 else 0.0)
            for conn in conns:
                conn.send(("round", (round_, numel)))
            replies = [_recv(conn, 120) for conn in conns]
            honest = replies[1:] if fault != "none" else replies
            ok = all(r["ok"] for r in honest) and len({r.get("sha256") for r in honest}) == 1
            for conn in conns[1:]:
                conn.send(("banned", ids[0]))
            banned = [_recv(conn, 30)["banned"] for conn in conns[1:]]
            row = {
                "round": round_,
                "ok": ok,
                "seconds": round(max(r["seconds"] for r in honest), 3),
                "members": [r.get("members") for r in honest],
                "reasons": sorted({r["reason"] for r in honest if not r["ok"]}),
                "hostile_banned_at": sum(banned),
                "hostile": replies[0].get("reason") or f"ok, {replies[0].get('members')} members",
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.send(("exit", None))
        for process in processes:
            process.join(20)
            if process.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.join(5)
    seconds = [r["seconds"] for r in rows]
    return {
        "fault": fault,
        "peers": peers,
        "numel": numel,
        "pause": pause,
        "succeeded": sum(r["ok"] for r in rows),
        "rounds": rounds,
        "median_seconds": statistics.median(seconds),
        "max_seconds": max(seconds),
        "rows": rows,
    }


def _commit() -> str:
    """The commit of the tree measured: the one the ``diloco`` package is imported from."""
    import diloco

    tree = str(Path(diloco.__file__).parent)
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        return subprocess.run(
            ["git", "-C", tree, "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    return "unknown (not a git tree)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fault", choices=FAULTS, default="silent-leader")
    parser.add_argument("--peers", type=int, default=3, help="processes, e.g. 3")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--numel", type=int, default=100_000, help="values per vector")
    parser.add_argument("--repeats", type=int, default=1, help="fresh swarms, e.g. 3")
    parser.add_argument("--pause", type=float, default=0.0, help="seconds between rounds")
    parser.add_argument("--json", default=None, help="output file")
    args = parser.parse_args()
    runs = [
        run(args.fault, args.peers, args.rounds, args.numel, args.pause)
        for _ in range(args.repeats)
    ]
    for out in runs:
        print(
            f"{args.fault}: {out['succeeded']}/{out['rounds']} rounds, median "
            f"{out['median_seconds']:.2f} s, max {out['max_seconds']:.2f} s"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"commit": _commit(), "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
