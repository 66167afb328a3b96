"""What one publish stores: the node's record each time (it changes with every round), the
run configuration and the metrics, which decide no round, only when due (the
configuration never changes; it was a fifth of a three-node swarm's DHT stores)."""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any

from diloco import __version__
from diloco.node.observe.recent_metrics import RecentMetrics
from diloco.node.swarm.publisher import PUBLISH_EVERY, RECORD_TTL, Publisher
from diloco.protocol.records.nodes import NodeRecord
from diloco.protocol.records.run_configs import SignedRunConfig


class StoringSwarm:
    """Takes the publisher's stores and reads: what it stored, by kind, in order."""

    dht = None
    run_id = "run"

    def __init__(self) -> None:
        self.stored: list[str] = []

    def call(self, coroutine: Coroutine[Any, Any, Any]) -> bool:
        self.stored.append(coroutine.__name__)
        coroutine.close()  # never run: no DHT here
        return True

    def publish_record(self, record: NodeRecord, ttl: float) -> bool:
        self.stored.append("publish_record")
        return True

    def read_records(self) -> list[NodeRecord]:
        return []


def test_the_record_each_time_the_run_configuration_and_metrics_when_due() -> None:
    swarm = StoringSwarm()
    signed = SignedRunConfig("run", "{}", b"", {})
    publisher = Publisher(swarm, signed, RecentMetrics(), lambda records: None)  # type: ignore[arg-type]
    publisher.offer(NodeRecord("me", (), 0, (), 0.0, __version__), {})
    for _ in range(3):  # three rounds applied in a row
        publisher.publish()
    assert swarm.stored == [
        "publish_record", "publish_run_config", "publish_metrics",
        "publish_record",
        "publish_record",
    ]  # fmt: skip
    swarm.stored.clear()
    publisher.metrics_stored_at -= PUBLISH_EVERY  # a regular interval later
    publisher.publish()
    assert swarm.stored == ["publish_record", "publish_metrics"]
    swarm.stored.clear()
    publisher.config_stored_at -= RECORD_TTL / 3  # a third of its lifetime later
    publisher.publish()
    assert swarm.stored == ["publish_record", "publish_run_config"]
