"""Matchmaking among members that start a round from different prior states, in one process:
``Matchmaker`` over ``memory_p2p`` streams and a DHT held in a dict (signed records)."""

from __future__ import annotations

import asyncio
import logging

import pytest
from hivemind.p2p import PeerID
from memory_dht import MemoryDHT, Table
from memory_p2p import MemoryNetwork, make_identity

from diloco.errors import PriorDiverged, RoundFailed
from diloco.protocol.core.group import GroupInfo, RoundTimeouts
from diloco.protocol.core.reducer import RoundKey
from diloco.protocol.matchmaking.lobby import others_prior, round_key
from diloco.protocol.matchmaking.matchmaker import Matchmaker
from diloco.protocol.records.declarations import declare_round
from diloco.protocol.trust.bans import BanList
from diloco.protocol.wire.frames import Join, Kind, Reject, RejectCode, RoundTag

pytestmark = pytest.mark.clocked

RUN_ID = "priors-0123456789abcdef"
DIGEST = bytes(range(16))
KEY = RoundKey(2, 5)
WINDOW = 30.0
"""Long enough that a wait which ends before it has a reason other than the window."""
TIMEOUTS = RoundTimeouts(matchmaking_window=WINDOW, join_timeout=5.0)
X, Y = "a" * 64, "b" * 64
"""Two prior states (full hashes; declarations carry their first 16 hex digits)."""


def _peers(n: int, target_group_size: int | None = None) -> list[Matchmaker]:
    network, table = MemoryNetwork(), Table()
    peers = []
    for i in range(n):
        identity = make_identity(i)
        p2p = network.join(PeerID.from_base58(identity.peer_id))
        dht = MemoryDHT(identity, table)
        peers.append(
            Matchmaker(
                p2p,
                dht,
                RUN_ID,
                DIGEST,
                TIMEOUTS,
                BanList(),
                target_group_size=target_group_size,
            )
        )
    return peers


async def _form(peer: Matchmaker, prior: str) -> GroupInfo:
    return await peer.form_group(KEY, 1000, 0, 0, 1.0, prior)


def test_others_prior_needs_two_peers_and_a_majority_of_the_others() -> None:
    a, b, c, d = (PeerID(bytes([0x00, 0x24, i])) for i in range(4))
    assert others_prior({a: "x", b: "x", c: "m"}, "m") == "x"
    assert others_prior({a: "x", b: "x", c: "y"}, "m") == "x"  # 2 of the 3 others
    assert others_prior({a: "x"}, "m") is None  # one liar cannot send us healing
    assert others_prior({a: "x", b: "x", c: "y", d: "y"}, "m") is None  # no side
    assert others_prior({a: "m", b: "m"}, "m") is None  # they share our prior
    assert others_prior({}, "m") is None


def test_same_prior_pair_forms_without_waiting_for_the_odd_one(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Three live nodes (``target_group_size`` 3), one of which starts from another prior:
    the two others stop waiting once all three declared, and group; the odd one learns
    that most peers start from another state."""
    peers = _peers(3, target_group_size=3)

    async def main() -> list[GroupInfo | BaseException]:
        for peer in peers:
            await peer.start()
        jobs = [_form(peer, prior) for peer, prior in zip(peers, [X, X, Y], strict=True)]
        return await asyncio.gather(*jobs, return_exceptions=True)

    with caplog.at_level(logging.INFO, logger="diloco.protocol.matchmaking.matchmaker"):
        first, second, odd = asyncio.run(main())
    ids = {peer.p2p.peer_id for peer in peers[:2]}
    assert isinstance(first, GroupInfo) and isinstance(second, GroupInfo), (first, second)
    assert set(first.members) == set(second.members) == ids
    assert first.group_id == second.group_id
    assert isinstance(odd, PriorDiverged), odd
    assert odd.prior == X[:16]
    ended = [r.getMessage() for r in caplog.records if "of our prior" in r.getMessage()]
    assert len(ended) == 3 and not any("the window ended" in line for line in ended), ended
    assert sum("3 of 3 live nodes declared" in line for line in ended) >= 2, ended


def test_a_lone_other_prior_is_no_divergence() -> None:
    """Of two live nodes with different priors neither can tell who diverged: both fail
    the round plainly (healing's checks decide), without waiting out the window."""
    peers = _peers(2, target_group_size=2)

    async def main() -> list[GroupInfo | BaseException]:
        for peer in peers:
            await peer.start()
        jobs = [_form(peer, prior) for peer, prior in zip(peers, [X, Y], strict=True)]
        return await asyncio.gather(*jobs, return_exceptions=True)

    results = asyncio.run(main())
    assert all(type(r) is RoundFailed for r in results), results


def test_leader_refuses_a_join_of_another_or_no_declared_prior() -> None:
    leader, other, silent = _peers(3, target_group_size=4)  # the leader waits for a 4th
    tag = RoundTag(DIGEST, KEY.fragment, KEY.round)
    dht_key = round_key(RUN_ID, KEY)

    async def main() -> list[tuple[Kind, bytes]]:
        await leader.start()
        forming = asyncio.create_task(_form(leader, X))
        await declare_round(other.dht, dht_key, 1.0, 1e12, prior=Y)
        replies = [
            await peer._call_join(leader.p2p.peer_id, Join(tag, 1000, 0, 0, 1.0))
            for peer in (other, silent)
        ]
        forming.cancel()
        with pytest.raises(asyncio.CancelledError):
            await forming
        return replies

    refusals = [Reject.parse(body) for kind, body in asyncio.run(main())]
    assert [r.code for r in refusals] == [RejectCode.MISMATCH] * 2, refusals
    assert f"declared prior {Y[:16]}" in refusals[0].reason
    assert "no declaration found" in refusals[1].reason
    assert not leader.bans.banned(other.p2p.peer_id)  # its own state: no offence
