"""A hostile peer for the trust tests of ``test_pinned_run``, built from the project's classes.

``python hostile_peer.py hijack ADDRESS LISTEN PATH`` joins the DHT of the node at ADDRESS
with its own identity and (1) publishes, signed by itself, a second run with the honest
run's name whose configuration names PATH as ``data``, (2) stores a copy of the honest
configuration that names PATH under the honest creator's subkey with a far expiration,
(3) stores the honest configuration rewritten to name PATH, signed by itself, under its own
subkey, and (4) answers RUN_INFO with its own run. It prints its addresses, then one JSON
line (the report: a reader that sees it has the addresses too), and stays until killed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from typing import Any

from hivemind.utils import get_dht_time

from diloco.protocol.records.run_configs import (
    RUN_CONFIGS_KEY,
    SignedRunConfig,
    encode_config,
    find_run_configs,
    publish_run_config,
)
from diloco.protocol.records.run_info import serve_run_info
from diloco.protocol.runtime.network import NetworkOptions
from diloco.protocol.swarm import make_dht
from diloco.protocol.trust.envelopes import pack_payload, seal, signer, store_signed
from diloco.protocol.trust.identity import signing_input
from diloco.protocol.wire.run_id import make_run_id


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
    for addr in dht.get_visible_maddrs():  # before the report: a test reads both once
        print(addr, flush=True)  # the report is there
    print(json.dumps(report), flush=True)
    await asyncio.sleep(3600)


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    command, args = sys.argv[1], sys.argv[2:]
    assert command == "hijack", command
    asyncio.run(hijack(*args))
