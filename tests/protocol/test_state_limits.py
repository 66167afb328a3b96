"""A state server under spam (attack 6): caps and hashes once per snapshot.

The pure rules are in ``test_limits``; here a real ``StateServer`` on a real p2pd answers a
peer that fires many STATE_REQ streams at once and then one after another.
"""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import Iterator

import pytest
import torch

from diloco.errors import ProtocolError
from diloco.protocol.runtime.network import NetworkOptions
from diloco.protocol.state.fragment import FragmentState, OuterState
from diloco.protocol.state.transfer import SnapshotHashes, StateServer, fetch_state
from diloco.protocol.swarm import Swarm
from diloco.protocol.trust.bans import BanList
from diloco.protocol.trust.limits import StreamLimits
from diloco.protocol.wire.run_id import make_run_id, run_digest

RUN = make_run_id("limits", {"purpose": "state spam"})
NUM_FRAGMENTS, NUMEL = 3, 50_000
BURST = 3
SPAM = 20


def _snapshot() -> OuterState:
    gen = torch.Generator().manual_seed(7)
    return OuterState(
        123,
        {
            p: FragmentState(
                torch.randn(NUMEL, generator=gen), torch.randn(NUMEL, generator=gen), 4
            )
            for p in range(NUM_FRAGMENTS)
        },
    )


def test_snapshot_hashes_once_per_object_and_forgets_dead_ones() -> None:
    cache = SnapshotHashes()
    first = FragmentState(torch.ones(4), torch.zeros(4), 1)
    cache.put(first, "h1")
    assert cache.get(first) == "h1"
    assert cache.get(first.clone()) is None  # equal values, another snapshot
    del first
    gc.collect()
    assert len(cache) == 0


@pytest.fixture
def swarms() -> Iterator[tuple[Swarm, Swarm]]:
    server = Swarm(RUN, NetworkOptions(host_maddrs=("/ip4/127.0.0.2/tcp/0",)))
    try:
        client = Swarm(
            RUN,
            NetworkOptions(
                initial_peers=tuple(server.maddrs), host_maddrs=("/ip4/127.0.0.3/tcp/0",)
            ),
        )
        try:
            yield server, client
        finally:
            client.shutdown()
    finally:
        server.shutdown()


@pytest.mark.swarm
def test_state_server_caps_a_spammer_and_hashes_each_snapshot_once(
    swarms: tuple[Swarm, Swarm], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    server, client = swarms
    snapshot = _snapshot()
    expected = {p: s.sha256() for p, s in snapshot.fragments.items()}
    hashed: list[int] = []
    sha256 = FragmentState.sha256

    def counting(state: FragmentState) -> str:
        hashed.append(id(state))
        return sha256(state)

    monkeypatch.setattr(FragmentState, "sha256", counting)
    limits = StreamLimits(max_streams=4, burst=BURST, refill_seconds=3600.0)
    state_server = StateServer(
        server.p2p, RUN, run_digest(RUN), lambda: snapshot, 30.0, BanList(), limits
    )
    server.call(state_server.start())
    digest, peer = run_digest(RUN), server.peer_id

    async def spam() -> list[OuterState | BaseException]:
        asks = [fetch_state(client.p2p, peer, RUN, digest) for _ in range(SPAM)]
        return list(await asyncio.gather(*asks, return_exceptions=True))

    with caplog.at_level(logging.WARNING, logger="diloco.protocol.state.transfer"):
        at_once = client.call(spam(), 120.0)
        one_by_one = []
        for _ in range(BURST + 2):
            try:
                one_by_one.append(client.call(fetch_state(client.p2p, peer, RUN, digest), 60.0))
            except ProtocolError as error:
                one_by_one.append(error)

    results = at_once + one_by_one
    served = [r for r in results if isinstance(r, OuterState)]
    refused = [r for r in results if isinstance(r, ProtocolError) and "BUSY" in str(r)]
    assert len(served) + len(refused) == len(results)
    # At once: never more than one stream of this peer; then at most BURST in all.
    assert 1 <= sum(isinstance(r, OuterState) for r in at_once) <= BURST
    assert len(served) == BURST
    assert isinstance(one_by_one[-1], ProtocolError)
    assert "over 3 requests, then one per 3600 s" in str(one_by_one[-1])
    for state in served:
        assert state.global_step == 123
        assert {p: s.sha256() for p, s in state.fragments.items()} == expected
    # The server hashed each fragment of its one snapshot once, not once per request (the
    # checks above hash the downloaded copies, other objects).
    server_hashes = [h for h in hashed if h in {id(s) for s in snapshot.fragments.values()}]
    assert len(server_hashes) == NUM_FRAGMENTS
    refusals = [m for m in caplog.messages if "refused (BUSY)" in m]
    assert len(refusals) == 1 and client.peer_id.to_base58() in refusals[0]
