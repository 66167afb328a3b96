"""Group formation per fragment round: a bounded window, late arrivals miss the round."""

from __future__ import annotations

import pytest
from swarm_peers import TIMEOUTS, PeerProcess

from diloco.protocol.matchmaking import round_key
from diloco.protocol.reducer import RoundKey


def test_round_key_namespaced_by_run_and_round() -> None:
    assert round_key("run-0123456789abcdef", RoundKey(3, 7)) == "run-0123456789abcdef/frag3/round7"


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
