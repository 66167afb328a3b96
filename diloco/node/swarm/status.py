"""``diloco-node status``: what the swarm's DHT says about its runs and nodes."""

from __future__ import annotations

import asyncio

from hivemind import DHT

from diloco.protocol.records.nodes import NodeRecord, read_records, record_validator
from diloco.protocol.records.run_configs import SignedRunConfig, find_run_configs

RunStatus = tuple[SignedRunConfig, list[NodeRecord]]


def read_status(initial_peers: list[str], timeout: float = 30.0) -> dict[str, RunStatus]:
    """Every run the swarm lists, by run id: its creator-signed configuration and its
    nodes' records (a client DHT, loopback only unless the addresses say otherwise)."""
    dht = DHT(
        initial_peers=initial_peers,
        start=True,
        client_mode=True,
        record_validators=[record_validator()],  # a peer's forged entries void its answer
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        nat_port_map=False,
        auto_nat=False,
    )
    try:

        async def gather() -> dict[str, RunStatus]:
            configs = await find_run_configs(dht)
            return {
                run_id: (configs[run_id], await read_records(dht, run_id))
                for run_id in sorted(configs)
            }

        return asyncio.run(asyncio.wait_for(gather(), timeout))
    finally:
        dht.shutdown()
