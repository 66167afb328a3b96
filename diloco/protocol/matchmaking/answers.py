"""The leader's side of a round's JOINs (docs/design.md "The round"): each JOIN is answered
from what this node knows of the round. A member asking again gets its GROUP again; a round
this node ended is GROUP_CLOSED, one it has not reached UNKNOWN_ROUND (its follower asks
again), one whose send step it skipped LEFT_ROUND (its follower turns to the next in line);
otherwise the JOIN waits in the lobby until this node chose its role, and gets the
GROUP, a redirect to the leader, or a refusal (wrong run, weight over the cap, another prior
or shape, the group closed)."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from hivemind.p2p import PeerID

from diloco.protocol.core.reducer import RoundKey
from diloco.protocol.matchmaking.ahead import Ahead
from diloco.protocol.runtime import streams
from diloco.protocol.wire import frames as wire
from diloco.protocol.wire.frames import Group, Join, Kind, Reject, RejectCode

logger = logging.getLogger(__name__)


class JoinAnswers(Ahead):
    """Answers the JOINs of a round; ``Matchmaker`` sets the state."""

    _formed: dict[RoundKey, tuple[frozenset[PeerID], bytes]]
    """GROUP messages this node sent as leader, kept for members that ask again."""
    _answer_wait: float
    """Seconds a JOIN may wait here for its answer (``RoundBudget.join_answer``)."""
    _forgone: dict[RoundKey, float]
    """Rounds whose send step this node skipped (``forgo``) -> when (loop time)."""

    def forgo(self, key: RoundKey) -> None:
        """This node skipped round ``key``'s send step (it caught up with the swarm's step):
        it will not be in the round. The lobby it opened ahead is dropped, and every JOIN
        for the round, waiting or to come, is told LEFT_ROUND, so that its sender turns to
        the next in line at once. Before, a node that skipped past a round it had announced
        held its peers' JOINs until that lobby closed, and they failed the round
        (docs/design.md "Across the internet")."""
        now = asyncio.get_running_loop().time()
        for old in [k for k, at in self._forgone.items() if now - at > self._answer_wait]:
            del self._forgone[old]
        self._forgone[key] = now
        if (lobby := self._lobbies.get(key)) is not None:
            self._drop_unclaimed(key, lobby, RejectCode.LEFT_ROUND)

    async def _serve_join(
        self, peer: PeerID, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """Answer one JOIN with GROUP or a refusal (``streams.stream_handler`` wraps it)."""
        reply = await asyncio.wait_for(self._answer_join(peer, reader), self._answer_wait)
        await asyncio.wait_for(streams.write_frame(writer, *reply), self.timeouts.join_timeout)

    async def _answer_join(self, peer: PeerID, reader: asyncio.StreamReader) -> tuple[Kind, bytes]:
        _, body = await streams.read_frame(reader, (Kind.JOIN,), wire.MAX_SMALL_BODY)
        request = Join.parse(body)

        def reject(code: RejectCode, reason: str = "", redirect: bytes = b"") -> tuple[Kind, bytes]:
            return Kind.REJECT, Reject(code, redirect, reason).serialize()

        if request.tag.digest != self.digest:
            return reject(RejectCode.WRONG_RUN, "different run configuration")
        key = RoundKey(request.tag.fragment, request.tag.round)
        if request.weight > self.max_weight:
            self.bans.offend(peer, f"round {key}: JOIN weight {request.weight:g} over the cap")
            return reject(RejectCode.MISMATCH, f"weight over the run's cap {self.max_weight:g}")
        if key in self._forgone:
            return reject(RejectCode.LEFT_ROUND, "this node skipped the round's send step")
        formed = self._formed.get(key)
        if formed is not None and peer in formed[0]:
            group = Group.parse(formed[1])
            if (request.numel, request.codec_id, request.return_codec_id) != (
                group.numel,
                group.codec_id,
                group.return_codec_id,
            ):
                return reject(RejectCode.MISMATCH, "fragment size or codec differs")
            return Kind.GROUP, formed[1]  # a member asking again: its first reply was lost
        lobby = self._lobbies.get(key)
        # late, if this node ended the round (``late``): it misses the round
        ended = lobby is None and self.late.came(peer, key, asyncio.get_running_loop().time())
        if lobby is None and formed is not None:  # led and closed: a late peer misses it
            return reject(RejectCode.GROUP_CLOSED, "group already formed")
        if ended:
            return reject(RejectCode.GROUP_CLOSED, "round ended")
        if lobby is None:  # not reached yet: the follower asks again (``_follow``)
            return reject(RejectCode.UNKNOWN_ROUND, f"not in round {key} yet")
        mine = lobby.request
        shape = (mine.numel, mine.codec_id, mine.return_codec_id)
        if (request.numel, request.codec_id, request.return_codec_id) != shape:
            return reject(RejectCode.MISMATCH, "fragment size or codec differs")
        if lobby.declared.get(peer) != lobby.prior:  # it declared (anew: it healed): read again
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._read_view(lobby), self.timeouts.join_timeout)
        if (prior := lobby.declared.get(peer)) != lobby.prior:
            said = "no declaration found" if prior is None else f"declared prior {prior or '-'}"
            logger.info("round %s: JOIN of %s refused: %s", key, peer, said)
            return reject(
                RejectCode.MISMATCH, f"{said}; this group's prior is {lobby.prior or '-'}"
            )
        lobby.knockers.setdefault(peer, (request.weight, request.client))
        lobby.knock.set()
        await lobby.decided.wait()
        if key in self._forgone:  # its lobby opened ahead was dropped meanwhile
            return reject(RejectCode.LEFT_ROUND, "this node skipped the round's send step")
        if lobby.leader is not None:
            return reject(RejectCode.NOT_LEADER, redirect=lobby.leader.to_bytes())
        pending = lobby.joiners.get(peer)
        if pending is not None and not pending.done():
            return await pending  # asking again while the group is still open
        if lobby.closed or peer in lobby.joiners or peer == self.p2p.peer_id:
            return reject(RejectCode.GROUP_CLOSED, "group already formed")
        reply: asyncio.Future[tuple[Kind, bytes]] = asyncio.get_running_loop().create_future()
        lobby.joiners[peer] = reply
        lobby.weights[peer] = request.weight
        if request.client:
            lobby.clients.add(peer)
        lobby.changed.set()
        return await reply
