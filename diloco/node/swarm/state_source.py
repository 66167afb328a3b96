"""The node's background work on the swarm: the swarm as healing's source of records,
vouches and states (``healing.StateSource``: the node's ``Swarm`` with peer ids as strings,
so healing stays free of hivemind types), and the last metrics record a leaving node
publishes."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from hivemind.p2p import PeerID

from diloco.protocol.records.metrics import MetricsRecord, publish_metrics
from diloco.protocol.records.nodes import NodeRecord, Vouch, read_vouches
from diloco.protocol.state.fragment import OuterState
from diloco.protocol.swarm import Swarm
from diloco.protocol.trust.envelopes import MAX_RECORD_TTL

logger = logging.getLogger(__name__)

LAST_RECORD_TTL = MAX_RECORD_TTL
"""Seconds a leaving node's last metrics record (how it ended, its final eval) lives."""
LAST_PUBLISH_TIMEOUT = 5.0
"""Seconds a leaving node waits for its last metrics record to be stored."""


def publish_last(swarm: Swarm, run_id: str, record: MetricsRecord) -> None:
    """A leaving node's last metrics record: how it ended, with its final evaluation, for
    dashboards (docs/design.md "Watching a run"). It outlives the node's other records (a
    dashboard that polls later still finds it) and, expiring later, replaces any regular
    refresh still in flight. Bounded: leaving is never held up for long."""
    try:
        swarm.call(
            publish_metrics(swarm.dht, run_id, record, LAST_RECORD_TTL),
            timeout=LAST_PUBLISH_TIMEOUT,
        )
    except Exception as error:  # the node leaves all the same; say why the page lags
        logger.warning("could not publish the last metrics record: %r", error)


class SwarmStateSource:
    """``Swarm`` as healing's ``StateSource`` (peer ids as strings)."""

    def __init__(self, swarm: Swarm) -> None:
        self.swarm = swarm

    def read_swarm(self, fragments: Sequence[int]) -> tuple[list[NodeRecord], list[Vouch]]:
        return self.swarm.read_records_and_vouches(fragments)

    def read_vouches(self, fragments: Sequence[int]) -> list[Vouch]:
        return self.swarm.call(read_vouches(self.swarm.dht, self.swarm.run_id, fragments))

    def fetch_state(
        self, fragments: Sequence[int], expected_numel: Mapping[int, int], donors: Sequence[str]
    ) -> OuterState:
        peers = [PeerID.from_base58(d) for d in donors]
        return self.swarm.fetch_state(fragments, expected_numel, peers)
