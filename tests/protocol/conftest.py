"""A pool of four real peer processes shared by the swarm tests of this package.

Starting a peer (spawned interpreter, DHT process, p2pd) costs seconds on two busy cores,
so the swarm tests share one pool and give every test its own fragment indices; tests that
kill a peer start an extra victim that joins the pool's DHT.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator

import pytest
from swarm_peers import TIMEOUTS, Fault, PeerProcess, command, run_rounds, start_swarm, stop_peers

_fragments = itertools.count(100)


@pytest.fixture(scope="session")
def pool() -> Iterator[list[PeerProcess]]:
    peers = start_swarm(4)
    try:
        # Connect every pair once before the tests. Fresh peers that dial each other at the
        # same moment may get two connections, and libp2p closes one of them under the
        # first round's streams: that round fails for everyone (a node tolerates it as a
        # failed round); the tests are about rounds between connected peers.
        run_rounds(peers, [[(99, 1, 1000, i, 1.0)] for i in range(4)], TIMEOUTS.total + 60)
        yield peers
    finally:
        stop_peers(peers)


@pytest.fixture
def fragment() -> int:
    """A fragment index no other test uses, so rounds of different tests never meet."""
    return next(_fragments)


@pytest.fixture
def honest(pool: list[PeerProcess]) -> Iterator[list[PeerProcess]]:
    """The pool with codec ``none``, no fault, no weight cap and the usual timeouts,
    restored after the test, when every peer also forgets the offences it saw."""
    command(pool, "codec", "none")
    command(pool, "fault", Fault.NONE.value)
    command(pool, "forgive", None)  # the pool's first round may have failed a part
    yield pool
    command(pool, "codec", "none")
    command(pool, "fault", Fault.NONE.value)
    command(pool, "cap", math.inf)
    command(pool, "role", "reducer")
    command(pool, "timeouts", TIMEOUTS)
    command(pool, "forgive", None)
