"""Round declarations: the prior state a member declares, validated like every other field."""

from __future__ import annotations

import asyncio

import pytest
from hivemind.p2p import PeerID
from memory_dht import MemoryDHT, Table
from memory_p2p import make_identity

from diloco.errors import ProtocolError
from diloco.protocol.records.declarations import (
    MAX_DECLARATION_BYTES,
    Declaration,
    declare_round,
    parse_declaration,
    read_round_view,
)
from diloco.protocol.trust.envelopes import pack_payload

pytestmark = pytest.mark.clocked

PRIOR = "0123456789abcdef"


def test_declaration_with_a_prior_parsed() -> None:
    value = [0.5, b"", False, PRIOR]
    assert parse_declaration(pack_payload(value)) == Declaration(0.5, None, False, PRIOR)
    closed_client = [0.5, b"p" * 32, True, PRIOR]
    assert len(pack_payload(closed_client)) <= MAX_DECLARATION_BYTES
    assert parse_declaration(pack_payload(closed_client)) == (0.5, b"p" * 32, True, PRIOR)


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ([0.5, b"", False, PRIOR[:15]], "declared prior"),
        ([0.5, b"", False, PRIOR + "0"], "declared prior"),
        ([0.5, b"", False, PRIOR.upper()], "declared prior"),
        ([0.5, b"", False, "g" * 16], "declared prior"),
        ([0.5, b"", False, ""], "declared prior"),
        ([0.5, b"", False, PRIOR.encode()], "declared prior"),
        ([0.5, b"", 1, PRIOR], "client flag"),
        ([0.5, b"p" * 31, False, PRIOR], "proof of 31 bytes"),
        ([float("inf"), b"", False, PRIOR], "declared weight"),
    ],
)
def test_declaration_with_a_malformed_prior_refused(value: object, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        parse_declaration(pack_payload(value))


def test_declared_prior_read_back_as_its_first_16_hex_digits() -> None:
    table = Table()
    alice, bob = (MemoryDHT(make_identity(i), table) for i in range(2))
    full = PRIOR + "f" * 48

    async def main() -> dict[PeerID, Declaration]:
        await declare_round(alice, "run-0123456789abcdef/frag1/round2", 2.0, 1e12, prior=full)
        await declare_round(bob, "run-0123456789abcdef/frag1/round2", 1.0, 1e12, client=True)
        return await read_round_view(alice, "run-0123456789abcdef/frag1/round2")

    view = asyncio.run(main())
    assert view == {
        PeerID.from_base58(alice.identity.peer_id): (2.0, None, False, PRIOR),
        PeerID.from_base58(bob.identity.peer_id): (1.0, None, True, ""),
    }
