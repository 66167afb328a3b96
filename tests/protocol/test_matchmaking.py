"""Group formation per fragment round: a bounded window, late arrivals miss the round, a
dead leader is replaced."""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import pytest
from hivemind.p2p import PeerID
from swarm_expected import in_process_delta, in_process_sha, leader_order, sha
from swarm_peers import (
    RUN_ID,
    TIMEOUTS,
    UNIT,
    Fault,
    PeerProcess,
    command,
    run_rounds,
    start_peer,
    stop_peers,
    write_leading_identity,
)

from diloco.protocol.core.reducer import RoundKey
from diloco.protocol.matchmaking.lobby import choose_leader, leader_rank, round_key


def test_round_key_namespaced_by_run_and_round() -> None:
    assert round_key("run-0123456789abcdef", RoundKey(3, 7)) == "run-0123456789abcdef/frag3/round7"


KEY = "run-0123456789abcdef/frag3/round7"


def _rank(key: str, peer: PeerID) -> bytes:
    """The rank spelled out: sha256 of the key's bytes, a bar, the peer id's bytes."""
    return hashlib.sha256(key.encode() + b"|" + peer.to_bytes()).digest()


def test_leader_rank_is_sha256_of_round_key_and_peer_id() -> None:
    peer = PeerID(b"\x00\x24\x01")
    assert leader_rank(KEY, peer) == _rank(KEY, peer)


def test_choose_leader_lowest_rank_not_lowest_peer_id() -> None:
    peers = [PeerID(bytes([0x00, 0x24, i])) for i in range(8)]
    first = min(peers, key=lambda p: _rank(KEY, p))
    assert choose_leader(set(peers), KEY) == first
    assert choose_leader(peers[::-1], KEY) == first  # views that agree choose alike
    assert choose_leader({peers[5]}, KEY) == peers[5]


def test_choose_leader_changes_with_the_round() -> None:
    # The lowest peer id would lead every round; by rank each leads about 1/M of them.
    peers = [PeerID(bytes([0x00, 0x24, i])) for i in range(4)]
    leaders = {choose_leader(peers, f"run-0123456789abcdef/frag0/round{k}") for k in range(40)}
    assert leaders == set(peers)


def test_choose_leader_empty_view_is_an_error() -> None:
    with pytest.raises(ValueError):
        choose_leader(set(), KEY)


@pytest.mark.swarm
def test_late_arrival_misses_round_others_complete(
    honest: list[PeerProcess], fragment: int
) -> None:
    for i, peer in enumerate(honest[:3]):
        peer.send("reduce", [(fragment, 1, 2_000, i, 1.0)])
    early = [peer.recv(TIMEOUTS.total + 30)[1][0] for peer in honest[:3]]
    honest[3].send("reduce", [(fragment, 1, 2_000, 3, 1.0)])
    (late,) = honest[3].recv(TIMEOUTS.total + 30)[1]
    assert all(r["ok"] for r in early) and len({r["sha256"] for r in early}) == 1, early
    assert len(early[0]["members"]) == 3
    assert not late["ok"], late


@pytest.mark.swarm
def test_members_with_another_prior_state_never_share_the_round(
    honest: list[PeerProcess], fragment: int
) -> None:
    # Peer 2 missed a round the others applied: its prior state differs. Averaging with it
    # would add the same mean to different states and split the swarm's hashes.
    same, other = "a" * 64, "b" * 64
    priors = [same, same, other]
    for i, peer in enumerate(honest[:3]):
        peer.send("reduce", [(fragment, 1, 2_000, i, 1.0, priors[i])])
    results = [peer.recv(TIMEOUTS.total + 30)[1][0] for peer in honest[:3]]
    ids = [p.peer_id for p in honest[:3]]
    assert results[0]["ok"] and results[1]["ok"], results
    assert results[0]["sha256"] == results[1]["sha256"]
    assert sorted(results[0]["members"]) == sorted(ids[:2])
    assert not results[2]["ok"], results[2]  # alone with its prior: no group, it heals


@pytest.mark.swarm
def test_dead_leader_followers_take_over_and_complete(
    honest: list[PeerProcess], fragment: int, tmp_path: Path
) -> None:
    ids = [p.peer_id for p in honest]
    identity = str(tmp_path / "leader.key")
    leader_id = write_leading_identity(identity, ids, round_key(RUN_ID, RoundKey(fragment, 1)))
    leader = start_peer(honest[0].maddrs[:1], identity_path=identity)
    try:
        assert leader.peer_id == leader_id
        command([leader], "fault", Fault.DIE_AS_LEADER.value)
        numel, seeds, weights = 20_000, [fragment + i for i in range(4)], [1.0] * 4
        leader.send("reduce", [(fragment, 1, numel, 99, 1.0)])
        results = run_rounds(
            honest, [[(fragment, 1, numel, seeds[i], 1.0)] for i in range(4)], TIMEOUTS.total + 30
        )
        leader.process.join(10)
        assert not leader.process.is_alive()  # it died while leading
        expected = in_process_sha(ids, numel, seeds, weights, "none")
        assert [r[0].get("sha256") for r in results] == [expected] * 4, results
        assert all(sorted(r[0]["members"]) == sorted(ids) for r in results)
    finally:
        stop_peers([leader])


@pytest.mark.swarm
def test_member_whose_join_stream_is_cut_asks_again_and_completes(
    honest: list[PeerProcess], fragment: int
) -> None:
    ids = [p.peer_id for p in honest]
    followers = leader_order(ids, RUN_ID, RoundKey(fragment, 1))[1:]
    cut = [honest[i] for i in followers]  # every follower (the leader never JOINs)
    command(cut, "fault", Fault.CUT_FIRST_JOIN.value)
    numel, seeds = 3_000, [fragment + i for i in range(4)]
    results = run_rounds(
        honest, [[(fragment, 1, numel, seeds[i], 1.0)] for i in range(4)], TIMEOUTS.total + 30
    )
    expected = in_process_sha(ids, numel, seeds, [1.0] * 4, "none")
    assert [r[0].get("sha256") for r in results] == [expected] * 4, results


@pytest.mark.swarm
def test_client_and_demoted_members_reduce_nothing_yet_count(
    honest: list[PeerProcess], fragment: int
) -> None:
    """Of four peers, the first in line to lead is a client (nobody can dial it: it may not
    lead) and the three others are demoted (they ask for no part, yet may lead). The second
    in line leads and, since nobody else would, reduces the whole vector itself: every
    member, client and demoted ones included, gets the in-process mean of all four."""
    ids = [p.peer_id for p in honest]
    first = leader_order(ids, RUN_ID, RoundKey(fragment, 1))[0]
    command(honest[first : first + 1], "role", "client")
    command([p for i, p in enumerate(honest) if i != first], "role", "demoted")
    numel, seeds = 20_000, [fragment * 10 + i for i in range(4)]
    specs = [[(fragment, 1, numel, seeds[i], 1.0)] for i in range(4)]
    results = [r[0] for r in run_rounds(honest, specs, timeout=TIMEOUTS.total + 60)]
    second = ids[leader_order(ids, RUN_ID, RoundKey(fragment, 1))[1]]
    expected = sha(in_process_delta(ids, numel, seeds, [1.0] * 4, "none", reducing=second))
    assert [r.get("sha256") for r in results] == [expected] * 4, results
    assert all(sorted(r["members"]) == sorted(ids) for r in results)


@pytest.mark.swarm
def test_silent_leader_next_in_line_leads_and_its_silences_within_a_minute_are_one_offence(
    honest: list[PeerProcess], fragment: int
) -> None:
    """Three real peers; the third takes JOINs as leader and sends no GROUP. In four rounds
    within seconds it is first in line to lead, and the others take over each time it is
    silent. They charge it once for them all (a node stopped for that long is silent in
    every round it was due in), so it is not banned (docs/design.md "Liveness"). The one
    real-process check of this; the in-process replay with exact offence counts, and the
    ban of a leader silent over several minutes, are in test_matchmaking_liveness.py. A
    round here lasts the silent leader's matchmaking bound (a window and three join
    timeouts, which it holds the JOINs for): the three peers run these rounds with a
    quarter of the usual window and join timeout (loopback JOINs answer in milliseconds;
    the bound waits out the silence)."""
    peers = honest[:3]
    ids = [p.peer_id for p in peers]
    short = dataclasses.replace(TIMEOUTS, matchmaking_window=0.25 * UNIT, join_timeout=0.5 * UNIT)
    command(peers, "timeouts", short)
    command(peers[2:], "fault", Fault.SILENT_LEADER.value)
    rounds = [k for k in range(1, 200) if leader_order(ids, RUN_ID, RoundKey(fragment, k))[0] == 2]
    formed = 0
    for k in rounds[:4]:
        specs = [[(fragment, k, 2_000, fragment + i, 1.0)] for i in range(3)]
        results = [r[0] for r in run_rounds(peers, specs, short.total + 30)]
        formed += (
            all(r["ok"] for r in results[:2])
            and results[0]["sha256"] == results[1]["sha256"]
            and sorted(results[0]["members"]) == sorted(ids[:2])
        )
    assert formed >= 3, formed
    for peer in peers[:2]:
        peer.send("banned", ids[2])
        assert peer.recv(30) == ("banned", False)
