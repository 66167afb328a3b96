"""Round declarations (docs/design.md "The round"): a member's signed word that it is in round
``(p, k)``, with its weight, its proof of membership of a closed swarm, whether it is a
client, and the prior state it starts the round from (layout: ``records``).

Payloads come from untrusted peers: ``parse_declaration`` validates them strictly;
readers skip and log invalid ones.
"""

from __future__ import annotations

import logging
import math
import re
from typing import NamedTuple

from hivemind import DHT
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time

from diloco.errors import ProtocolError
from diloco.protocol.runtime import round_trips
from diloco.protocol.trust.envelopes import (
    MAX_RECORD_TTL,
    pack_payload,
    read_signed,
    signer,
    store_signed,
    unpack_payload,
)
from diloco.protocol.trust.swarm_key import NOT_MEMBER, PROOF_BYTES, ClosedSwarm

logger = logging.getLogger(__name__)

MAX_DECLARATION_BYTES = 96
PRIOR_CHARS = 16
"""Hex digits of a member's prior state hash that its round declaration carries."""
PRIOR_PATTERN = re.compile(r"^[0-9a-f]{16}$")


class Declaration(NamedTuple):
    """One member's declaration for a round (``parse_declaration``)."""

    weight: float
    proof: bytes | None
    """Its proof of membership of a closed swarm; None without one."""
    client: bool
    """It reduces no part and is never chosen to lead (nobody can dial it)."""
    prior: str
    """The first ``PRIOR_CHARS`` hex digits of the hash of the fragment state it starts the
    round from; "" when it declared none."""


def prior_tag(state_hash: str) -> str:
    """What a declaration carries of the prior state hash ``state_hash`` ("" stays "")."""
    return state_hash[:PRIOR_CHARS]


@round_trips.exchange("declare")
async def declare_round(
    dht: DHT,
    key: str,
    weight: float,
    expiration: float,
    closed: ClosedSwarm | None = None,
    client: bool = False,
    prior: str = "",
) -> bool:
    """Declare this node for the round of DHT key ``key`` (``lobby.round_key``) with
    its ``weight`` until ``expiration``, cut to ``MAX_RECORD_TTL`` (a declaration is read
    only while the round matches). In a ``closed`` swarm the declaration carries this
    node's proof of membership; a ``client`` (it reduces no part, and nobody can dial it)
    says so, and is then never chosen to lead; ``prior`` is the hash of the fragment state
    this node starts the round from ("": none declared)."""
    expiration = min(expiration, get_dht_time() + MAX_RECORD_TTL)
    proof = b"" if closed is None else closed.declaration_proof(key, signer(dht).peer_id)
    value: object = float(weight)
    if prior:
        value = [float(weight), proof, client, prior_tag(prior)]
    elif client:
        value = [float(weight), proof, True]
    elif closed is not None:
        value = [float(weight), proof]
    return await store_signed(dht, key, pack_payload(value), expiration)


async def read_declarations(
    dht: DHT, key: str, closed: ClosedSwarm | None = None
) -> dict[PeerID, float]:
    """Peers declared under the round key ``key`` with their weights (``read_round_view``)."""
    view = await read_round_view(dht, key, closed)
    return {peer: declaration.weight for peer, declaration in view.items()}


@round_trips.exchange("read")
async def read_round_view(
    dht: DHT, key: str, closed: ClosedSwarm | None = None
) -> dict[PeerID, Declaration]:
    """Peers declared under the round key ``key`` with their declarations; invalid
    declarations are logged with the peer id they claim and skipped, and so are, in a
    ``closed`` swarm, those without a valid proof of membership (outsiders are not in the
    view)."""
    return {peer: d for peer, (d, _) in (await _read_round(dht, key, closed)).items()}


@round_trips.exchange("read")
async def read_round_expiring(
    dht: DHT, key: str, closed: ClosedSwarm | None = None
) -> dict[PeerID, tuple[Declaration, float]]:
    """``read_round_view`` with each declaration's expiration (DHT time, signed with it): a
    node that declares ahead of its send step sets it that much later (``ahead``)."""
    return await _read_round(dht, key, closed)


async def _read_round(
    dht: DHT, key: str, closed: ClosedSwarm | None
) -> dict[PeerID, tuple[Declaration, float]]:
    view: dict[PeerID, tuple[Declaration, float]] = {}
    for peer_id, signed in (await read_signed(dht, key)).items():
        try:
            declaration = parse_declaration(signed.payload)
        except ProtocolError as exc:
            logger.warning("ignoring declaration of %s under %s: %s", peer_id, key, exc)
            continue
        proof = declaration.proof
        if closed is not None and not closed.check(closed.declaration_proof(key, peer_id), proof):
            logger.info("ignoring declaration of %s under %s: %s", peer_id, key, NOT_MEMBER)
            continue
        view[PeerID.from_base58(peer_id)] = (declaration, signed.expiration)
    return view


def parse_declaration(payload: bytes) -> Declaration:
    """A round declaration, validated.

    Raises:
        ProtocolError: none of ``[a finite float > 0, 32-byte proof or b"", bool, prior]``
            (prior: ``PRIOR_CHARS`` lowercase hex digits), such a float alone,
            ``[such a float, 32-byte proof]``, ``[such a float, 32-byte proof or b"", True]``.
    """
    value = unpack_payload(payload, MAX_DECLARATION_BYTES)
    weight, proof, client, prior = value, None, False, ""
    if isinstance(value, list) and len(value) == 4 and isinstance(value[1], bytes):
        weight, proof, client, prior = value
        if not isinstance(client, bool):
            raise ProtocolError(f"declared client flag {client!r:.20} is not a bool")
        if not isinstance(prior, str) or not PRIOR_PATTERN.fullmatch(prior):
            raise ProtocolError(f"declared prior {prior!r:.40} is not {PRIOR_CHARS} hex digits")
        proof = proof or None
    elif isinstance(value, list) and len(value) == 3 and isinstance(value[1], bytes):
        weight, proof, client = value
        if client is not True:
            raise ProtocolError(f"declared client flag {client!r:.20} is not True")
        proof = proof or None
    elif isinstance(value, list) and len(value) == 2 and isinstance(value[1], bytes):
        weight, proof = value
    if proof is not None and len(proof) != PROOF_BYTES:
        raise ProtocolError(f"declaration proof of {len(proof)} bytes, not {PROOF_BYTES}")
    if not isinstance(weight, float) or not math.isfinite(weight) or weight <= 0:
        raise ProtocolError(f"declared weight {weight!r:.80} is not a finite float > 0")
    return Declaration(weight, proof, client, prior)
