"""A hostile peer built from the project's own classes, for the attack tests.

Run as ``python hostile_claims.py MODE --initial-peers ADDR [--listen MADDR]``. It reads the
run configuration like a joiner, then misbehaves with validly signed records (its own
Ed25519 identities) until killed:

``forge`` (attack 1, and attack 6's state spam): publishes a node record claiming every
fragment at version 1000 and the run's last step, vouches for that forged state (its own
vouches only), serves an all-zero state at those versions, and opens ``SPAM`` STATE_REQ
streams at once to every honest node every round of its loop.

``sybil`` (attack 6, crowding donors out): publishes records under ``SYBILS`` identities of
its own, none of which runs a daemon (a donor that never answers): a third copy the honest
nodes' newest claims exactly (version and hash) a round ahead in step, a third claim one
round newer than the honest nodes with the zero state's hash and vouch for it with the
honest nodes named as co-members, a third claim the run's last step.

``paper`` (evidence: identities that never worked in a round): ``--keys K`` identities of its
own (no daemon) and the process's own serve an all-zero state at the versions of the
run's last step. Each of them publishes a record claiming it, at the run's last step, and
vouches for it under a member list it writes itself: the K + 1 identities, and the honest
nodes too for odd fragments. Before the evidence rule this was a majority of the list (a
vouched state) and the vouchers' step the robust step: both honest nodes adopted zeros.

It prints one JSON line when ready (``{"ready": ..., "peer_id": ..., "sybils": [...]}``)
and, in ``forge`` mode, a line of spam counts after every burst.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import time

import torch
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time

from diloco.errors import ProtocolError
from diloco.node.model.fragments import last_sent_round, model_fragments
from diloco.node.model.transformer import Transformer
from diloco.node.swarm.pinned_run import discover_run
from diloco.protocol.records.nodes import (
    FragmentVersion,
    NodeRecord,
    Vouch,
    nodes_key,
    publish_vouches,
    vouch_key,
    vouch_payload,
)
from diloco.protocol.runtime.network import NetworkOptions
from diloco.protocol.state.fragment import FragmentState, OuterState
from diloco.protocol.state.transfer import fetch_state
from diloco.protocol.swarm import Swarm
from diloco.protocol.trust.envelopes import pack_payload, seal
from diloco.protocol.trust.identity import Identity
from diloco.protocol.wire.run_id import make_run_id

FORGED_VERSION = 1000
SPAM = 4
"""STATE_REQ streams opened at once to each honest node per loop: more than the one a peer
may have open, so some are refused every loop, and past the burst most are. A refused
request still costs a stream through both p2pds: at 20 a loop, the refusals were most of
the spam's CPU (benchmarks/RESULTS.md), and they showed nothing 4 does not."""
SYBILS = 9
LOOP_SECONDS = 2.0
TTL = 30.0


def zero_hash(numel: int) -> str:
    """The state hash of zeros: outer params then momentum, FP32."""
    return hashlib.sha256(bytes(8 * numel)).hexdigest()


def store_as(swarm: Swarm, identity: Identity, key: str, payload: bytes) -> None:
    """Store ``payload`` under ``key`` signed by ``identity`` (any key, not the daemon's)."""
    expiration = get_dht_time() + TTL
    envelope = seal(identity, key, payload, expiration)
    swarm.dht.store(key, envelope, expiration, subkey=identity.peer_id)


def forge(swarm: Swarm, run_id: str, steps: int, numel: list[int]) -> None:
    me = swarm.peer_id.to_base58()
    zeros = {
        p: FragmentState(torch.zeros(n), torch.zeros(n), FORGED_VERSION)
        for p, n in enumerate(numel)
    }
    swarm.serve_state(lambda: OuterState(steps, zeros))
    frags = tuple(FragmentVersion(p, FORGED_VERSION, zero_hash(n)) for p, n in enumerate(numel))
    record = NodeRecord(me, tuple(swarm.maddrs), steps, frags, 1e9, "0.0.0-hostile")
    print(json.dumps({"ready": "forge", "peer_id": me, "sybils": []}), flush=True)
    served = refused = 0
    while True:
        swarm.publish_record(record, TTL)
        for p, n in enumerate(numel):
            vouch = Vouch(me, p, FORGED_VERSION, zero_hash(n), (me,))
            swarm.call(publish_vouches(swarm.dht, run_id, [vouch], TTL))
        honest = [r.peer_id for r in swarm.read_records() if r.peer_id != me]
        for peer in honest:
            results = swarm.call(spam(swarm, run_id, PeerID.from_base58(peer)), 120.0)
            served += sum(isinstance(r, OuterState) for r in results)
            refused += sum(isinstance(r, ProtocolError) and "BUSY" in str(r) for r in results)
        print(json.dumps({"served": served, "refused": refused}), flush=True)
        time.sleep(LOOP_SECONDS)


async def spam(swarm: Swarm, run_id: str, peer: PeerID) -> list[object]:
    asks = [fetch_state(swarm.p2p, peer, run_id, swarm.digest) for _ in range(SPAM)]
    return list(await asyncio.gather(*asks, return_exceptions=True))


def sybils(swarm: Swarm, run_id: str, steps: int, sync_every: int, numel: list[int]) -> None:
    me = swarm.peer_id.to_base58()
    identities = [Identity.generate() for _ in range(SYBILS)]
    names = {i.peer_id for i in identities}
    # In order: the i-th Sybil makes claims of kind i % 3 (module docstring).
    sybil_ids = [i.peer_id for i in identities]
    print(json.dumps({"ready": "sybil", "peer_id": me, "sybils": sybil_ids}), flush=True)
    num_fragments = len(numel)
    while True:
        honest = [r for r in swarm.read_records() if r.peer_id not in names]
        front = max((r.global_step for r in honest), default=0)
        newest = max(honest, key=lambda r: sum(f.version for f in r.fragments), default=None)
        members = sorted(r.peer_id for r in honest)
        for i, identity in enumerate(identities):
            kind = i % 3
            step = front + sync_every if kind < 2 else steps
            if kind == 0 and newest is not None:
                frags = newest.fragments  # the honest newest claims, copied exactly
            else:
                frags = tuple(
                    FragmentVersion(p, last_sent_round(step, p, sync_every, num_fragments), h)
                    for p, h in enumerate(zero_hash(n) for n in numel)
                )
            record = NodeRecord(identity.peer_id, (), step, frags, 1e9, "0.0.0-sybil")
            store_as(swarm, identity, nodes_key(run_id), pack_payload(record.to_wire()))
            if kind == 1:
                for f in frags:
                    if f.version >= 1:
                        co = tuple(sorted({identity.peer_id, *members}))
                        vouch = Vouch(identity.peer_id, f.fragment, f.version, f.state_hash, co)
                        key = vouch_key(run_id, f.fragment)
                        store_as(swarm, identity, key, vouch_payload([vouch]))
        time.sleep(LOOP_SECONDS)


def paper(
    swarm: Swarm, run_id: str, steps: int, sync_every: int, numel: list[int], keys: int
) -> None:
    me = swarm.peer_id.to_base58()
    identities = [Identity.generate() for _ in range(keys)]
    papers = [i.peer_id for i in identities]
    versions = [last_sent_round(steps, p, sync_every, len(numel)) for p in range(len(numel))]
    zeros = {
        p: FragmentState(torch.zeros(n), torch.zeros(n), versions[p]) for p, n in enumerate(numel)
    }
    swarm.serve_state(lambda: OuterState(steps, zeros))
    frags = tuple(FragmentVersion(p, versions[p], zero_hash(n)) for p, n in enumerate(numel))
    print(json.dumps({"ready": "paper", "peer_id": me, "sybils": papers}), flush=True)
    while True:
        honest = {r.peer_id for r in swarm.read_records()} - {me, *papers}
        swarm.publish_record(NodeRecord(me, tuple(swarm.maddrs), steps, frags, 1e9, "0"), TTL)
        for p, f in enumerate(frags):
            members = tuple(sorted({me, *papers} | (honest if p % 2 else set())))
            mine = Vouch(me, p, f.version, f.state_hash, members)
            swarm.call(publish_vouches(swarm.dht, run_id, [mine], TTL))
            for identity in identities:
                vouch = Vouch(identity.peer_id, p, f.version, f.state_hash, members)
                store_as(swarm, identity, vouch_key(run_id, p), vouch_payload([vouch]))
        for identity in identities:
            record = NodeRecord(identity.peer_id, (), steps, frags, 1e9, "0.0.0-paper")
            store_as(swarm, identity, nodes_key(run_id), pack_payload(record.to_wire()))
        time.sleep(LOOP_SECONDS)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["forge", "sybil", "paper"])
    parser.add_argument("--keys", type=int, default=2, help="paper identities (``paper``)")
    parser.add_argument("--initial-peers", nargs="+", required=True)
    parser.add_argument("--listen", default="/ip4/127.0.0.1/tcp/0")
    args = parser.parse_args()
    torch.set_num_threads(1)
    net = NetworkOptions(initial_peers=tuple(args.initial_peers), host_maddrs=(args.listen,))
    run, _, dht = discover_run(net)
    run_id = make_run_id(run.name, run.to_dict())
    swarm = Swarm(run_id, net, dht=dht)
    model = Transformer(run.model_config())
    fragments = model_fragments(
        model, model.blocks, run.fragment_size, run.pattern, run.embedding_fragment
    )
    numel = [sum(p.numel() for _, p in params) for params in fragments]
    if args.mode == "forge":
        forge(swarm, run_id, run.steps, numel)
    elif args.mode == "paper":
        paper(swarm, run_id, run.steps, run.outer.sync_every, numel, args.keys)
    else:
        sybils(swarm, run_id, run.steps, run.outer.sync_every, numel)


if __name__ == "__main__":
    main()
