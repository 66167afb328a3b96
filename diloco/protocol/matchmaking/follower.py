"""A matchmaker's reads of the round and its wait, as a follower, for its leader's GROUP
(docs/design.md "The round").

``Matchmaker`` (``matchmaker``, whose docstring states the whole protocol) inherits these:
they are the half of matchmaking that reads and asks, apart from the half that decides and
answers. The reads of the round's declarations (``_read_view``, ``_known``) serve every role;
the follower repeats them while it waits, to learn when its leader must have chosen its
role. Its wait (``_await_reply``) gives the leader a due time: ``group_timeout`` after the
leader must have chosen its role, once ``target_group_size`` peers declared, else a window
after this node chose its own; a leader alive yet silent past it commits an offence and the
follower fails over (steps 5 and 6 of the protocol; docs/design.md "Liveness").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Callable

from hivemind import DHT
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time

from diloco.errors import ProtocolError, RoundFailed
from diloco.protocol.core.group import GroupInfo, RoundTimeouts
from diloco.protocol.core.reducer import RoundKey
from diloco.protocol.matchmaking.lobby import Lobby, check_group
from diloco.protocol.records.declarations import read_round_expiring
from diloco.protocol.runtime import round_trips, streams
from diloco.protocol.trust.bans import BanList
from diloco.protocol.trust.swarm_key import ClosedSwarm
from diloco.protocol.wire import frames as wire
from diloco.protocol.wire.frames import Join, Kind

logger = logging.getLogger(__name__)

OPEN_EVERY = 4
"""One round in this many waits for every live record's author (``Follower.wait_target``)."""


class Follower:
    """The round reads and the follower's JOIN and wait; ``Matchmaker`` sets the state."""

    p2p: streams.StreamTransport
    dht: DHT
    timeouts: RoundTimeouts
    bans: BanList
    target_group_size: int | None
    live_nodes: int | None
    """The live node records this node read, every author's (None: ``target_group_size``).
    A leader waits for as many declarations as its own evidence counts (node/evidence/claims.py
    ``group_target``), which can exceed this node's count, or in an open round for every
    record's author (``wait_target``); no honest leader counts more than every record, so
    only once that many declared must it have chosen its role."""
    max_weight: float
    closed: ClosedSwarm | None
    handler_name: str
    departed: Callable[[], frozenset[PeerID]]
    """The peers whose record says they left the run, as last read: their declarations
    for rounds ahead outlive them, and no JOIN follows."""

    @property
    def poll(self) -> float:
        """Seconds between reads of the round key while waiting for ``target_group_size``."""
        return max(0.02, self.timeouts.matchmaking_window / 40)

    @property
    def max_poll(self) -> float:
        """The most seconds between two reads of the round key while waiting for
        ``target_group_size``: the wait doubles from ``poll`` up to it. Peers in step
        declare within the first polls; each read costs this node, its DHT process and
        the peers it asks CPU: half of a lone node's CPU samples were reads as it waited."""
        return max(self.poll, self.timeouts.matchmaking_window / 4)

    def _known(self, lobby: Lobby) -> dict[PeerID, tuple[float, bool]]:
        """The peers of this node's prior known so far: every read's (``Lobby.seen``) and
        those that sent a JOIN, with weights and client flags, less the banned and those
        whose weight exceeds the cap. A peer that left counts only by a JOIN (it may be
        back, under the same identity)."""
        gone = self.departed()
        view = {peer: seen for peer, seen in lobby.seen.items() if peer not in gone}
        for peer, joined in lobby.knockers.items():  # a declaration says more than a JOIN
            view.setdefault(peer, joined)
        return {
            peer: (w, client)
            for peer, (w, client) in view.items()
            if w <= self.max_weight and not self.bans.banned(peer)
        }

    async def _read_view(self, lobby: Lobby) -> None:
        """Read the round's declarations into ``lobby``: every prior declared into
        ``declared``, the peers of this node's prior (weights and client flags) into
        ``seen``, less the banned and those whose weight exceeds the cap (their JOIN would
        be refused). Invalid declarations are logged and skipped (declarations are signed: a
        peer can declare only itself)."""
        records = await read_round_expiring(self.dht, lobby.dht_key, self.closed)
        declarations = {peer: declaration for peer, (declaration, _) in records.items()}
        lobby.reads += 1
        lobby.arrived.update(declarations)
        usable = {
            peer: d
            for peer, d in declarations.items()
            if d.weight <= self.max_weight and not self.bans.banned(peer)
        }
        lobby.declared.update((peer, d.prior) for peer, d in usable.items())
        lobby.expirations.update((peer, records[peer][1]) for peer in usable)
        lobby.seen.update(
            (p, (d.weight, d.client)) for p, d in usable.items() if d.prior == lobby.prior
        )

    def wait_target(self, lobby: Lobby) -> int | None:
        """How many declarations end this node's wait as a leader (None: only the window).

        ``target_group_size``, the nodes it saw work; but in one round of every
        ``OPEN_EVERY`` (by fragment plus round, the same rounds on every node) every live
        record's author (``live_nodes``): a newcomer nobody has worked with yet arrives
        within the window in such a round and is counted in it, from then on a witnessed
        worker. Paper keys can stretch those rounds alone to the window (docs/design.md
        "Evidence")."""
        if self.target_group_size is None:
            return None
        tag = lobby.request.tag
        if self.live_nodes is not None and (tag.fragment + tag.round) % OPEN_EVERY == 0:
            return max(self.target_group_size, self.live_nodes)
        return self.target_group_size

    def _present(self, lobby: Lobby) -> set[PeerID]:
        """The peers that declared the round (any prior) or sent a JOIN, less those that
        left the run and sent no JOIN."""
        return (lobby.arrived | lobby.declared.keys()) - (self.departed() - lobby.knockers.keys())

    def _all_declared(self, lobby: Lobby) -> bool:
        """Whether ``target_group_size`` peers, and ``live_nodes`` if more, declared the
        round (any prior), as far as this node has read: the leader need wait no longer."""
        if self.target_group_size is None:
            return False
        known = self._present(lobby) | self._known(lobby).keys()
        known.add(self.p2p.peer_id)
        return len(known) >= max(self.target_group_size, self.live_nodes or 0)

    async def _await_reply(
        self,
        key: RoundKey,
        target: PeerID,
        lobby: Lobby,
        decided_at: float,
        successor_due: float | None,
        bounds: tuple[float, float],
    ) -> tuple[Kind, bytes] | None:
        """``target``'s answer to this node's JOIN, or None when it kept the stream open
        and answered nothing by its due time: then it commits an offence (step 6).

        Its due time is ``group_timeout`` after it must have chosen its role: once
        ``target_group_size`` peers declared (the round is read again until they have, the
        wait between reads doubling from ``poll`` to ``max_poll``, as in the window), else a
        window after this node chose its own (the leader declared before this node read it,
        so its window ends by then); a successor's is ``successor_due``.

        Raises:
            asyncio.TimeoutError: the bound it waits for ``target`` by passed first
                (``_leader_bound`` of ``bounds``; it follows every read of the leader's
                declaration, which it makes again if its window widened at its send
                step).
            ProtocolError, TRANSPORT_ERRORS: as ``_call_join``.
        """
        loop = asyncio.get_running_loop()
        t = self.timeouts
        ready: float | None = None
        """When this node saw ``target_group_size`` peers declared."""
        delay = self.poll
        call = asyncio.ensure_future(self._call_join(target, lobby.request))
        try:
            while True:
                if call.done():
                    return call.result()
                now = loop.time()
                if ready is None and self._all_declared(lobby):
                    ready = now
                polling = ready is None and successor_due is None
                if successor_due is not None:
                    due = successor_due
                else:
                    chose = decided_at + t.matchmaking_window if ready is None else ready
                    due = max(chose, self._send_step_by(lobby, target)) + t.group_timeout
                deadline = self._leader_bound(lobby, target, bounds)
                if now >= deadline:
                    raise asyncio.TimeoutError
                if now >= due:
                    why = f"round {key}: no answer to a JOIN by its due time"
                    self.bans.offend(target, why, silence=True)
                    logger.warning("round %s: %s is silent, the next in line leads", key, target)
                    return None
                wake = min(due, deadline)
                if polling and self.target_group_size is not None:
                    wake = min(wake, now + delay)
                await asyncio.wait({call}, timeout=wake - now)
                if polling and not call.done() and self.target_group_size is not None:
                    delay = min(2 * delay, self.max_poll)
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self._read_view(lobby), t.join_timeout)
        finally:
            call.cancel()

    def _declared_bound(self, lobby: Lobby, leader: PeerID) -> float | None:
        """When ``leader`` said its matchmaking ends at the latest (loop time; None: no
        declaration read): its declaration expires a matchmaking and an all-reduce after
        its send step (or after the send step it announced, ahead). An honest leader has
        sent its GROUP a join timeout before that: its wait for joiners ends by then."""
        expiration = lobby.expirations.get(leader)
        if expiration is None:
            return None
        remaining = expiration - self.timeouts.allreduce - float(get_dht_time())
        return asyncio.get_running_loop().time() + remaining

    def _leader_bound(self, lobby: Lobby, leader: PeerID, bounds: tuple[float, float]) -> float:
        """Until when this node waits for ``leader``'s GROUP (loop time): its own matchmaking
        bound, or the end of the matchmaking the leader declared (as last read into
        ``lobby``) and a join timeout for the last frames if later, up to the widest a JOIN
        waits at a leader (``bounds``: own, widest).

        A leader out of step (a late JOIN: the widest window) chooses its group after its
        in-step followers' own bounds, and a follower that left then was counted in a group
        it was not in: every member's part for it went missing (docs/design.md "The
        round"). A leader silent past its due time is charged and left before that
        (``_await_reply``); one that declares a send step far ahead and stays silent keeps
        its followers up to the widest bound, uncharged."""
        own, widest = bounds
        declared = self._declared_bound(lobby, leader)
        if declared is None:
            return own
        return max(own, min(declared + self.timeouts.join_timeout, widest))

    def _send_step_by(self, lobby: Lobby, peer: PeerID) -> float:
        """When ``peer`` said it would have reached its send step (loop time): its
        declaration's expiration less the round's bounds, which a node declaring ahead of
        its send step extends by its lead (``ahead``), plus a window to choose its role. An
        honest leader that announced the round ahead and has not reached the send step yet
        is not silent before then; a leader lying about it costs its followers no more than
        the bound they wait for it (``_leader_bound``: the widest at most; their deadline
        ends the wait without failover), as one refusing their JOINs does. Without a
        declaration read, it said nothing: -inf."""
        declared = self._declared_bound(lobby, peer)
        if declared is None:
            return -math.inf
        t = self.timeouts
        return declared - t.matchmaking + t.matchmaking_window

    @round_trips.exchange("join")
    async def _call_join(self, leader: PeerID, request: Join) -> tuple[Kind, bytes]:
        _, reader, writer = await asyncio.wait_for(
            self.p2p.call_binary_stream_handler(leader, self.handler_name),
            self.timeouts.connect_timeout,
        )
        try:
            await streams.write_frame(writer, Kind.JOIN, request.serialize())
            kind, body = await streams.read_frame(reader, (Kind.GROUP,), wire.MAX_SMALL_BODY)
            return kind, bytes(body)
        finally:
            writer.close()

    def _check_group(self, key: RoundKey, request: Join, body: bytes, leader: PeerID) -> GroupInfo:
        """The GROUP ``leader`` sent, if valid; an invalid one is the leader's offence."""
        try:
            info = check_group(key, request, body, self.p2p.peer_id, self.max_weight)
        except (ProtocolError, ValueError) as exc:
            self.bans.offend(leader, f"round {key}: invalid GROUP: {exc}")
            raise RoundFailed(key.fragment, key.round, f"invalid GROUP: {exc}") from exc
        logger.info("round %s: joined a group of %d", key, len(info.members))
        return info
