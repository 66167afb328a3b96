"""Which addresses a dial-back may dial, and the verdict from the answers (pure parts)."""

from __future__ import annotations

import pytest
from hivemind.utils.multiaddr import Multiaddr

from diloco.protocol.runtime.reachability import (
    REACHABLE,
    UNREACHABLE,
    dial_targets,
    tcp_addresses,
    verdict,
)


def test_tcp_addresses_from_multiaddrs() -> None:
    maddrs = [
        Multiaddr("/ip4/10.0.0.2/tcp/4001/p2p/QmNnooDu7bfjPFoTZYxMNLWUQJyrVwtbZg5gBMjTezGAJN"),
        Multiaddr("/ip4/10.0.0.2/tcp/4001"),
        Multiaddr("/ip6/::1/tcp/5"),
        Multiaddr("/ip4/1.2.3.4/udp/9/quic"),
    ]
    assert tcp_addresses(maddrs) == [("10.0.0.2", 4001), ("::1", 5)]


def test_dial_targets_only_the_observed_ip_or_non_global_from_non_global() -> None:
    asked = [["93.184.216.34", 4001], ["140.82.112.3", 80], ["192.168.1.5", 4001], ["0.0.0.0", 1]]
    # From a public IP: only that IP (never a third party, never a private address).
    assert dial_targets(asked, "93.184.216.34") == [("93.184.216.34", 4001)]
    # Behind a masquerading router on a private network: its private address only.
    assert dial_targets(asked, "10.1.0.2") == [("192.168.1.5", 4001)]
    # Loopback only from loopback: the requester's 127.0.0.1 is not ours otherwise.
    local = [["127.0.0.1", 5], ["10.1.0.2", 6]]
    assert dial_targets(local, "10.1.0.2") == [("10.1.0.2", 6)]
    assert dial_targets(local, "127.0.0.3") == [("127.0.0.1", 5)]


@pytest.mark.parametrize(
    "asked", [{"a": 1}, [["1.2.3.4"]], [["1.2.3.4", "80"]], [["1.2.3.4", 0]], [["x", 1]]]
)
def test_dial_targets_malformed_request_raises(asked: object) -> None:
    with pytest.raises(ValueError):
        dial_targets(asked, "1.2.3.4")


def test_dial_targets_too_many_addresses_raises() -> None:
    with pytest.raises(ValueError, match="at most"):
        dial_targets([["10.0.0.1", p] for p in range(1, 10)], "10.0.0.1")


def test_verdict_client_only_when_every_answer_says_unreachable() -> None:
    assert verdict([UNREACHABLE, None, UNREACHABLE]) is True
    assert verdict([UNREACHABLE, REACHABLE]) is False
    assert verdict([None, None]) is None
    assert verdict([]) is None
