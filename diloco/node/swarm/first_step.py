"""Holding a node's first step until enough peers are in the run (``--wait-for-peers``;
docs/design.md "The node and its CLI").

A run's creator trains from the moment it starts, and a joiner starts at the step the others
have reached when its join completes. Nodes given the same number wait for each other and
start together, at step 0, within a read of the run's records of one another.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable

from diloco.protocol.records.nodes import NodeRecord
from diloco.protocol.swarm import Swarm

logger = logging.getLogger(__name__)

PEERS_POLL = 0.25
"""Seconds between two reads of the run's records while waiting."""
PEERS_TOLD_EVERY = 30.0
"""Seconds between two log lines while waiting."""


def wait_for_peers(
    swarm: Swarm,
    wanted: int,
    stop: threading.Event,
    heard: Callable[[list[NodeRecord]], None],
) -> float:
    """Block until ``wanted`` other nodes' records are live in the run, or ``stop``; returns
    the seconds waited. ``heard`` gets every read (the node's matchmaking target follows
    them). Records cost nothing to write, so keys that only write them can end the wait
    early: the node then trains as it would have without waiting, nothing worse. A failed
    read is a warning and a retry."""
    me = swarm.peer_id.to_base58()
    start, told = time.monotonic(), -math.inf
    while not stop.is_set():
        try:
            records = swarm.read_records()
        except Exception as error:  # the DHT may fail a read; the next one retries
            logger.warning("reading the run's records failed: %r", error)
            stop.wait(PEERS_POLL)
            continue
        heard(records)
        others = sum(r.peer_id != me for r in records)
        if others >= wanted:
            break
        if time.monotonic() - told >= PEERS_TOLD_EVERY:
            told = time.monotonic()
            logger.info(
                "waiting for %d more node(s) before the first step (--wait-for-peers %d)",
                wanted - others,
                wanted,
            )
        stop.wait(PEERS_POLL)
    return time.monotonic() - start
