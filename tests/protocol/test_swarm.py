"""SwarmReducer end to end: four real peer processes on loopback."""

from __future__ import annotations

import pytest
from swarm_expected import in_process_sha
from swarm_peers import TIMEOUTS, PeerProcess, command, run_rounds, start_peer, stop_peers

from diloco.protocol.wire.run_id import make_run_id

pytestmark = pytest.mark.swarm


# The sizes and codecs that the wire between processes adds something to: an odd size, the
# return codec apart, a payload of many chunks. Small payloads of each codec go through the
# same runners in process (test_allreduce_inprocess.py).
@pytest.mark.parametrize(
    ("codec", "numel"),
    [("none", 300_001), ("none/e3m0", 10_000), ("e3m0", 5_000_000)],
)
def test_reduce_four_peers_identical_to_in_process(
    honest: list[PeerProcess], fragment: int, codec: str, numel: int
) -> None:
    command(honest, "codec", codec)
    seeds = [fragment * 10 + i for i in range(4)]
    weights = [1.0, 2.0, 3.0, 4.5]
    specs = [[(fragment, 1, numel, seeds[i], weights[i])] for i in range(4)]
    results = [r[0] for r in run_rounds(honest, specs, timeout=TIMEOUTS.total + 60)]
    ids = [peer.peer_id for peer in honest]
    assert all(r["ok"] for r in results), results
    assert {r["sha256"] for r in results} == {in_process_sha(ids, numel, seeds, weights, codec)}
    assert all(sorted(r["members"]) == sorted(ids) for r in results)
    assert all(r["bytes_sent"] > 0 and r["bytes_received"] > 0 for r in results)


def test_reduce_two_fragments_at_once_both_correct(
    honest: list[PeerProcess], fragment: int
) -> None:
    other = fragment + 1000
    numel = 20_000
    specs = [
        [(fragment, 2, numel, 7 + i, 1.0), (other, 5, numel // 2, 70 + i, 1.0)] for i in range(4)
    ]
    results = run_rounds(honest, specs, timeout=TIMEOUTS.total + 60)
    ids = [peer.peer_id for peer in honest]
    first = in_process_sha(ids, numel, [7 + i for i in range(4)], [1.0] * 4, "none")
    second = in_process_sha(ids, numel // 2, [70 + i for i in range(4)], [1.0] * 4, "none")
    assert first != second
    assert [r[0]["sha256"] for r in results] == [first] * 4
    assert [r[1]["sha256"] for r in results] == [second] * 4


def test_reduce_alone_fails_with_default_min_group_size(
    honest: list[PeerProcess], fragment: int
) -> None:
    (result,) = run_rounds(honest[:1], [[(fragment, 1, 1_000, 1, 1.0)]], TIMEOUTS.total + 30)[0]
    assert not result["ok"]
    assert "min_group_size" in result["reason"]


def test_records_published_are_read_by_every_peer(honest: list[PeerProcess]) -> None:
    for peer in honest[:2]:
        peer.send("serve_state", (1, 10, 5, False))
    for peer in honest[:2]:
        assert peer.recv(30) == ("ok", True)
    honest[3].send("records")
    kind, ids = honest[3].recv(30)
    assert kind == "records"
    assert set(ids) >= {honest[0].peer_id, honest[1].peer_id}


def test_other_configuration_is_not_joined(honest: list[PeerProcess], fragment: int) -> None:
    other_run = make_run_id("test", {"purpose": "a different configuration"})
    stranger = start_peer(honest[0].maddrs[:1], run_id=other_run)
    try:
        stranger.send("serve_state", (1, 10, 5, False))  # publishes its record
        assert stranger.recv(30) == ("ok", True)
        honest[0].send("records")
        assert stranger.peer_id not in honest[0].recv(30)[1]
        # its rounds never meet ours: alone in its namespace, it fails to find a group
        stranger.send("reduce", [(fragment, 1, 1_000, 1, 1.0)])
        results = run_rounds(honest[:2], [[(fragment, 1, 1_000, i, 1.0)] for i in range(2)], 60)
        assert [r[0]["ok"] for r in results] == [True, True]
        assert all(len(r[0]["members"]) == 2 for r in results)
        assert not stranger.recv(TIMEOUTS.total + 30)[1][0]["ok"]
    finally:
        stop_peers([stranger])
