"""Hostile peers that lie about their speed (the pace attack).

``python hostile_pace.py paper K --initial-peers ADDR [--listen MADDR]``: reads the run
configuration like a joiner, makes ``K`` Ed25519 identities of its own (none runs a daemon or
joins a round) and, until killed, stores under each one a validly signed node record
claiming a full-batch step of ``FAST`` seconds: under the former pace rule (the lower median
of every record's claim) two such records cut every honest node of a two-node swarm to one
row per step. Each record copies the newest honest record's step and fragments, so it
claims nothing else a node would act on. It prints one JSON line when ready
(``{"ready": "pace", "peer_id": ..., "sybils": [...]}``) and one (``{"stored": N}``) after
every refresh.

``python hostile_pace.py work DILOCO-NODE-ARGS...``: a working liar. It runs ``diloco-node``
with these arguments, a real node that trains its full batch and joins every round with
its true weight, except that every node record it publishes claims ``FAST`` seconds per
step. Under the former rule it alone cuts an honest partner to one row per step.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import torch
from hivemind.utils import get_dht_time

from diloco.cli import main as diloco_node
from diloco.node.swarm.node import SwarmNode
from diloco.node.swarm.pinned_run import discover_run
from diloco.protocol.records.nodes import NodeRecord, nodes_key
from diloco.protocol.runtime.network import NetworkOptions
from diloco.protocol.swarm import Swarm
from diloco.protocol.trust.envelopes import pack_payload, seal
from diloco.protocol.trust.identity import Identity
from diloco.protocol.wire.run_id import make_run_id

FAST = 1e-6
"""Claimed seconds of one full-batch inner step."""
LOOP_SECONDS = 2.0
TTL = 30.0


def lie(swarm: Swarm, run_id: str, k: int) -> None:
    identities = [Identity.generate() for _ in range(k)]
    names = {i.peer_id for i in identities}
    ready = {"ready": "pace", "peer_id": swarm.peer_id.to_base58(), "sybils": sorted(names)}
    print(json.dumps(ready), flush=True)
    stored = 0
    while True:
        honest = [r for r in swarm.read_records() if r.peer_id not in names]
        newest = max(honest, key=lambda r: r.global_step, default=None)
        step, fragments = (newest.global_step, newest.fragments) if newest else (0, ())
        for identity in identities:
            record = NodeRecord(identity.peer_id, (), step, fragments, 1e9, "0.0.0-pace", FAST)
            expiration = get_dht_time() + TTL
            payload = pack_payload(record.to_wire())
            envelope = seal(identity, nodes_key(run_id), payload, expiration)
            swarm.dht.store(nodes_key(run_id), envelope, expiration, subkey=identity.peer_id)
            stored += 1
        print(json.dumps({"stored": stored}), flush=True)
        time.sleep(LOOP_SECONDS)


def work(args: list[str]) -> None:
    honest_record = SwarmNode._record

    def record(node: SwarmNode, tokens_per_s: float) -> NodeRecord:
        return dataclasses.replace(honest_record(node, tokens_per_s), step_seconds=FAST)

    SwarmNode._record = record  # type: ignore[method-assign]
    diloco_node(args)


def main() -> None:
    if sys.argv[1:2] == ["work"]:
        work(sys.argv[2:])
        return
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["paper"])
    parser.add_argument("k", type=int, help="paper keys to lie with")
    parser.add_argument("--initial-peers", nargs="+", required=True)
    parser.add_argument("--listen", default="/ip4/127.0.0.1/tcp/0")
    args = parser.parse_args()
    torch.set_num_threads(1)
    net = NetworkOptions(initial_peers=tuple(args.initial_peers), host_maddrs=(args.listen,))
    run, _, dht = discover_run(net)
    swarm = Swarm(make_run_id(run.name, run.to_dict()), net, dht=dht)
    lie(swarm, swarm.run_id, args.k)


if __name__ == "__main__":
    main()
