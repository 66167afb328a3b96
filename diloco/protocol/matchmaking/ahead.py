"""Matchmaking started before the send step (docs/design.md "Across the internet").

Declaring a round on the DHT takes about 2 round trips and reading who else declared one
more: across an ocean that is most of a round. Neither needs the outer gradient, only the
fragment state the round starts from (its *prior*) and, roughly, the weight: a node knows
both as soon as the fragment's previous round was applied, up to ``H - tau`` steps before
it sends again. ``open_ahead`` then opens the round's lobby (JOINs that come early wait
there, as they would for a node still in its window), declares, and reads the round every
``poll`` until ``target_group_size`` peers declared or the send step comes. At the send
step ``form_group`` claims the lobby and, with a view already read, chooses its role at
once: a follower's critical path is JOIN -> GROUP, then the all-reduce.

What the early declaration says is what one made at the send step would: signed, with the
prior (which decides who may share a group). Its weight is only an estimate: the GROUP
carries the weight of each member's JOIN, sent at the send step, and a declaration's
weight only screens out peers over the cap, which an estimate clamped to the cap passes
as the real one does. A lobby whose prior no longer holds at the send step (the node healed
meanwhile), or whose declaration would expire before the round's end, is dropped, and the
round declares afresh. The DHT keeps, per peer, the declaration with the latest
expiration, so every declaration of a round expires after every one this node sent for it
before, stored or not (``later_than_before``: a store that timed out here may still land
and would hide the new prior from the round's leader). A lobby never claimed (the node
stopped, or gave the round up) is dropped when its round could no longer form.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable

from hivemind.utils import get_dht_time

from diloco.protocol.core.reducer import RoundKey
from diloco.protocol.matchmaking.follower import Follower
from diloco.protocol.matchmaking.late import LatePeers
from diloco.protocol.matchmaking.lobby import Lobby, round_key
from diloco.protocol.records.declarations import declare_round, prior_tag, read_round_expiring
from diloco.protocol.runtime import round_trips
from diloco.protocol.trust.envelopes import MAX_RECORD_TTL
from diloco.protocol.trust.swarm_key import ClosedSwarm
from diloco.protocol.wire.frames import Join, Kind, Reject, RejectCode, RoundTag

logger = logging.getLogger(__name__)

AHEAD_POLL_S = 0.25
"""Fewest seconds between two reads of a round before its send step (nobody waits on them);
the wait doubles up to a matchmaking window (``_read_ahead``)."""
EARLIER_PROCESS = "this node's previous process was in this round"
_REASONS = {
    RejectCode.GROUP_CLOSED: "round ended",
    RejectCode.LEFT_ROUND: "this node skipped the round's send step",
}


class Ahead(Follower):
    """Opens lobbies before the send step; ``Matchmaker`` claims them at it."""

    run_id: str
    digest: bytes
    closed: ClosedSwarm | None
    _lobbies: dict[RoundKey, Lobby]
    late: LatePeers
    _declared_until: dict[RoundKey, float]
    """Round -> the latest expiration this node sent a declaration of it with."""
    restarted_at: float | None
    """DHT time this process started at, if its identity was used before (a node killed and
    restarted with the same identity: ``earlier_process_in``); None: a fresh identity."""
    _earlier_rounds: set[RoundKey]
    """Rounds that this node's previous process reached (``earlier_process_in``)."""
    _noted_before: set[RoundKey]
    """Rounds that this node's previous process noted it reached (``reached_before``)."""

    def reached_before(self, keys: Iterable[RoundKey]) -> None:
        """Rounds this node's previous process reached the send step of, by its own notes
        (the node's ``diloco.node.training.sent_rounds``): ``earlier_process_in`` sits each
        out, whatever its old declaration says. A declaration announced ahead expires up to
        twice its lead after the send step, so a round the old process reached just before
        it died looked like one it only announced (docs/design.md "Healing and joining")."""
        self._noted_before.update(keys)

    async def earlier_process_in(self, key: RoundKey) -> bool:
        """Whether this node's previous process reached round ``key``'s send step, read
        before this process first declares it (its own declaration would replace the old).

        A node killed after it joined a round and restarted from an older checkpoint with
        the same identity reaches that round again. Its old process may have formed a group
        for it (that group completed with the parts it sent); joining another group would
        make two groups of one round from one prior, and the peers would end with two
        states. So it sits the round out, as a node that failed it, and heals its fragment
        from the peers (docs/design.md "Healing and joining"). A round the old process only
        announced ahead, due after this process started (it died first), never had its
        parts: this process takes it as usual. Declarations live at most
        ``MAX_RECORD_TTL`` seconds, so after that nothing is read."""
        if key in self._earlier_rounds:
            return True
        if key in self._noted_before:
            self._noted_before.discard(key)
            return self._sit_out(key, "by its notes")
        started = self.restarted_at
        if started is None or key in self._declared_until:
            return False
        if get_dht_time() > started + MAX_RECORD_TTL:
            return False
        try:
            view = await asyncio.wait_for(
                read_round_expiring(self.dht, round_key(self.run_id, key), self.closed),
                self.timeouts.join_timeout,
            )
        except (asyncio.TimeoutError, OSError, RuntimeError) as exc:
            logger.debug("round %s: reading for an earlier process failed: %r", key, exc)
            return False
        if (old := view.get(self.p2p.peer_id)) is None:
            return False
        t = self.timeouts
        self._declared_until[key] = old[1]  # ours must replace it (``later_than_before``)
        due = old[1] - (t.matchmaking + t.allreduce)  # when it would reach its send step
        if due > started + t.matchmaking_window:
            return False
        return self._sit_out(key, "by its declaration")

    def _sit_out(self, key: RoundKey, evidence: str) -> bool:
        logger.warning(
            "round %s: this node's previous process was in it (%s): healing instead", key, evidence
        )
        self._earlier_rounds.add(key)
        self.late.ended(key)  # JOINs that follow its old declaration are told GROUP_CLOSED
        return True

    def later_than_before(self, key: RoundKey, seconds: float) -> float:
        """The expiration of a new declaration of round ``key``: ``seconds`` from now, or
        later than every one sent for the round before, which it must replace."""
        now = float(get_dht_time())
        for old in [k for k, until in self._declared_until.items() if until < now]:
            del self._declared_until[old]
        expiration = max(now + seconds, self._declared_until.get(key, 0.0) + 1e-3)
        self._declared_until[key] = expiration
        return expiration

    def join_request(
        self,
        key: RoundKey,
        numel: int,
        codec_id: int,
        return_codec_id: int,
        weight: float,
        client: bool,
    ) -> Join:
        """This node's JOIN for round ``key``, its weight clamped to the run's cap."""
        tag = RoundTag(self.digest, key.fragment, key.round)
        request = Join(tag, numel, codec_id, return_codec_id, min(weight, self.max_weight), client)
        request.check()
        return request

    def open_ahead(
        self,
        key: RoundKey,
        request: Join,
        prior: str,
        may_lead: bool,
        lead: float,
    ) -> None:
        """Open round ``key``'s lobby now, about ``lead`` seconds before its send step,
        declare ``prior`` and read the round in the background. Nothing if the round is
        already open with that prior or at its send step; a lobby opened ahead with another
        prior (the node healed since) is dropped, and the new declaration replaces the old."""
        if (opened := self._lobbies.get(key)) is not None:
            if opened.ahead is None or opened.claimed or opened.prior == prior_tag(prior):
                return
            self._drop_unclaimed(key, opened)
        lobby = Lobby(
            request, round_key(self.run_id, key), prior=prior_tag(prior), may_lead=may_lead
        )
        self._lobbies[key] = lobby
        lobby.ahead = asyncio.ensure_future(self._declare_ahead(key, lobby, prior, lead))
        t = self.timeouts
        asyncio.get_running_loop().call_later(
            lead + t.matchmaking, self._drop_unclaimed, key, lobby
        )

    async def _declare_ahead(self, key: RoundKey, lobby: Lobby, prior: str, lead: float) -> None:
        """Declare, then read the round in another task (``_read_ahead``)."""
        if await self.earlier_process_in(key):
            self._drop_unclaimed(key, lobby)  # JOINs waiting here get GROUP_CLOSED
            return
        t = self.timeouts
        loop = asyncio.get_running_loop()
        expiration = self.later_than_before(key, lead + t.matchmaking + t.allreduce)
        try:
            stored = await asyncio.wait_for(
                declare_round(
                    self.dht,
                    lobby.dht_key,
                    lobby.request.weight,
                    expiration,
                    self.closed,
                    client=not lobby.may_lead,
                    prior=prior,
                ),
                t.join_timeout,
            )
        except (asyncio.TimeoutError, OSError, RuntimeError) as exc:
            # the round declares at its send step
            logger.debug("round %s: declaring ahead failed: %r", lobby.dht_key, exc)
            return
        if not stored:  # the round declares at its send step
            logger.debug("round %s: the DHT did not take the declaration ahead", key)
            return
        lobby.stored(expiration, t.matchmaking, loop.time())
        until = loop.time() + lead + t.matchmaking_window
        lobby.reading = asyncio.ensure_future(self._read_ahead(lobby, until))

    async def _read_ahead(self, lobby: Lobby, until: float) -> None:
        """Read the round until it is claimed or dropped, ``target_group_size`` peers
        declared this node's prior, or ``until`` (loop time): a peer of another prior may
        heal and declare again.

        The wait between two reads doubles from ``AHEAD_POLL_S`` up to a matchmaking window.
        Peers in step declare at about the same time, caught by the first reads; one that
        never declares (gone, or a key that never works) was read for every quarter second
        of the lead, up to ``H - tau`` steps, by every node, and each read is answered by
        every peer. A view up to a window old at the send step costs at most the window's
        first poll: what lets a node decide at once (a peer ranked first is known, or all
        declared) stays true, and otherwise it reads again after ``poll``."""
        loop = asyncio.get_running_loop()
        delay = max(self.poll, AHEAD_POLL_S)
        longest = max(delay, self.timeouts.matchmaking_window)
        try:
            while not (lobby.claimed or lobby.closed) and loop.time() < until:
                await asyncio.wait_for(self._read_view(lobby), self.timeouts.join_timeout)
                if self._all_declared(lobby) and set(lobby.declared.values()) <= {lobby.prior}:
                    return  # all here, and none that may yet heal into this prior
                await asyncio.sleep(delay)
                delay = min(2 * delay, longest)
        except (asyncio.TimeoutError, OSError, RuntimeError) as exc:
            # the round reads again at its send step
            logger.debug("round %s: reading ahead failed: %r", lobby.dht_key, exc)

    def claim_ahead(self, key: RoundKey, request: Join, prior: str) -> Lobby | None:
        """The lobby ``open_ahead`` opened for round ``key``, taken over by ``form_group``
        with this node's actual JOIN, or None (the lobby dropped) if there is none, or if it
        declared another prior or size, or its declaration would expire before the round
        could end."""
        lobby = self._lobbies.get(key)
        if lobby is None or lobby.ahead is None or lobby.claimed:
            return None
        t = self.timeouts
        usable = (
            lobby.prior == prior_tag(prior)
            and lobby.request.numel == request.numel
            and lobby.request.client == request.client
            and (lobby.expiration == 0 or lobby.expiration > get_dht_time() + t.matchmaking)
        )
        if not usable:
            logger.info("round %s: the declaration made ahead no longer holds", key)
            self._drop_unclaimed(key, lobby)
            return None
        lobby.claimed = True
        lobby.request = request
        return lobby

    @round_trips.exchange("declare")
    async def await_declared(self, lobby: Lobby) -> None:
        """Wait for a declaration made ahead that is still being stored (the send step came
        first); it is on the round's path then, and counted as such."""
        assert lobby.ahead is not None
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(lobby.ahead), self.timeouts.join_timeout)

    def _drop_unclaimed(
        self, key: RoundKey, lobby: Lobby, code: RejectCode = RejectCode.GROUP_CLOSED
    ) -> None:
        """Close a lobby opened ahead that ``form_group`` did not take: JOINs waiting
        there get ``code`` (GROUP_CLOSED: the round ended here)."""
        if lobby.claimed or self._lobbies.get(key) is not lobby:
            return
        del self._lobbies[key]
        for task in (lobby.ahead, lobby.reading):
            if task is not None:
                task.cancel()
        lobby.closed = True
        lobby.decided.set()
        for reply in lobby.joiners.values():
            if not reply.done():
                closed = Reject(code, reason=_REASONS[code])
                reply.set_result((Kind.REJECT, closed.serialize()))
