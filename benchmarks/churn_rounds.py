"""Rounds applied / attempted with one protocol-only peer SIGKILLed per round.

Spawns ``--peers`` benchmark peers (``diloco.bench.allreduce``: real processes, real p2pd,
loopback). Every round all peers start reducing their seeded vectors; once matchmaking is
usually over (after a random 0.3 to 0.3 + ``--kill-spread`` seconds) one random peer
other than the bootstrap peer is SIGKILLed with its whole session (DHT process, p2pd), and
replaced by a fresh peer before the next round, so every round starts with ``--peers``. A
round is *applied* when every survivor got a result and all results are identical.

    python benchmarks/churn_rounds.py --peers 8 --rounds 6 --json out.json

Run it with ``PYTHONPATH`` pointing at the tree to measure (before / after a change).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import random
import signal
import time
from typing import Any

from diloco.bench.allreduce import BenchConfig, _peer_main, _recv, _stop
from diloco.bench.provenance import provenance


def _spawn(config: BenchConfig, index: int, initial: list[str]) -> tuple[Any, Any, list[str]]:
    """One benchmark peer bootstrapped from ``initial``: its pipe, process and addresses."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    args = (child, index, config, initial, "/ip4/127.0.0.1/tcp/0", None)
    process = ctx.Process(target=_peer_main, args=args)
    process.start()
    return parent, process, _recv(parent, 120)["maddrs"]


def run(peers: int, rounds: int, numel: int, kill_spread: float, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    config = BenchConfig(peers=peers, rounds=rounds, numel=numel, round_timeout=20.0)
    first, process, maddrs = _spawn(config, 0, [])
    initial = maddrs[:1]
    conns, processes = [first], [process]
    applied, rows = 0, []
    try:
        for index in range(1, peers):
            conn, process, _ = _spawn(config, index, initial)
            conns.append(conn)
            processes.append(process)
        for round_ in range(rounds):
            for conn in conns:
                conn.send(("prepare", round_))
            for conn in conns:
                _recv(conn, 120)
            for conn in conns:
                conn.send(("round", round_))
            victim = rng.randrange(1, peers)
            time.sleep(rng.uniform(0.3, 0.3 + kill_spread))
            pid = processes[victim].pid
            assert pid is not None
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            start = time.monotonic()
            replies = [
                _recv(conn, config.round_timeout * 3 + 60)
                for i, conn in enumerate(conns)
                if i != victim
            ]
            ok = [r for r in replies if r["ok"]]
            row = {
                "round": round_,
                "victim": victim,
                "survivors_ok": len(ok),
                "survivors": len(replies),
                "seconds_after_kill": round(time.monotonic() - start, 2),
                "reasons": sorted({str(r.get("reason")) for r in replies if not r["ok"]}),
            }
            applied += len(ok) == len(replies)
            rows.append(row)
            print(json.dumps(row), flush=True)
            processes[victim].join(5)
            conns[victim], processes[victim], _ = _spawn(config, victim, initial)
    finally:
        _stop(conns, processes)
    return {"peers": peers, "rounds": rounds, "numel": numel, "applied": applied, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--peers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--numel", type=int, default=200_000)
    parser.add_argument("--kill-spread", type=float, default=2.0, help="seconds, e.g. 2.0")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    out = run(args.peers, args.rounds, args.numel, args.kill_spread, args.seed)
    print(f"{out['peers']} peers: {out['applied']} / {out['rounds']} rounds applied")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out | {"provenance": provenance()}, f, indent=1)


if __name__ == "__main__":
    main()
