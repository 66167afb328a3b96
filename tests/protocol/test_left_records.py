"""A leaving node's record says it left, and its peers stop counting it at once
(docs/design.md "Wire formats", "The node and its CLI").

In process, on ``memory_dht`` (which keeps, per subkey, the value that expires last, as
hivemind does): ``read_records`` drops a node whose record says it left; ``Publisher.leave``
stores that record last, even against a regular store in flight on the publisher's thread.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any

import pytest
from memory_dht import MemoryDHT, Table
from memory_p2p import make_identity

from diloco.node.observe.recent_metrics import RecentMetrics
from diloco.node.swarm.publisher import LEAVE_TIMEOUT, Publisher
from diloco.protocol.records.nodes import (
    NodeRecord,
    nodes_key,
    publish_record,
    read_records,
)
from diloco.protocol.records.run_configs import SignedRunConfig
from diloco.protocol.trust.envelopes import open_envelope
from diloco.protocol.wire.run_id import make_run_id

pytestmark = pytest.mark.clocked

CREATOR = make_identity(0)
CONFIG = {"name": "leave", "steps": 10, "creator": CREATOR.peer_id}
RUN_ID = make_run_id("leave", CONFIG)


def _record(dht: MemoryDHT, step: int = 3) -> NodeRecord:
    return NodeRecord(dht.identity.peer_id, ("/ip4/127.0.0.1/tcp/1",), step, (), 1.0, "0.1.0")


def _peers(records: list[NodeRecord]) -> set[str]:
    return {r.peer_id for r in records}


def test_a_left_record_hides_its_node_from_every_reader() -> None:
    table = Table()
    alice, bob = (MemoryDHT(make_identity(i), table) for i in (1, 2))

    async def main() -> tuple[list[NodeRecord], list[NodeRecord]]:
        await publish_record(alice, RUN_ID, _record(alice), ttl=30)
        await publish_record(bob, RUN_ID, _record(bob), ttl=30)
        both = await read_records(alice, RUN_ID)
        assert await publish_record(bob, RUN_ID, _record(bob).as_left(), ttl=60)
        return both, await read_records(alice, RUN_ID)

    both, after = asyncio.run(main())
    assert _peers(both) == {alice.identity.peer_id, bob.identity.peer_id}
    assert _peers(after) == {alice.identity.peer_id}


class MemorySwarm:
    """The calls ``Publisher`` makes of a ``Swarm``, on a ``MemoryDHT``; each call runs on an
    event loop of the calling thread. ``gate``, when set up, holds every regular store of
    the node record until it is opened; ``stored`` lists the node records stored, in
    order, as ``left`` flags."""

    def __init__(self, dht: MemoryDHT) -> None:
        self.dht, self.run_id = dht, RUN_ID
        self.stored: list[bool] = []
        self.gate: threading.Event | None = None
        self.held = threading.Event()
        original = dht.store

        async def store(key: str, value: Any, expiration: float, **kwargs: Any) -> bool:
            if key == nodes_key(RUN_ID):
                author = self.dht.identity.peer_id
                payload = open_envelope(key, author, value, expiration).payload
                left = NodeRecord.from_payload(author, payload).left
                if not left and self.gate is not None:
                    self.held.set()
                    assert self.gate.wait(30), "the gate was never opened"
                self.stored.append(left)
            return await original(key, value, expiration, **kwargs)

        dht.store = store  # type: ignore[method-assign]

    def call(self, coro: Coroutine[Any, Any, Any], timeout: float | None = None) -> Any:
        return asyncio.run(coro)

    def publish_record(self, record: NodeRecord, ttl: float) -> bool:
        return bool(self.call(publish_record(self.dht, self.run_id, record, ttl)))

    def read_records(self) -> list[NodeRecord]:
        return list(self.call(read_records(self.dht, self.run_id)))


def _publisher(table: Table) -> tuple[Publisher, MemorySwarm, MemoryDHT]:
    swarm = MemorySwarm(MemoryDHT(make_identity(1), table))
    signed = SignedRunConfig.sign(CREATOR, RUN_ID, CONFIG)
    publisher = Publisher(swarm, signed, RecentMetrics(), lambda records: None)  # type: ignore[arg-type]
    return publisher, swarm, MemoryDHT(make_identity(2), table)


def test_no_regular_store_follows_leave() -> None:
    table = Table()
    publisher, swarm, reader = _publisher(table)
    publisher.offer(_record(swarm.dht), {})
    publisher.publish()
    assert [r.peer_id for r in asyncio.run(read_records(reader, RUN_ID))] == [
        swarm.dht.identity.peer_id
    ]
    publisher.leave()
    publisher.offer(_record(swarm.dht, step=4), {}, now=True)
    publisher.publish()  # as the publisher's thread may, after the node left
    assert swarm.stored == [False, True]
    assert asyncio.run(read_records(reader, RUN_ID)) == []


def test_leave_waits_for_a_regular_store_in_flight() -> None:
    table = Table()
    publisher, swarm, reader = _publisher(table)
    publisher.offer(_record(swarm.dht), {})
    swarm.gate = threading.Event()
    in_flight = threading.Thread(target=publisher.publish)
    in_flight.start()
    assert swarm.held.wait(30), "the regular store never started"
    leaving = threading.Thread(target=publisher.leave)
    leaving.start()
    leaving.join(LEAVE_TIMEOUT / 6)  # leave would have stored its record by now
    swarm.gate.set()
    in_flight.join(30)
    leaving.join(30)
    assert swarm.stored == [False, True]
    assert asyncio.run(read_records(reader, RUN_ID)) == []
