"""The staged all-reduce on the wire: 12 real peer processes, groups of at most 4
(a 3x4 grid), against the in-process staged reducer and the flat weighted mean."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from staged_swarm import (
    MAX_GROUP,
    NUM_PEERS,
    TIMEOUT,
    WEIGHTS,
    check_killed_mid_stage,
    expected,
    reduce,
    sha,
    warm_swarm,
)
from swarm_peers import PeerProcess, command

from diloco.codecs import get_codec
from diloco.protocol.staged.reference import staged_mean

pytestmark = pytest.mark.swarm


@pytest.fixture(scope="module")
def peers() -> Iterator[list[PeerProcess]]:
    yield from warm_swarm(599)


@pytest.mark.parametrize(("codec", "fragment"), [("none", 601), ("e3m0", 602)])
def test_twelve_peers_in_groups_of_four_equal_the_staged_reference(
    peers: list[PeerProcess], codec: str, fragment: int
) -> None:
    command(peers, "codec", codec)
    command(peers, "staged", (MAX_GROUP, NUM_PEERS, True, None))
    seeds = [fragment * 100 + i for i in range(NUM_PEERS)]
    reduce(peers, fragment, seeds)
    results = [peer.recv(TIMEOUT)[1][0] for peer in peers]
    ids = [peer.peer_id for peer in peers]
    plan, order, deltas, values = expected(ids, fragment, seeds, codec)
    assert plan.shape == (4, 3)
    assert len({sha(v) for v in values}) == 1  # the reference itself: one value for all
    assert all(r["ok"] for r in results), results
    assert {r["sha256"] for r in results} == {sha(values[0])}
    assert all(sorted(r["members"]) == sorted(ids) for r in results)
    for r in results:
        (s0, m0, sent0, got0), (s1, m1, sent1, got1) = r["stages"]
        assert (s0, m0, s1, m1) == (0, 4, 1, 3)
        assert min(sent0, got0, sent1, got1) > 0
        assert r["bytes_sent"] == sent0 + sent1
    # the flat weighted mean of all 12, computed here directly: the staged mean without
    # clipping (which compares norms within each stage group) is it
    unclipped = staged_mean(plan, deltas, get_codec(codec), clip_factor=0).values[0]
    w = torch.tensor([WEIGHTS[i] for i in order], dtype=torch.float64)
    flat = (torch.stack(deltas).double() * (w / w.sum())[:, None]).sum(0)
    error = float((unclipped.double() - flat).norm() / flat.norm())
    assert error < (1e-6 if codec == "none" else 0.4)


def test_peer_killed_mid_cross_cell_stage_the_eleven_survivors_hold_the_staged_mean(
    peers: list[PeerProcess],
) -> None:
    """Killed mid-stage 1 (the module's last test: it leaves 11 peers)."""
    check_killed_mid_stage(peers, 1, 701)
