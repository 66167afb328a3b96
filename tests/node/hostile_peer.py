"""A hostile peer for the trust tests of ``test_pinned_run``, built from the project's classes.

``python hostile_peer.py hijack ADDRESS LISTEN PATH`` joins the DHT of the node at ADDRESS
with its own identity and (1) publishes, signed by itself, a second run with the honest
run's name whose configuration names PATH as ``data``, (2) stores a copy of the honest
configuration that names PATH under the honest creator's subkey with a far expiration,
(3) stores the honest configuration rewritten to name PATH, signed by itself, under its own
subkey, and (4) answers RUN_INFO with its own run. It prints one JSON line, then its
address, and stays until killed.

``python hostile_peer.py outsider ADDRESS LISTEN [KEY_FILE]`` learns the closed run of the
node at ADDRESS (RUN_INFO is open to all), then, without the key or with KEY_FILE's (another
key), declares itself for the run's rounds and asks that node for its state, a group
(JOIN) and a part (PART). It prints one JSON line saying what each request got, and exits.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import sys
from typing import Any

from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time

from diloco.protocol.core.reducer import RoundKey
from diloco.protocol.matchmaking.lobby import round_key
from diloco.protocol.records.declarations import declare_round
from diloco.protocol.records.run_configs import (
    RUN_CONFIGS_KEY,
    SignedRunConfig,
    encode_config,
    find_run_configs,
    publish_run_config,
)
from diloco.protocol.records.run_id import make_run_id, run_digest
from diloco.protocol.records.run_info import fetch_run_info, peer_id_in, serve_run_info
from diloco.protocol.runtime import streams
from diloco.protocol.runtime.network import NetworkOptions
from diloco.protocol.runtime.swarm import make_dht
from diloco.protocol.state.transfer import fetch_state
from diloco.protocol.trust.envelopes import pack_payload, seal, signer, store_signed
from diloco.protocol.trust.identity import signing_input
from diloco.protocol.trust.swarm_key import ClosedSwarm, ClosedTransport, load_swarm_key
from diloco.protocol.wire.frames import GROUP_ID_BYTES, Join, Kind, Reject, RoundTag
from diloco.protocol.wire.part import PartHead


def _forged_payload(identity: Any, config: dict[str, Any]) -> bytes:
    run_id, text = make_run_id(config["name"], config), encode_config(config)
    signature = identity.sign(signing_input("diloco-run-config/1", run_id, text))
    return pack_payload([run_id, text, signature])


async def hijack(address: str, listen: str, path: str) -> None:
    dht = make_dht(NetworkOptions(initial_peers=(address,), host_maddrs=(listen,)))
    me = signer(dht)
    honest: SignedRunConfig | None = None
    while honest is None:  # the honest node publishes its configuration a moment after start
        honest = next(iter((await find_run_configs(dht)).values()), None)
        await asyncio.sleep(0.5)
    name = honest.config["name"]
    own_config = {**honest.config, "creator": me.peer_id, "data": path}
    own = SignedRunConfig.sign(me, make_run_id(name, own_config), own_config)
    published = await publish_run_config(dht, own, 250.0)
    honest_with_path = {**honest.config, "data": path}
    forged = _forged_payload(me, honest_with_path)
    far = get_dht_time() + 10**6
    # hivemind's own store: sent to the honest node whatever our validator thinks of it
    await dht.store(
        RUN_CONFIGS_KEY,
        seal(me, RUN_CONFIGS_KEY, forged, far),
        far,
        subkey=honest.creator,
        return_future=True,
    )
    await store_signed(dht, RUN_CONFIGS_KEY, forged, get_dht_time() + 250.0)
    p2p = await dht.replicate_p2p()
    await serve_run_info(p2p, own)
    report = {
        "own_run": own.run_id,
        "own_published": published,
        "honest_run": honest.run_id,
        "forged_run": make_run_id(name, honest_with_path),
        "peer_id": me.peer_id,
    }
    print(json.dumps(report), flush=True)
    for addr in dht.get_visible_maddrs():
        print(addr, flush=True)
    await asyncio.sleep(3600)


async def outsider(address: str, listen: str, key_file: str | None) -> None:
    dht = make_dht(NetworkOptions(initial_peers=(address,), host_maddrs=(listen,)))
    p2p = await dht.replicate_p2p()
    honest = PeerID.from_base58(peer_id_in(address))
    signed = await fetch_run_info(p2p, honest)
    run_id, digest = signed.run_id, run_digest(signed.run_id)
    closed = ClosedSwarm(load_swarm_key(key_file), digest) if key_file else None
    transport: streams.StreamTransport = p2p if closed is None else ClosedTransport(p2p, closed, 10)
    expiration = get_dht_time() + 250.0
    rounds = signed.config["steps"] // signed.config["outer"]["sync_every"] + 2
    declared = await asyncio.gather(
        *(
            declare_round(dht, round_key(run_id, RoundKey(p, k)), 1.0, expiration, closed)
            for p in range(8)
            for k in range(1, rounds)
        )
    )
    tag = RoundTag(digest, 0, 1)
    report: dict[str, Any] = {"peer_id": p2p.peer_id.to_base58(), "declared": sum(declared)}
    report["state"] = await _attempt(_state(transport, honest, run_id, digest))
    join = Join(tag, 1000, 0, 0, 1.0).serialize()
    report["join"] = await _attempt(
        _ask(transport, honest, f"/diloco/{run_id}/join/1", Kind.JOIN, join)
    )
    head = PartHead(tag, secrets.token_bytes(GROUP_ID_BYTES), 0).serialize()
    report["part"] = await _attempt(
        _ask(transport, honest, f"/diloco/{run_id}/part/1", Kind.PART, head)
    )
    print(json.dumps(report), flush=True)
    await p2p.shutdown()
    dht.shutdown()


async def _state(
    transport: streams.StreamTransport, peer: PeerID, run_id: str, digest: bytes
) -> str:
    state = await fetch_state(transport, peer, run_id, digest)
    return f"GOT STATE at step {state.global_step}"


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


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    command, args = sys.argv[1], sys.argv[2:]
    if command == "hijack":
        asyncio.run(hijack(*args))
    else:
        asyncio.run(outsider(args[0], args[1], args[2] if len(args) > 2 else None))
