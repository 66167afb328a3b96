"""Butterfly all-reduce under faults: bad input, a killed sender, a killed reducer.

Real peer processes on loopback; faults are injected by ``AllReduceRunner`` subclasses
chosen with the ``Fault`` enum (``swarm_peers``).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from faults import GARBAGE, Fault
from swarm_expected import group_order, in_process_sha, partial_sha
from swarm_peers import TIMEOUTS, PeerProcess, command, run_rounds, start_peer, stop_peers

from diloco.protocol.core.round import CHUNK_VALUES


@pytest.mark.swarm
@pytest.mark.parametrize("fault", GARBAGE, ids=lambda f: f.value)
def test_bad_sender_excluded_round_completes(
    honest: list[PeerProcess], fragment: int, fault: Fault
) -> None:
    numel = 4_096
    seeds = [fragment * 10 + i for i in range(4)]
    weights = [1.0, 1.0, 2.0, 1.0]
    bad = group_order([p.peer_id for p in honest])[1]  # reducer of part 1
    command(honest[bad : bad + 1], "fault", fault.value)
    specs = [[(fragment, 1, numel, seeds[i], weights[i])] for i in range(4)]
    results = [r[0] for r in run_rounds(honest, specs, timeout=TIMEOUTS.total + 60)]
    ids = [p.peer_id for p in honest]
    good = [i for i in range(4) if i != bad]
    expected = partial_sha(ids, numel, seeds, weights, "none", excluded=bad)
    assert [results[i].get("sha256") for i in good] == [expected] * 3, results
    assert all(sorted(results[i]["members"]) == sorted(ids[j] for j in good) for i in good)
    assert not results[bad]["ok"]
    assert all(peer.process.is_alive() for peer in honest)


@pytest.mark.swarm
def test_cut_part_streams_are_opened_again_and_round_completes(
    honest: list[PeerProcess], fragment: int
) -> None:
    numel = 4 * 3 * CHUNK_VALUES  # three chunks per part: the cut comes mid-part
    seeds = [fragment * 10 + i for i in range(4)]
    command(honest[2:3], "fault", Fault.CUT_PART_STREAMS.value)
    specs = [[(fragment, 1, numel, seeds[i], 1.0)] for i in range(4)]
    results = [r[0] for r in run_rounds(honest, specs, timeout=TIMEOUTS.total + 60)]
    expected = in_process_sha([p.peer_id for p in honest], numel, seeds, [1.0] * 4, "none")
    assert [r.get("sha256") for r in results] == [expected] * 4, results


@pytest.fixture
def victim(honest: list[PeerProcess]) -> Iterator[PeerProcess]:
    """A fifth peer, bootstrapped from the pool, for a test to kill."""
    peer = start_peer(honest[0].maddrs[:1])
    try:
        yield peer
    finally:
        stop_peers([peer])


def _round_with_killed_victim(
    honest: list[PeerProcess], victim: PeerProcess, fragment: int, fault: Fault
) -> list[dict[str, object]]:
    """Peers 0..2 of the pool and the victim start one round; the victim is SIGKILLed once
    its fault says it is stalled mid-round. Returns the survivors' results.

    How the round ends is read from the results, not from a clock: a success, or a
    failure reason the round's own rules give. A round that sits out its part deadlines
    is cut by the whole round's deadline, which fails it with "round deadline passed"
    (``SwarmReducer``): no success, and none of the reasons the tests accept."""
    command([victim], "fault", fault.value)
    group = [*honest[:3], victim]
    for i, peer in enumerate(group):
        peer.send("reduce", [(fragment, 1, 50_000, fragment + i, 1.0)])
    assert victim.recv(TIMEOUTS.total + 30)[:2] == ("stalled", fault.value.split("_")[1])
    victim.kill()
    return [peer.recv(TIMEOUTS.total + 30)[1][0] for peer in honest[:3]]


@pytest.mark.swarm
def test_killed_sender_survivors_agree_and_match(
    honest: list[PeerProcess], victim: PeerProcess, fragment: int
) -> None:
    # The victim stalls as a sender and is killed. If it dies before delivering its own
    # part, the part is re-reduced and the round succeeds without it; if it delivered the
    # part first, it cannot answer the checks of that part, and every survivor fails the
    # round (a reducer must not escape the checks by going silent: docs/allreduce.md).
    # Either way the survivors agree, and none applies a partial result.
    results = _round_with_killed_victim(honest, victim, fragment, Fault.STALL_SENDER)
    assert len({r["ok"] for r in results}) == 1, results
    if results[0]["ok"]:
        assert len({r["sha256"] for r in results}) == 1
        assert all(victim.peer_id not in r["members"] and len(r["members"]) == 3 for r in results)
    else:
        assert all("answer" in r["reason"] or "missing" in r["reason"] for r in results), results


@pytest.mark.swarm
def test_killed_reducer_part_rereduced_survivors_get_the_mean_of_their_contributions(
    honest: list[PeerProcess], victim: PeerProcess, fragment: int
) -> None:
    # The victim joins the group, then freezes and is SIGKILLed mid-round: its part is
    # re-reduced by its substitute among the three survivors (issue 12 "Churn").
    results = _round_with_killed_victim(honest, victim, fragment, Fault.STALL_MEMBER)
    assert all(r["ok"] for r in results), results  # re-reduced: nothing else completes it
    ids = [p.peer_id for p in [*honest[:3], victim]]
    seeds = [fragment + i for i in range(4)]
    expected = partial_sha(ids, 50_000, seeds, [1.0] * 4, "none", excluded=3, own_part=False)
    assert [r["sha256"] for r in results] == [expected] * 3
    assert all(sorted(r["members"]) == sorted(ids[:3]) for r in results)


@pytest.mark.swarm
def test_reducer_killed_after_contributing_survivors_agree(
    honest: list[PeerProcess], victim: PeerProcess, fragment: int
) -> None:
    # Killed once it holds everyone's part: where its own contributions were counted they
    # stay counted, so the exact mean depends on timing; the survivors agree on it.
    results = _round_with_killed_victim(honest, victim, fragment, Fault.STALL_REDUCER)
    assert all(r["ok"] for r in results), results  # its part re-reduced, by the rule
    assert len({r["sha256"] for r in results}) == 1
    assert all(victim.peer_id not in r["members"] and len(r["members"]) == 3 for r in results)
    # the pool still works afterwards: nobody kept stale state of the round
    after = run_rounds(honest, [[(fragment, 2, 1_000, i, 1.0)] for i in range(4)], 60)
    assert len({r[0]["sha256"] for r in after}) == 1 and after[0][0]["ok"]
