"""The node's background work on the swarm: the swarm as healing's source of records,
vouches and states (``healing.StateSource``: the node's ``Swarm`` with peer ids as strings,
so healing stays free of hivemind types), and the log of a background task that failed."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from hivemind.p2p import PeerID

from diloco.protocol.records.nodes import NodeRecord, Vouch, read_vouches
from diloco.protocol.runtime.swarm import Swarm
from diloco.protocol.state.fragment import OuterState

logger = logging.getLogger(__name__)


class SwarmStateSource:
    """``Swarm`` as healing's ``StateSource`` (peer ids as strings)."""

    def __init__(self, swarm: Swarm) -> None:
        self.swarm = swarm

    def read_records(self) -> list[NodeRecord]:
        return self.swarm.read_records()

    def read_vouches(self, fragments: Sequence[int]) -> list[Vouch]:
        return self.swarm.call(self._read_vouches(fragments))

    async def _read_vouches(self, fragments: Sequence[int]) -> list[Vouch]:
        dht, run_id = self.swarm.dht, self.swarm.run_id
        found = await asyncio.gather(*(read_vouches(dht, run_id, p) for p in fragments))
        return [v for vouches in found for v in vouches]

    def fetch_state(
        self, fragments: Sequence[int], expected_numel: Mapping[int, int], donors: Sequence[str]
    ) -> OuterState:
        peers = [PeerID.from_base58(d) for d in donors]
        return self.swarm.fetch_state(fragments, expected_numel, peers)


def log_failure(future: concurrent.futures.Future[Any]) -> None:
    """Log a background swarm task that failed (its future's done callback)."""
    if future.cancelled():
        return
    error = future.exception()
    # A call cancelled by Swarm.shutdown is the node leaving, not a failure.
    if error is not None and not isinstance(error, concurrent.futures.CancelledError):
        logger.warning("background swarm task failed: %r", error)
