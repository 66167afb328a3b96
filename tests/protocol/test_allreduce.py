"""Butterfly all-reduce under faults, the multi-process smoke test: a reducer SIGKILLed
mid-round, its part re-reduced among the survivors.

Real peer processes on loopback; faults are injected by ``AllReduceRunner`` subclasses
chosen with the ``Fault`` enum (``swarm_peers``). Every other fault (bad input, cut
streams, late or killed senders, reducers dying at other moments) runs in process over the
same runners (``test_allreduce_inprocess.py``): one real SIGKILL per family is enough here.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from faults import Fault
from swarm_expected import partial_sha
from swarm_peers import TIMEOUTS, PeerProcess, command, start_peer, stop_peers


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
    # mid-round, and its reducer counts the round as in a group (a stopping node finishes it)
    assert victim.recv(TIMEOUTS.total + 30) == ("stalled", fault.value.split("_")[1], True)
    victim.kill()
    results = [peer.recv(TIMEOUTS.total + 30)[1][0] for peer in honest[:3]]
    assert not any(r["in_group"] for r in results)  # ended, however: no longer in a group
    return results


@pytest.mark.swarm
def test_killed_reducer_part_rereduced_survivors_get_the_mean_of_their_contributions(
    honest: list[PeerProcess], victim: PeerProcess, fragment: int
) -> None:
    # The victim joins the group, then freezes and is SIGKILLed mid-round: its part is
    # re-reduced by its substitute among the three survivors.
    results = _round_with_killed_victim(honest, victim, fragment, Fault.STALL_MEMBER)
    assert all(r["ok"] for r in results), results  # re-reduced: nothing else completes it
    ids = [p.peer_id for p in [*honest[:3], victim]]
    seeds = [fragment + i for i in range(4)]
    expected = partial_sha(ids, 50_000, seeds, [1.0] * 4, "none", excluded=3, own_part=False)
    assert [r["sha256"] for r in results] == [expected] * 3
    assert all(sorted(r["members"]) == sorted(ids[:3]) for r in results)
