"""``--identity``: a node's peer id comes from its key file, for starters and joiners alike."""

from __future__ import annotations

from pathlib import Path

import pytest
from hivemind.p2p import PeerID

from diloco.protocol.runtime.network import NetworkOptions
from diloco.protocol.swarm import Swarm, make_dht
from diloco.protocol.trust.identity import load_identity
from diloco.protocol.wire.run_id import make_run_id


@pytest.mark.swarm
def test_joiner_dht_takes_its_peer_id_from_the_identity_file(tmp_path: Path) -> None:
    path = tmp_path / "node.key"
    net = NetworkOptions(identity_path=str(path))
    ids, reused = [], []
    for _ in range(2):  # the first run creates the key, the second reuses it
        dht = make_dht(net)
        try:
            ids.append(dht.peer_id)
            reused.append(dht.reused_identity)
        finally:
            dht.shutdown()
    assert ids[0] == ids[1] == PeerID.from_base58(load_identity(path).peer_id)
    assert reused == [False, True]  # the second may find its first's declarations


@pytest.mark.swarm
def test_swarm_takes_its_peer_id_from_the_identity_file(tmp_path: Path) -> None:
    path = tmp_path / "node.key"
    with Swarm(make_run_id("identity", {}), NetworkOptions(identity_path=str(path))) as swarm:
        assert swarm.peer_id == PeerID.from_base58(load_identity(path).peer_id)
