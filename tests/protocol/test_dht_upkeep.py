"""Two DHT nodes that dropped each other from their routing tables and banned each other
(what both sides do when one's machine stalls past hivemind's request timeout) find each
other's records again through the upkeep; without it they stay apart for good, though p2p
still connects them."""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator
from typing import Any

import pytest
from hivemind import DHT
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time

from diloco.protocol.runtime.dht_upkeep import start_upkeep
from diloco.protocol.runtime.processes import TiedDHT

pytestmark = pytest.mark.swarm


def dht(host: int, initial_peers: list[str]) -> DHT:
    return TiedDHT(
        start=True,
        initial_peers=initial_peers,
        host_maddrs=[f"/ip4/127.0.0.{host}/tcp/0"],
        nat_port_map=False,
        auto_nat=False,
    )


@pytest.fixture
def pair() -> Iterator[tuple[DHT, DHT, list[str]]]:
    a = dht(2, [])
    try:
        address = [str(m) for m in a.get_visible_maddrs()]
        b = dht(3, address)
        try:
            yield a, b, address
        finally:
            b.shutdown()
    finally:
        a.shutdown()


async def _forget(_: DHT, node: Any, *, peer: str) -> bool:
    """Drop ``peer`` from the routing table and ban it for 10 minutes; was it there?"""
    peer_id = PeerID.from_base58(peer)
    node_id = node.protocol.routing_table.get(peer_id=peer_id)
    if node_id is not None:
        del node.protocol.routing_table[node_id]
    node.blacklist.banned_peers.store(peer_id, 0, expiration_time=get_dht_time() + 600)
    return node_id is not None


def forget(node: DHT, peer: DHT) -> bool:
    return bool(node.run_coroutine(functools.partial(_forget, peer=peer.peer_id.to_base58())))


def sees(reader: DHT, key: str, value: int, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        found = reader.get(key, latest=True)
        if found is not None and found.value == value:
            return True
        time.sleep(0.2)
    return False


def test_nodes_that_dropped_each_other_read_each_others_records_again(
    pair: tuple[DHT, DHT, list[str]],
) -> None:
    a, b, address = pair
    assert b.store("before", 1, get_dht_time() + 60)
    assert sees(a, "before", 1, within=5.0)
    assert forget(a, b) and forget(b, a)
    start_upkeep(a, [], period=0.5)  # the first node knows the other from p2pd alone
    start_upkeep(b, address, period=0.5)
    b.store("after-b", 2, get_dht_time() + 60)
    a.store("after-a", 3, get_dht_time() + 60)
    # within the upkeep's period and a ping (without it, never: both fail)
    assert sees(a, "after-b", 2, within=10.0)
    assert sees(b, "after-a", 3, within=2.0)
