"""A pool of four real peer processes shared by the swarm tests of this package, and the
rule for in-process tests on the wall clock.

Starting a peer (spawned interpreter, DHT process, p2pd) costs seconds on two busy cores,
so the swarm tests share one pool and give every test its own fragment indices; tests that
kill a peer start an extra victim that joins the pool's DHT.

The clock rule: an in-process test that runs nodes on the in-memory network or DHT runs
the protocol on the wall clock (join timeouts, windows, part deadlines), so a process
starved of CPU fails it. It must be marked ``clocked``: the whole-suite run
(``scripts/test.sh``) keeps those at normal priority and runs the other in-process tests
at idle priority. The guard below fails an unmarked test that builds either.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from typing import Any

import pytest
from memory_dht import MemoryDHT
from memory_p2p import MemoryNetwork
from swarm_peers import TIMEOUTS, Fault, PeerProcess, command, run_rounds, start_swarm, stop_peers

_fragments = itertools.count(100)


@pytest.fixture(autouse=True)
def _clock_guard(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    if request.node.get_closest_marker("clocked") is not None:
        yield
        return
    built: list[str] = []
    for cls in (MemoryNetwork, MemoryDHT):
        init = cls.__init__

        def record(self: object, *args: object, _init: Any = init, **kwargs: object) -> None:
            built.append(type(self).__name__)
            _init(self, *args, **kwargs)

        monkeypatch.setattr(cls, "__init__", record)
    yield
    if built:
        rule = "clock rule: tests/protocol/conftest.py"
        pytest.fail(f"not marked clocked but builds a {built[0]} ({rule})")


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
