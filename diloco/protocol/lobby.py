"""Where a fragment round meets: its DHT key, who leads it, and this node's lobby for it
(``matchmaking`` runs the protocol over these)."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Collection
from dataclasses import dataclass, field

from hivemind.p2p import PeerID

from diloco.protocol.reducer import RoundKey
from diloco.protocol.wire import Join, Kind

PRIOR_CHARS = 16
"""Hex digits of a member's prior state hash that go into the round's DHT key."""


def round_key(run_id: str, key: RoundKey, prior: str = "") -> str:
    """The DHT key nodes declare under for round ``key`` (SPEC 4).

    ``prior`` is the hash of the fragment's outer state the member starts the round from.
    Every member applies the same mean to its own prior state, so only members with equal
    priors may share a round: a member that missed a round the others applied declares
    under another key, finds no partner, and heals instead of silently diverging.
    """
    base = f"{run_id}/frag{key.fragment}/round{key.round}"
    return f"{base}/from{prior[:PRIOR_CHARS]}" if prior else base


def leader_rank(key: str, peer: PeerID) -> bytes:
    """Where ``peer`` stands in line to lead the round of DHT key ``key``:
    sha256(key | peer id bytes), lowest first.

    The lowest peer id would let one identity, ground once, lead every round. With the
    round key in the hash, each peer is first in a random-looking ``1/M`` of the rounds;
    grinding an identity for one future round gains that round only, at the cost of one
    more identity joining the swarm.
    """
    return hashlib.sha256(key.encode() + b"|" + peer.to_bytes()).digest()


def choose_leader(view: Collection[PeerID], key: str) -> PeerID:
    """The leader of round ``key`` (its DHT key) as a node with this view sees it: the
    peer of lowest ``leader_rank``.

    Every node applies the same rule, so nodes whose views agree choose the same leader.
    """
    return min(view, key=lambda peer: leader_rank(key, peer))


@dataclass
class Lobby:
    """One round's matchmaking state on this node; handlers and ``form_group`` share it.

    ``leader`` is meaningful once ``decided`` is set: None means this node leads. It can
    change once more, when a follower's leader turns out dead and this node takes over.
    """

    request: Join
    dht_key: str
    """The round's DHT key, with this member's prior state (``round_key``)."""
    may_lead: bool = True
    """False for a node nobody can dial: it never leads."""
    decided: asyncio.Event = field(default_factory=asyncio.Event)
    leader: PeerID | None = None
    knock: asyncio.Event = field(default_factory=asyncio.Event)
    """Set by every JOIN that arrives: a peer has seen a view, so re-read it now."""
    knockers: dict[PeerID, tuple[float, bool]] = field(default_factory=dict)
    """Peers that sent a JOIN for this round, with their weights and client flags: part of
    the view."""
    joiners: dict[PeerID, asyncio.Future[tuple[Kind, bytes]]] = field(default_factory=dict)
    weights: dict[PeerID, float] = field(default_factory=dict)
    clients: set[PeerID] = field(default_factory=set)
    """Joiners that asked to reduce no part."""
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    closed: bool = False
