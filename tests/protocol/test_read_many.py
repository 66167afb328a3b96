"""Several record keys read in one call to the DHT process (``envelopes.read_signed_many``):
a heal's check reads the node records and every fragment's vouches at once."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
from hivemind import DHT

from diloco.protocol.records.nodes import (
    FragmentVersion,
    NodeRecord,
    Vouch,
    nodes_key,
    publish_record,
    publish_vouches,
    read_records_and_vouches,
    read_vouches,
)
from diloco.protocol.runtime.network import NetworkOptions
from diloco.protocol.swarm import make_dht
from diloco.protocol.trust.envelopes import read_signed_many, signer
from diloco.protocol.wire.run_id import make_run_id

pytestmark = pytest.mark.swarm  # two DHT processes and their p2pds

RUN = make_run_id("many", {"seed": 1})
H = "cd" * 32


def _counted(calls: list[str], name: str, method: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        calls.append(name)
        return method(*args, **kwargs)

    return call


def test_records_and_vouches_of_several_fragments_come_in_one_dht_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    dhts: list[DHT] = []
    try:
        alice = make_dht(NetworkOptions(host_maddrs=("/ip4/127.0.0.2/tcp/0",)))
        dhts.append(alice)
        peers = tuple(str(a) for a in alice.get_visible_maddrs())
        bob = make_dht(NetworkOptions(initial_peers=peers, host_maddrs=("/ip4/127.0.0.3/tcp/0",)))
        dhts.append(bob)
        a, b = signer(alice).peer_id, signer(bob).peer_id
        both = tuple(sorted((a, b)))
        for dht, me, step in ((alice, a, 20), (bob, b, 21)):
            record = NodeRecord(me, (), step, (FragmentVersion(0, 2, H),), 1.0, "0.1.0")
            assert asyncio.run(publish_record(dht, RUN, record, 30.0))
        # bob vouches for fragments 0 and 2, alice for fragment 2 only; nobody for 1
        for dht, me, fragments in ((bob, b, (0, 2)), (alice, a, (2,))):
            for p in fragments:
                vouches = [Vouch(me, p, 2, H, both), Vouch(me, p, 3, H, both)]
                assert asyncio.run(publish_vouches(dht, RUN, vouches, 30.0))

        calls: list[str] = []
        monkeypatch.setattr(alice, "get", _counted(calls, "get", alice.get))
        monkeypatch.setattr(alice, "run_coroutine", _counted(calls, "many", alice.run_coroutine))
        found, vouches = asyncio.run(read_records_and_vouches(alice, RUN, [0, 1, 2]))
        assert calls == ["many"]
        assert [(r.peer_id, r.global_step) for r in found.live] == sorted([(a, 20), (b, 21)])
        assert sorted((v.author, v.fragment, v.round) for v in vouches) == sorted(
            [(b, 0, 2), (b, 0, 3), (b, 2, 2), (b, 2, 3), (a, 2, 2), (a, 2, 3)]
        )
        calls.clear()
        later = asyncio.run(read_vouches(alice, RUN, [1, 2]))
        assert sorted((v.author, v.fragment, v.round) for v in later) == sorted(
            [(b, 2, 2), (b, 2, 3), (a, 2, 2), (a, 2, 3)]
        )
        assert calls == ["many"]
        # one key: a plain get
        calls.clear()
        assert sorted(asyncio.run(read_signed_many(alice, [nodes_key(RUN)]))[nodes_key(RUN)]) == (
            sorted([a, b])
        )
        assert calls == ["get"]
        with pytest.raises(ValueError, match="read twice"):
            asyncio.run(read_signed_many(alice, [nodes_key(RUN), nodes_key(RUN)]))
    finally:
        for dht in dhts:
            dht.shutdown()
