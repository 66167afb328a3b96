"""State transfer: a late peer downloads byte-identical outer state; bad donors are skipped."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from swarm_peers import PeerProcess, make_state, start_peer, stop_peers

NUM_FRAGMENTS, NUMEL, SEED = 3, 70_001, 42


@pytest.fixture(scope="module")
def donors(pool: list[PeerProcess]) -> list[PeerProcess]:
    """Pool peer 0 serves a poisoned state (NaN momentum), peers 1 and 2 the good one."""
    for i, peer in enumerate(pool[:3]):
        peer.send("serve_state", (NUM_FRAGMENTS, NUMEL, SEED, i == 0))
    for peer in pool[:3]:
        assert peer.recv(30) == ("ok", True)
    return pool[:3]


@pytest.fixture(scope="module")
def late(pool: list[PeerProcess]) -> Iterator[PeerProcess]:
    """One fresh peer for the module's tests: a fetch changes nothing that the next one
    reads (it asks its own donors), and a peer costs seconds to start."""
    peer = start_peer(pool[1].maddrs[:1])
    try:
        yield peer
    finally:
        stop_peers([peer])


def _expected() -> dict[int, tuple[int, str]]:
    state = make_state(NUM_FRAGMENTS, NUMEL, SEED)
    return {p: (s.version, s.sha256()) for p, s in state.fragments.items()}


@pytest.mark.swarm
def test_late_peer_fetches_identical_state(donors: list[PeerProcess], late: PeerProcess) -> None:
    late.send("fetch_state", (None, {p: NUMEL for p in range(NUM_FRAGMENTS)}, None))
    kind, step, hashes = late.recv(60)
    assert kind == "state" and step == 1234
    assert hashes == _expected()


@pytest.mark.swarm
def test_fetch_one_fragment_skips_poisoned_donor(
    donors: list[PeerProcess], late: PeerProcess
) -> None:
    order = [donors[0].peer_id, donors[2].peer_id]  # poisoned first, then a good one
    late.send("fetch_state", ([0], {0: NUMEL}, order))
    kind, _, hashes = late.recv(60)
    assert kind == "state"
    assert hashes == {0: _expected()[0]}


@pytest.mark.swarm
def test_fetch_with_wrong_expected_size_refuses_every_donor(
    donors: list[PeerProcess], late: PeerProcess
) -> None:
    late.send("fetch_state", ([1], {1: NUMEL + 1}, [d.peer_id for d in donors[1:]]))
    kind, reason = late.recv(60)
    assert kind == "error" and "2 tried" in reason
