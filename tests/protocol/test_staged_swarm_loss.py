"""A peer SIGKILLed mid-stage 0 of a staged round (issue 16): 12 real peer processes in
groups of at most 4, a swarm of its own (the other module's last test kills one of its)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from staged_swarm import check_killed_mid_stage, warm_swarm
from swarm_peers import PeerProcess

pytestmark = pytest.mark.swarm


@pytest.fixture(scope="module")
def peers() -> Iterator[list[PeerProcess]]:
    yield from warm_swarm(699)


def test_peer_killed_mid_cell_stage_the_eleven_survivors_hold_the_staged_mean(
    peers: list[PeerProcess],
) -> None:
    check_killed_mid_stage(peers, 0, 700)
