"""A peer SIGKILLed mid-stage 0 of a staged round (issue 16): 12 real peer processes in
groups of at most 4, a swarm of its own (the other module's last test kills one of its)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from staged_swarm import NUM_PEERS, check_killed_mid_stage, warm_up
from swarm_peers import PeerProcess, start_swarm, stop_peers

pytestmark = pytest.mark.swarm


@pytest.fixture(scope="module")
def peers() -> Iterator[list[PeerProcess]]:
    swarm = start_swarm(NUM_PEERS)
    try:
        warm_up(swarm, 699)
        yield swarm
    finally:
        stop_peers(swarm)


def test_peer_killed_mid_cell_stage_the_eleven_survivors_hold_the_staged_mean(
    peers: list[PeerProcess],
) -> None:
    check_killed_mid_stage(peers, 0, 700)
