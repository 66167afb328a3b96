"""A pool of four real peer processes shared by the swarm tests of this package.

Starting a peer (spawned interpreter, DHT process, p2pd) costs seconds on two busy cores,
so the swarm tests share one pool and give every test its own fragment indices; tests that
kill a peer start an extra victim that joins the pool's DHT.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
from swarm_peers import Fault, PeerProcess, command, start_swarm, stop_peers

_fragments = itertools.count(100)


@pytest.fixture(scope="session")
def pool() -> Iterator[list[PeerProcess]]:
    peers = start_swarm(4)
    try:
        yield peers
    finally:
        stop_peers(peers)


@pytest.fixture
def fragment() -> int:
    """A fragment index no other test uses, so rounds of different tests never meet."""
    return next(_fragments)


@pytest.fixture
def honest(pool: list[PeerProcess]) -> Iterator[list[PeerProcess]]:
    """The pool with codec ``none`` and no fault, restored after the test."""
    command(pool, "codec", "none")
    command(pool, "fault", Fault.NONE.value)
    yield pool
    command(pool, "codec", "none")
    command(pool, "fault", Fault.NONE.value)
