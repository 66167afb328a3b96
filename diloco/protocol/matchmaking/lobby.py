"""Where a fragment round meets: its DHT key, who leads it, whether this node's state is out
of line with the others', the GROUP it gets, and this node's lobby for it (``matchmaking``
runs the protocol over these)."""

from __future__ import annotations

import asyncio
import hashlib
from collections import Counter
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from hivemind.p2p import PeerID

from diloco.errors import ProtocolError
from diloco.protocol.core.group import GroupInfo
from diloco.protocol.core.reducer import RoundKey
from diloco.protocol.wire.frames import Group, Join, Kind


def round_key(run_id: str, key: RoundKey) -> str:
    """The DHT key nodes declare under for round ``key`` (docs/design.md "The round").

    One key per round, whatever state a member starts it from: each declaration carries
    its member's prior state (``declarations``), so that every node sees every live
    member arrive, and groups form among equal priors only (``Matchmaker``).
    """
    return f"{run_id}/frag{key.fragment}/round{key.round}"


def others_prior(priors: Mapping[PeerID, str], mine: str) -> str | None:
    """The prior state most other peers of a round start from, when this node (prior
    ``mine``) found no partner: the one prior other than ``mine`` held by at least two peers
    and by a strict majority of the peers that declared another prior.

    Every member applies the same mean to its own prior state, so a node whose prior no
    peer shares has most likely missed a round the others applied: it heals now rather
    than at its next check. Two peers at least, so that one liar declaring a made-up prior
    cannot send a node healing every round (healing adopts only vouched states anyway);
    a majority, so that a split without a clear side leaves the decision to healing's
    usual checks.
    """
    counts = Counter(prior for prior in priors.values() if prior != mine)
    if not counts:
        return None
    (prior, count), *_ = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    return prior if count >= 2 and 2 * count > counts.total() else None


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


def group_info(key: RoundKey, group: Group) -> GroupInfo:
    """The ``GroupInfo`` of a GROUP message for round ``key``."""
    return GroupInfo(
        key,
        group.group_id,
        tuple(PeerID(m) for m in group.members),
        group.weights,
        group.numel,
        group.codec_id,
        group.return_codec_id,
        group.clients,
    )


def check_group(
    key: RoundKey, request: Join, body: bytes, me: PeerID, max_weight: float
) -> GroupInfo:
    """The GROUP ``body`` a leader sent in answer to ``request`` (this node's JOIN).

    Raises:
        ProtocolError, ValueError: malformed, for another round, size or codec, without
            ``me``, with my weight or client flag changed, or with a weight over the cap.
    """
    group = Group.parse(body)
    if group.tag != request.tag:
        raise ProtocolError("GROUP for another round")
    if (group.numel, group.codec_id, group.return_codec_id) != (
        request.numel,
        request.codec_id,
        request.return_codec_id,
    ):
        raise ProtocolError("GROUP with another size or codec")
    info = group_info(key, group)
    if me not in info.members:
        raise ProtocolError("GROUP without me")
    if info.weights[info.index(me)] != request.weight:
        raise ProtocolError("GROUP with my weight changed")
    if info.is_client(info.index(me)) != request.client:
        raise ProtocolError("GROUP with my client flag changed")
    if max(info.weights) > max_weight:
        raise ProtocolError(f"GROUP with a weight over the cap {max_weight:g}")
    return info


@dataclass
class Lobby:
    """One round's matchmaking state on this node; handlers and ``form_group`` share it.

    ``leader`` is meaningful once ``decided`` is set: None means this node leads. It can
    change once more, when a follower's leader turns out dead or silent and this node takes
    over (``matchmaker`` steps 5 and 6).
    """

    request: Join
    dht_key: str
    """The round's DHT key (``round_key``)."""
    prior: str = ""
    """The prior state this member declared (``declarations.prior_tag``): only peers that
    declared the same share its group."""
    arrived: set[PeerID] = field(default_factory=set)
    """Every peer whose declaration of the round was read, banned ones and those over the
    cap included: they count toward ``target_group_size`` (waiting for them is useless)."""
    declared: dict[PeerID, str] = field(default_factory=dict)
    """Every peer of the round's declarations read so far (bans and the cap aside), with
    the prior it declared."""
    seen: dict[PeerID, tuple[float, bool]] = field(default_factory=dict)
    """The peers of ``declared`` with this node's prior, with their weights and client
    flags: every read adds to it, since one read may miss a record another found (it
    started before the record landed, as the window's read beside a JOIN's, or it asked
    another replica), and a leader must wait for every peer it knew had declared."""
    expirations: dict[PeerID, float] = field(default_factory=dict)
    """When each peer's declaration read expires (DHT time): how long it said it may take
    to reach its send step (``Follower._await_reply``)."""
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
    reads: int = 0
    """Reads of the round's declarations into this lobby so far."""
    declared_at: float | None = None
    """Loop time this node's declaration was stored: its window counts from then."""
    expiration: float = 0.0
    """DHT time this node's declaration of the round expires (0: not stored yet)."""
    bound: float = 0.0
    """The matchmaking bound (seconds) that declaration said this node may take: its
    followers' due time follows it (``Follower._send_step_by``)."""
    ahead: asyncio.Task[None] | None = None
    """The declaration stored before the send step (``ahead``); None: opened at it."""
    reading: asyncio.Task[None] | None = None
    """The reads of the round before its send step (``ahead``)."""
    claimed: bool = False
    """Whether the send step came and ``form_group`` took this lobby over."""

    def stored(self, expiration: float, bound: float, at: float) -> None:
        """This node's declaration of the round, expiring at ``expiration`` and saying its
        matchmaking takes up to ``bound`` seconds, was stored at loop time ``at``."""
        self.expiration, self.bound, self.declared_at = expiration, bound, at
