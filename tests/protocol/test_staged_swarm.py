"""The staged all-reduce on the wire (issue 16): 12 real peer processes, groups of at most 4
(a 3x4 grid), against the in-process staged reducer and the flat weighted mean."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import pytest
import torch
from hivemind.p2p import PeerID
from swarm_expected import group_order
from swarm_peers import (
    TIMEOUTS,
    PeerProcess,
    command,
    make_delta,
    start_peer,
    start_swarm,
    stop_peers,
)

from diloco.codecs import get_codec
from diloco.protocol.grid import GridPlan, plan_grid
from diloco.protocol.staged import staged_mean

pytestmark = pytest.mark.swarm

NUM_PEERS, MAX_GROUP = 12, 4
NUMEL = 300_001  # two chunks per part in stage 0
WEIGHTS = [1.0 + 0.5 * i for i in range(NUM_PEERS)]
TIMEOUT = 2 * TIMEOUTS.total + 90


@pytest.fixture(scope="module")
def peers() -> Iterator[list[PeerProcess]]:
    swarm = start_swarm(NUM_PEERS)
    try:
        yield swarm
    finally:
        stop_peers(swarm)


def _expected(
    ids: list[str], fragment: int, seeds: list[int], codec: str
) -> tuple[GridPlan, list[int], list[torch.Tensor], list[torch.Tensor]]:
    """The plan (indices in group order), group order, the deltas and the in-process staged
    reducer's values per member, all in group order."""
    order = group_order(ids)
    peers = [PeerID.from_base58(ids[i]).to_bytes() for i in order]
    plan = plan_grid(f"{fragment}/1", peers, [WEIGHTS[i] for i in order], MAX_GROUP)
    deltas = [make_delta(NUMEL, seeds[i]) for i in order]
    values = staged_mean(plan, deltas, get_codec(codec)).values
    return plan, order, deltas, list(values)


def _sha(x: torch.Tensor) -> str:
    return hashlib.sha256(x.numpy().tobytes()).hexdigest()


def _reduce(peers: list[PeerProcess], fragment: int, seeds: list[int]) -> None:
    for i, peer in enumerate(peers):
        peer.send("reduce", [(fragment, 1, NUMEL, seeds[i], WEIGHTS[i])])


@pytest.mark.parametrize(("codec", "fragment"), [("none", 601), ("e3m0", 602)])
def test_twelve_peers_in_groups_of_four_equal_the_staged_reference(
    peers: list[PeerProcess], codec: str, fragment: int
) -> None:
    command(peers, "codec", codec)
    command(peers, "staged", (MAX_GROUP, NUM_PEERS, True, None))
    seeds = [fragment * 100 + i for i in range(NUM_PEERS)]
    _reduce(peers, fragment, seeds)
    results = [peer.recv(TIMEOUT)[1][0] for peer in peers]
    ids = [peer.peer_id for peer in peers]
    plan, order, deltas, values = _expected(ids, fragment, seeds, codec)
    assert plan.shape == (4, 3)
    assert len({_sha(v) for v in values}) == 1  # the reference itself: one value for all
    assert all(r["ok"] for r in results), results
    assert {r["sha256"] for r in results} == {_sha(values[0])}
    assert all(sorted(r["members"]) == sorted(ids) for r in results)
    for r in results:
        (s0, m0, sent0, got0), (s1, m1, sent1, got1) = r["stages"]
        assert (s0, m0, s1, m1) == (0, 4, 1, 3)
        assert min(sent0, got0, sent1, got1) > 0
        assert r["bytes_sent"] == sent0 + sent1
    # the flat weighted mean of all 12, computed here directly
    w = torch.tensor([WEIGHTS[i] for i in order], dtype=torch.float64)
    flat = (torch.stack(deltas).double() * (w / w.sum())[:, None]).sum(0)
    error = float((values[0].double() - flat).norm() / flat.norm())
    assert error < (1e-6 if codec == "none" else 0.4)


@pytest.mark.parametrize(("stage", "fragment"), [(0, 700), (1, 701)])
def test_peer_killed_mid_stage_the_eleven_survivors_hold_the_staged_mean(
    peers: list[PeerProcess], stage: int, fragment: int
) -> None:
    """One peer is SIGKILLed mid-stage (once its own part has a contribution). In stage 0
    its cell reruns without it and the next member of its cell takes its stage-1 slot,
    counting the cell's 3; in stage 1 (its cell's mean already held by its cell) its
    stage-1 group reruns with that stand-in. Either way all 11 survivors hold the bytes of
    the in-process staged reducer with that loss, within float rounding of the flat
    weighted mean of the members it counts."""
    command(peers, "codec", "none")
    command(peers, "staged", (MAX_GROUP, NUM_PEERS, False, None))
    victim = peers[5]
    victim.send("staged", (MAX_GROUP, NUM_PEERS, False, stage))
    assert victim.recv(30)[0] == "ok"
    seeds = [fragment * 100 + i for i in range(NUM_PEERS)]
    ids = [peer.peer_id for peer in peers]
    try:
        _reduce(peers, fragment, seeds)
        assert victim.recv(TIMEOUT) == ("dying", stage)
        results = {i: peers[i].recv(TIMEOUT)[1][0] for i in range(NUM_PEERS) if i != 5}
    finally:  # a fresh peer in its place for the next test (the fixture stops it)
        stop_peers([victim])
        peers[5] = start_peer(peers[0].maddrs[:1])
    order = group_order(ids)
    position = {peer: k for k, peer in enumerate(order)}  # test index -> group index
    plan, _, deltas, _ = _expected(ids, fragment, seeds, "none")
    reference = staged_mean(plan, deltas, get_codec("none"), lost={position[5]: stage})
    counted = sorted(reference.counted[position[0]])
    assert len(counted) == (11 if stage == 0 else 12)
    assert all(r["ok"] for r in results.values()), results
    assert {r["sha256"] for r in results.values()} == {_sha(reference.values[position[0]])}
    names = {position[i]: ids[i] for i in range(NUM_PEERS)}
    assert all(sorted(r["members"]) == sorted(names[m] for m in counted) for r in results.values())
    # the stage that lost the victim ran again as a view: more bytes than any other's once
    mates = {i for i in results if position[i] in plan.group_of(position[5], stage).members}
    assert len(mates) == (3 if stage == 0 else 2)
    others = max(results[i]["stages"][stage][2] for i in results if i not in mates)
    if stage == 1:
        assert all(results[i]["stages"][1][2] > others for i in mates), results
    else:  # the cell reran among its 3 survivors
        assert all(results[i]["stages"][0][1] == 3 for i in mates), results
    w = torch.tensor([WEIGHTS[order[m]] for m in counted], dtype=torch.float64)
    flat = (torch.stack([deltas[m] for m in counted]).double() * (w / w.sum())[:, None]).sum(0)
    value = reference.values[position[0]].double()
    assert float((value - flat).norm() / flat.norm()) < 1e-6
