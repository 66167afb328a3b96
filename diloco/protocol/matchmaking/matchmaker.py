"""Group formation for one fragment round ``(p, k)`` on the DHT (docs/design.md "The round").

Protocol, for every node that reaches the send step of round ``(p, k)``:

1. Declare: store ``weight`` and the *prior* (the hash of the fragment state this node starts
   the round from, ``declarations``) under DHT key ``{run_id}/frag{p}/round{k}``, subkey =
   own peer id, and open a lobby for that round (so joins can arrive from now on). A node
   that announced the round (``ahead``) did this, and read the round, before the send
   step; it then chooses its role at once from what it read.
2. Read the key at once, then (with ``target_group_size``) every ``poll`` seconds and
   whenever a JOIN knocks, or (without) at the end of ``matchmaking_window``. The view is
   the declarations of this node's prior plus the peers that already sent this node a
   JOIN, less the peers it bans (``bans``): every member applies the same mean to its own
   prior state, so only equal priors may share a group. The *leader* is the first peer of
   the view by ``leader_rank``, a hash of the round key and the peer id (self included). A
   node that sees a peer ranked before itself cannot lead: it JOINs that peer at once, and
   the JOIN waits there until that peer has chosen its role. A node that is first so far
   waits until the window ends or ``target_group_size`` peers declared (under any prior, or
   banned: such a peer has arrived, and waiting for it is useless), then leads.
   Nodes that declared they cannot be dialled (clients, ``reachability``) are in the view
   but never lead; such a node that sees no peer that may lead fails the round. A node
   left without a partner while most other peers declared one other prior fails the round
   with ``PriorDiverged`` (``others_prior``): its state has diverged, it should heal.
3. A leader waits until every peer it saw has joined, or ``join_timeout``; it then closes
   the lobby and sends the same GROUP (members sorted by peer id bytes, their weights, a
   random group id, the members whose JOIN asked to reduce no part: clients, and demoted
   nodes, ``demotion``; the leader itself reduces when nobody else would) to every joiner.
   A JOIN from a peer whose declaration shows another prior, or cannot be found, is refused
   (MISMATCH), no offence: a redirect or a slow DHT can bring an honest peer there, and a
   peer lying about its prior only sends the contribution it could send anyway.
   It keeps that GROUP until the round's matchmaking bound has passed and sends it again to
   a member that asks again (its first stream broke), so a member never misses the GROUP it
   is counted in because of one lost stream. A JOIN from a non-member after closing gets
   GROUP_CLOSED: that node misses the round (docs/design.md "The round"). A JOIN whose weight
   exceeds the run's cap (``max_weight``) is refused (MISMATCH) and is an offence: every honest node
   clamps its own weight to the cap, which is part of the run configuration, so only a peer that
   breaks the run's rules sends one, and a peer that lies about its weight is not trusted
   with a contribution either.
4. A follower sends JOIN to its leader and waits for GROUP; a GROUP that is invalid (another
   round, size or codec, without it, its weight or client flag changed, any weight over
   the cap) fails the round for it and is the leader's offence. A node asked to lead that
   is itself a follower answers NOT_LEADER with its own leader, and the follower follows
   the redirect (each peer at most once), so views that disagree at the edge of the window
   still converge on one leader.
5. A follower whose JOIN fails in transport (stream refused or cut) tries once more; if
   that fails too the leader counts as dead (as one that answers LEFT_ROUND: it skipped
   the round's send step, catching up with the swarm) and the follower reads the round once more,
   then turns to the first peer (by ``leader_rank``) of that fresh view that is still
   reachable and not a client (itself included: then it leads, waiting for every peer of
   its prior it knows declared). Its view from before may lack peers the others' hold (it
   JOINed as soon as it saw a leader): chosen from it, the round split. Every follower of
   a dead leader reads the peers that declared before it died, so they converge on the
   same new leader; a peer that still redirects to the dead leader (it has not noticed
   yet) is asked again shortly.
6. A follower whose leader keeps its JOIN stream open but answers nothing by its due time
   (``group_timeout`` after the leader must have chosen its role: once
   ``target_group_size`` peers declared, else a window after the follower chose its own)
   counts it as silent: the leader commits an offence (``bans``: repeated ones ban it) and
   the follower fails over as from a dead leader, within the matchmaking bound (which has a
   join timeout for it). An honest leader has answered by then: its last read and its wait
   for joiners take a join timeout each at most (docs/design.md "Liveness").
7. A follower waits for its GROUP until its own matchmaking bound, or longer, up to the
   widest a leader holds a JOIN, when its leader's declaration says the leader's
   matchmaking ends later (a leader on the widest window: ``late``). A leader silent past
   its due time is charged before that (step 6).

The leader's GROUP message is the agreement step: every member takes the same list from the
same bytes. Failure modes: a leader that dies after sending GROUP to some followers but not
all makes those that got it wait for the others in vain (the all-reduce then fails for all);
two leaders with disjoint views make two groups, each a valid average of its own members.
Every await has a deadline derived from ``RoundTimeouts``; nodes out of step: ``late``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import secrets
from collections.abc import Callable

from hivemind import DHT
from hivemind.p2p import PeerID

from diloco.errors import PriorDiverged, ProtocolError, RoundFailed
from diloco.protocol.core.budget import RoundBudget
from diloco.protocol.core.group import GroupInfo, RoundTimeouts
from diloco.protocol.core.reducer import RoundKey
from diloco.protocol.matchmaking.ahead import EARLIER_PROCESS
from diloco.protocol.matchmaking.answers import JoinAnswers
from diloco.protocol.matchmaking.late import LatePeers
from diloco.protocol.matchmaking.lobby import (
    Lobby,
    choose_leader,
    group_info,
    others_prior,
    round_key,
)
from diloco.protocol.records.declarations import declare_round, prior_tag
from diloco.protocol.runtime import streams
from diloco.protocol.runtime.event_loop import wait_set
from diloco.protocol.trust.bans import BanList
from diloco.protocol.trust.swarm_key import ClosedSwarm
from diloco.protocol.wire import frames as wire
from diloco.protocol.wire.frames import Group, Kind, Reject, RejectCode

logger = logging.getLogger(__name__)


_TRANSPORT_RETRIES = 1
"""Extra JOIN attempts to the same leader after a transport failure, before failing over."""
_NOT_YET_S = 0.1
"""Seconds before a JOIN goes again to a leader that has not opened the round yet."""


class Matchmaker(JoinAnswers):
    """Forms one group per fragment round; several rounds may be in matchmaking at once."""

    def __init__(
        self,
        p2p: streams.StreamTransport,
        dht: DHT,
        run_id: str,
        digest: bytes,
        timeouts: RoundTimeouts,
        bans: BanList,
        min_group_size: int = 2,
        target_group_size: int | None = None,
        max_weight: float = math.inf,
        closed: ClosedSwarm | None = None,
        departed: Callable[[], frozenset[PeerID]] = frozenset,
    ) -> None:
        if not max_weight > 0:
            raise ValueError(f"max_weight must be > 0 tokens, got {max_weight!r}")
        if min_group_size < 1:
            raise ValueError(f"min_group_size must be >= 1, got {min_group_size}")
        if target_group_size is not None and target_group_size < min_group_size:
            raise ValueError("target_group_size must be >= min_group_size")
        self.target_group_size = target_group_size
        self.live_nodes: int | None = None
        self.counted: int | None = None
        """The peers this node counts on in a round, besides itself (``target_group_size``
        before its floor; None: not told, the target above its floor stands for them):
        evidence that a round it led alone left live peers out (``late.alone``)."""
        self.p2p, self.dht, self.run_id, self.digest = p2p, dht, run_id, digest
        self.timeouts, self.min_group_size = timeouts, min_group_size
        self.bans, self.max_weight = bans, max_weight
        self.closed = closed
        """A closed swarm's proofs: declarations carry ours, views drop outsiders."""
        self.departed = departed
        self.handler_name = f"/diloco/{run_id}/join/1"
        self._lobbies: dict[RoundKey, Lobby] = {}
        self._formed: dict[RoundKey, tuple[frozenset[PeerID], bytes]] = {}
        """GROUP messages this node sent as leader, kept for members that ask again."""
        self._declared_until: dict[RoundKey, float] = {}
        self.restarted_at: float | None = None
        self._earlier_rounds: set[RoundKey] = set()
        self._noted_before: set[RoundKey] = set()
        self.late = LatePeers()
        """Peers whose JOINs came after this node's rounds ended (``late``)."""
        self._answer_wait = RoundBudget.of(timeouts).join_answer()
        self._forgone = {}

    async def start(self) -> None:
        """Register the JOIN handler on the shared P2P daemon; its bound holds with the
        widest window the round trip time may set (``RoundBudget.join_stream``)."""
        handler = streams.stream_handler(
            "JOIN",
            self._serve_join,
            timeout=RoundBudget.of(self.timeouts).join_stream(),
            reply_timeout=self.timeouts.reply_timeout,
            admit=self.bans.admit,
        )
        await self.p2p.add_binary_stream_handler(self.handler_name, handler)

    async def form_group(
        self,
        key: RoundKey,
        numel: int,
        codec_id: int,
        return_codec_id: int,
        weight: float,
        prior: str = "",
        client: bool = False,
        may_lead: bool = True,
    ) -> GroupInfo:
        """Declare, wait the window, and assemble or join the group of round ``key`` among
        the members that start it from the same ``prior`` state hash; a ``client`` asks to
        reduce no part; a node that may not lead (nobody can dial it) declares so.

        Raises:
            PriorDiverged: too few peers declared ``prior`` for a group, and most others
                declared one other prior (``others_prior``).
            RoundFailed: no group of at least ``min_group_size`` formed in time, this node
                arrived after its group had closed, or it may not lead and saw no peer that
                may.
        """
        request = self.join_request(key, numel, codec_id, return_codec_id, weight, client)
        self._forgone.pop(key, None)  # it sends after all
        if await self.earlier_process_in(key):
            raise RoundFailed(key.fragment, key.round, EARLIER_PROCESS)
        lobby = self.claim_ahead(key, request, prior)
        if lobby is None:
            if key in self._lobbies:
                raise RoundFailed(key.fragment, key.round, "this round is already in matchmaking")
            dht_key = round_key(self.run_id, key)
            lobby = Lobby(request, dht_key, prior=prior_tag(prior), may_lead=may_lead)
            self._lobbies[key] = lobby
        try:
            t = self.timeouts
            loop = asyncio.get_running_loop()
            start = loop.time()
            if lobby.ahead is not None and not lobby.ahead.done():
                await self.await_declared(lobby)
            if lobby.declared_at is None or lobby.bound + t.join_timeout < t.matchmaking:
                # Not declared ahead of the send step, or ahead on a narrower window than
                # this round's (a late JOIN came since: the widest). Its followers' due time
                # follows the bound they read; a bound that grew by less than a join timeout
                # (the round trip estimate moving) stays within their group timeout and is
                # not worth a store on the round's path.
                expiration = self.later_than_before(key, t.matchmaking + t.allreduce)
                stored = await asyncio.wait_for(
                    declare_round(
                        self.dht,
                        lobby.dht_key,
                        request.weight,
                        expiration,
                        self.closed,
                        client=not may_lead,
                        prior=prior,
                    ),
                    t.join_timeout,
                )
                if not stored:  # peers may not see it; a JOIN still reaches the leader
                    logger.debug("round %s: the DHT did not take our declaration", key)
                lobby.stored(expiration, t.matchmaking, loop.time())
            declared, declared_at = loop.time(), lobby.declared_at
            assert declared_at is not None  # stored ahead or just above
            # waiting for target_group_size peers, a window from the send step, as when
            # declaring at it: a peer that announced nothing yet may be a step behind
            waiting = self.target_group_size is not None
            since = max(declared_at, start) if waiting else declared_at
            seen, ended = await self._wait_window(lobby, since)
            view = set(seen) | {self.p2p.peer_id}
            leaders = self._may_lead(seen, lobby)
            logger.info(
                "round %s: declared in %.3fs, saw %d peers of our prior (%d may lead) "
                "after %.3fs: %s",
                key,
                declared - start,
                len(view),
                len(leaders),
                loop.time() - start,
                ended,
            )
            others = others_prior(lobby.declared, lobby.prior)
            if len(view) < self.min_group_size and others is not None:
                why = f"no partner of our prior {lobby.prior or '-'}; most start from {others}"
                raise PriorDiverged(key.fragment, key.round, why, others)
            if not leaders:
                raise RoundFailed(key.fragment, key.round, "no peer that may lead")
            leader = choose_leader(leaders, lobby.dht_key)
            if leader == self.p2p.peer_id:
                lobby.decided.set()
                group = await self._lead(key, lobby, view, t.join_timeout)
            else:
                lobby.leader = leader
                lobby.decided.set()
                bounds = (start + t.matchmaking, start + self._answer_wait)
                group = await self._follow(key, lobby, view, leaders, bounds)
            self.late.met(group.members)
            return group
        except RoundFailed as failure:
            came = lobby.arrived | lobby.declared.keys() | lobby.knockers.keys()
            failure.others_declared = len(came - {self.p2p.peer_id})
            raise
        finally:
            self.late.ended(key)
            lobby.closed = True
            lobby.decided.set()
            for reply in lobby.joiners.values():
                if not reply.done():
                    closed = Reject(RejectCode.GROUP_CLOSED, reason="round ended")
                    reply.set_result((Kind.REJECT, closed.serialize()))
            del self._lobbies[key]

    @property
    def peers_counted(self) -> int:
        """The peers this node counts on in a round besides itself: ``counted``, or when not
        told, the target above its floor."""
        if self.counted is not None:
            return self.counted
        return (self.target_group_size or 0) - self.min_group_size

    def _may_lead(self, view: dict[PeerID, tuple[float, bool]], lobby: Lobby) -> set[PeerID]:
        """The peers of ``view`` (and this node) that did not declare they cannot be dialled:
        those who may lead."""
        leaders = {peer for peer, (_, client) in view.items() if not client}
        return leaders | {self.p2p.peer_id} if lobby.may_lead else leaders

    async def _wait_window(
        self, lobby: Lobby, since: float
    ) -> tuple[dict[PeerID, tuple[float, bool]], str]:
        """The peers of the round that may share this node's group, as far as it can tell
        when it must choose a role, and why the wait ended.

        The view: the peers of its prior every read so far found (``Lobby.seen``) plus the
        peers that already sent this node a JOIN (they are in the round too). It returns
        early as soon as a peer that may lead and is ranked before this node is known (it
        cannot lead, so it JOINs that peer now, and the JOIN waits there; a node nobody can
        dial cannot lead at all), or ``wait_target`` peers declared under any prior;
        otherwise after the window, which counts from ``since`` (loop time: when this node
        declared). A lobby read before the send step (``ahead``) decides on what it read
        before it reads again.
        """
        loop = asyncio.get_running_loop()
        t = self.timeouts
        deadline = since + t.matchmaking_window
        me = self.p2p.peer_id
        target = self.wait_target(lobby)
        read = lobby.reads == 0
        delay = self.poll
        while True:
            lobby.knock.clear()
            if read:
                await asyncio.wait_for(self._read_view(lobby), t.join_timeout)
            read = True
            view = self._known(lobby)
            arrived = len(self._present(lobby) | view.keys() | {me})
            leaders = self._may_lead(view, lobby)
            if leaders and choose_leader(leaders, lobby.dht_key) != me:
                return view, "a peer of our prior ranks first to lead"
            if target is not None and arrived >= target:
                return view, f"{arrived} of {target} live nodes declared"
            remaining = deadline - loop.time()
            if remaining <= 0:
                return view, "the window ended"
            poll = delay if target is not None else remaining
            await wait_set(lobby.knock, min(poll, remaining))
            delay = min(2 * delay, self.max_poll)

    async def _lead(self, key: RoundKey, lobby: Lobby, view: set[PeerID], wait: float) -> GroupInfo:
        """Wait up to ``wait`` seconds for the peers of ``view`` to join, then send GROUP."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        expected = view - {self.p2p.peer_id}
        while not expected <= set(lobby.joiners) and (remaining := deadline - loop.time()) > 0:
            lobby.changed.clear()
            await wait_set(lobby.changed, remaining)
        lobby.closed = True
        banned = Reject(RejectCode.BANNED, reason="banned while the group formed").serialize()
        # Out too: a joiner whose JOIN stream ended (its wait timed out, its reply cancelled).
        for peer in [p for p, r in lobby.joiners.items() if self.bans.banned(p) or r.done()]:
            if not (reply := lobby.joiners.pop(peer)).done():
                reply.set_result((Kind.REJECT, banned))
        assert lobby.may_lead, "a node nobody can dial never leads"
        members = sorted([self.p2p.peer_id, *lobby.joiners], key=lambda peer: peer.to_bytes())
        weights = {**lobby.weights, self.p2p.peer_id: lobby.request.weight}
        if len(members) < self.min_group_size:
            reason = f"{len(members)} member(s) < min_group_size {self.min_group_size}"
            self.late.alone(self.peers_counted, loop.time())
            too_small = Reject(RejectCode.GROUP_TOO_SMALL, reason=reason).serialize()
            for future in lobby.joiners.values():
                future.set_result((Kind.REJECT, too_small))
            raise RoundFailed(key.fragment, key.round, f"no group: {reason}")
        request = lobby.request
        me_client = request.client and any(p not in lobby.clients for p in lobby.joiners)
        group = Group(
            request.tag,
            secrets.token_bytes(wire.GROUP_ID_BYTES),
            request.numel,
            request.codec_id,
            request.return_codec_id,
            tuple(peer.to_bytes() for peer in members),
            tuple(weights[p] for p in members),
            tuple(p in lobby.clients or (p == self.p2p.peer_id and me_client) for p in members),
        )
        message = group.serialize()
        self._formed[key] = (frozenset(members), message)
        loop.call_later(self.timeouts.matchmaking, self._formed.pop, key, None)
        for future in lobby.joiners.values():
            future.set_result((Kind.GROUP, message))
        logger.info(
            "round %s: leading a group of %d (%d clients)",
            key,
            len(members),
            len(lobby.clients) + me_client,
        )
        return group_info(key, group)

    async def _follow(
        self,
        key: RoundKey,
        lobby: Lobby,
        view: set[PeerID],
        leaders: set[PeerID],
        bounds: tuple[float, float],
    ) -> GroupInfo:
        """JOIN the leader (following redirects, retrying and failing over to the next of
        ``leaders``, the peers of ``view`` that may lead; see steps 5 and 6); give up at the
        bound of the peer it follows (loop time, ``_leader_bound``: between this node's own
        matchmaking bound and the widest, ``bounds``)."""
        loop = asyncio.get_running_loop()
        decided_at = loop.time()
        successor_due: float | None = None
        """After a failover: when the next in line must have answered (it takes over)."""
        visited: set[PeerID] = set()
        dead: set[PeerID] = set()
        failures = 0
        assert lobby.leader is not None
        target = lobby.leader
        while True:
            visited.add(target)
            deadline = self._leader_bound(lobby, target, bounds)
            if deadline <= loop.time():
                raise RoundFailed(key.fragment, key.round, "no GROUP from the leader in time")
            try:
                reply = await self._await_reply(
                    key, target, lobby, decided_at, successor_due, bounds
                )
            except asyncio.TimeoutError as exc:
                raise RoundFailed(
                    key.fragment, key.round, f"leader {target} did not answer"
                ) from exc
            except ProtocolError as exc:
                raise RoundFailed(key.fragment, key.round, f"leader {target}: {exc}") from exc
            except streams.TRANSPORT_ERRORS as exc:  # refused or cut: retry, then fail over
                failures += 1
                logger.info("round %s: JOIN to %s failed: %r", key, target, exc)
                if failures <= _TRANSPORT_RETRIES:
                    await asyncio.sleep(min(0.1, max(0.0, deadline - loop.time())))
                    continue
                reply = None
            # the leader may have declared a later bound meanwhile (``_await_reply`` reads it)
            deadline = self._leader_bound(lobby, target, bounds)
            if reply is not None and _left(reply):
                logger.info("round %s: %s skipped the round; the next in line leads", key, target)
                reply = None
            if reply is None:  # dead, silent past its due time, or left: the next leads
                dead.add(target)
                failures = 0
                # The view it followed with may predate peers that declared since (it
                # JOINed as soon as it saw a leader), and another follower's may not: the
                # successor is chosen from a fresh read, so that every follower of the
                # dead leader takes the same one, and a successor waits for those too.
                with contextlib.suppress(asyncio.TimeoutError):
                    wait = min(self.timeouts.join_timeout, deadline - loop.time())
                    await asyncio.wait_for(self._read_view(lobby), wait)
                known = self._known(lobby)
                view, leaders = view | set(known), leaders | self._may_lead(known, lobby)
                if not leaders - dead:
                    raise RoundFailed(key.fragment, key.round, "no live peer that may lead")
                target = choose_leader(leaders - dead, lobby.dht_key)
                successor_due = loop.time() + self.timeouts.group_timeout
                if target == self.p2p.peer_id:
                    logger.warning("round %s: no GROUP from the leader, leading instead", key)
                    lobby.leader = None
                    return await self._lead(key, lobby, view - dead, deadline - loop.time())
                lobby.leader = target
                continue
            kind, body = reply
            if kind == Kind.GROUP:
                return self._check_group(key, lobby.request, body, target)
            reject = Reject.parse(body)
            if reject.code == RejectCode.UNKNOWN_ROUND and deadline - loop.time() > _NOT_YET_S:
                # It declared the round and has not opened it: still training toward its
                # send step, or its lobby opened ahead was dropped (it came later than
                # announced). As with a leader that holds the JOIN, wait to the deadline.
                await asyncio.sleep(_NOT_YET_S)
                continue
            if reject.code == RejectCode.NOT_LEADER and reject.redirect:
                redirect = PeerID(reject.redirect)
                if redirect in dead:  # it has not noticed yet that its leader died: ask again
                    await asyncio.sleep(min(0.1, max(0.0, deadline - loop.time())))
                    continue
                if redirect not in visited and redirect != self.p2p.peer_id:
                    target = redirect
                    continue
            raise RoundFailed(
                key.fragment,
                key.round,
                f"leader {target} refused: {reject.code.name} {reject.reason}",
            )


def _left(reply: tuple[Kind, bytes]) -> bool:
    """Whether a leader's answer says it skipped the round's send step (LEFT_ROUND)."""
    return reply[0] == Kind.REJECT and Reject.parse(reply[1]).code == RejectCode.LEFT_ROUND
