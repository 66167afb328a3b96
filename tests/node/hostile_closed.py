"""A hostile peer of a closed swarm for ``test_closed_swarm``, built from the project's classes.

``python hostile_closed.py --initial-peers ADDR --listen MADDR --keys K [--swarm-key FILE]``
learns the run of the node at ADDR (RUN_INFO is open to all), then, as one process with one
DHT node and K Ed25519 identities (the first its daemon's), does what swung honest nodes
before records carried proofs: under every identity it stores, signed, a node record
claiming step ``CLAIM`` with every fragment at the round of that step, an all-zero state's
hash and 1e-6 s per full-batch step, and vouches for that zero state with its K identities
as the round's members. Its daemon serves that zero state. With FILE (a leaked key) its
records carry valid proofs and its streams pass AUTH; without, neither.

It then asks the node at ADDR for its state, a group (JOIN) and a part (PART), prints one JSON
line (its identities and what each request got) and stores its records again every
``LOOP_SECONDS`` until killed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import time
from typing import Any

import torch
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time
from hostile_claims import zero_hash

from diloco.node.model.fragments import last_sent_round, model_fragments
from diloco.node.model.transformer import Transformer
from diloco.node.swarm.pinned_run import discover_run
from diloco.protocol.records.nodes import (
    FragmentVersion,
    NodeRecord,
    Vouch,
    nodes_key,
    vouch_key,
    vouch_payload,
)
from diloco.protocol.records.run_info import peer_id_in
from diloco.protocol.runtime import streams
from diloco.protocol.runtime.network import NetworkOptions
from diloco.protocol.state.fragment import FragmentState, OuterState
from diloco.protocol.state.transfer import fetch_state
from diloco.protocol.swarm import Swarm
from diloco.protocol.trust.envelopes import pack_payload, seal, signer
from diloco.protocol.trust.identity import Identity
from diloco.protocol.trust.swarm_key import ClosedSwarm, load_swarm_key
from diloco.protocol.wire.frames import GROUP_ID_BYTES, Join, Kind, Reject, RoundTag
from diloco.protocol.wire.part import PartHead
from diloco.protocol.wire.run_id import make_run_id, run_digest

CLAIM = 99_999
STEP_SECONDS = 1e-6
LOOP_SECONDS = 2.0
TTL = 30.0


async def _ask(
    transport: streams.StreamTransport, peer: PeerID, handler: str, kind: Kind, body: bytes
) -> str:
    reader, writer = await streams.open_stream(transport, peer, handler, 10.0)
    try:
        await streams.write_frame(writer, kind, body)
        answer, reply = await streams.read_frame(reader, (Kind.GROUP, Kind.AVERAGED), 1 << 20)
        if answer == Kind.REJECT:
            reject = Reject.parse(reply)
            return f"REJECT {reject.code.name} {reject.reason}"
        return f"GOT {answer.name}"
    finally:
        writer.close()


async def _attempt(request: Any) -> str:
    try:
        return str(await asyncio.wait_for(request, 20.0))
    except Exception as exc:  # what the outsider got is the result, whatever it is
        return repr(exc)


def store_all(
    swarm: Swarm,
    closed: ClosedSwarm | None,
    identities: list[Identity],
    records: dict[str, bytes],
    vouches: dict[int, dict[str, bytes]],
    run_id: str,
) -> None:
    """Store every identity's record and vouches, with proofs when holding the key."""
    expiration = get_dht_time() + TTL
    items = [(nodes_key(run_id), records)]
    items += [(vouch_key(run_id, p), by_author) for p, by_author in vouches.items()]
    for key, by_author in items:
        for identity in identities:
            payload = by_author[identity.peer_id]
            proof = None if closed is None else closed.record_proof(key, identity.peer_id, payload)
            envelope = seal(identity, key, payload, expiration, proof)
            swarm.dht.store(key, envelope, expiration, subkey=identity.peer_id)


async def requests(swarm: Swarm, honest: PeerID, run_id: str) -> dict[str, str]:
    """What the honest node answers this peer's STATE, JOIN and PART requests."""
    digest, tag = run_digest(run_id), RoundTag(run_digest(run_id), 0, 1)

    async def state() -> str:
        got = await fetch_state(swarm.streams, honest, run_id, digest)
        return f"GOT STATE at step {got.global_step}"

    join = Join(tag, 1000, 0, 0, 1.0).serialize()
    head = PartHead(tag, secrets.token_bytes(GROUP_ID_BYTES), 0).serialize()
    return {
        "state": await _attempt(state()),
        "join": await _attempt(
            _ask(swarm.streams, honest, f"/diloco/{run_id}/join/1", Kind.JOIN, join)
        ),
        "part": await _attempt(
            _ask(swarm.streams, honest, f"/diloco/{run_id}/part/2", Kind.PART, head)
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--initial-peers", required=True)
    parser.add_argument("--listen", default="/ip4/127.0.0.1/tcp/0")
    parser.add_argument("--keys", type=int, default=1)
    parser.add_argument("--swarm-key", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    net = NetworkOptions(initial_peers=(args.initial_peers,), host_maddrs=(args.listen,))
    run, _, dht = discover_run(net)
    run_id = make_run_id(run.name, run.to_dict())
    key = load_swarm_key(args.swarm_key) if args.swarm_key else None
    closed = None if key is None else ClosedSwarm(key, run_digest(run_id))
    swarm = Swarm(run_id, net, dht=dht, closed=closed)
    model = Transformer(run.model_config())
    fragments = model_fragments(
        model, model.blocks, run.fragment_size, run.pattern, run.embedding_fragment
    )
    numel = [sum(p.numel() for _, p in params) for params in fragments]
    H, count = run.outer.sync_every, len(numel)
    versions = [last_sent_round(CLAIM, p, H, count) for p in range(count)]
    zeros = {
        p: FragmentState(torch.zeros(n), torch.zeros(n), versions[p]) for p, n in enumerate(numel)
    }
    swarm.serve_state(lambda: OuterState(CLAIM, zeros))

    identities = [signer(dht), *(Identity.generate() for _ in range(args.keys - 1))]
    ids = [i.peer_id for i in identities]
    members = tuple(sorted(ids))
    frags = tuple(FragmentVersion(p, versions[p], zero_hash(n)) for p, n in enumerate(numel))
    records = {
        i: pack_payload(
            NodeRecord(i, (), CLAIM, frags, 1e9, "0.0.0-hostile", STEP_SECONDS).to_wire()
        )
        for i in ids
    }
    vouches = {
        p: {i: vouch_payload([Vouch(i, p, versions[p], zero_hash(n), members)]) for i in ids}
        for p, n in enumerate(numel)
    }
    store_all(swarm, closed, identities, records, vouches, run_id)
    honest = PeerID.from_base58(peer_id_in(args.initial_peers))
    report = swarm.call(requests(swarm, honest, run_id), 120.0)
    print(json.dumps({"peer_id": ids[0], "ids": ids, **report}), flush=True)
    while True:
        time.sleep(LOOP_SECONDS)
        store_all(swarm, closed, identities, records, vouches, run_id)


if __name__ == "__main__":
    main()
