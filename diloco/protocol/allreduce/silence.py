"""Silent senders: members of a group that send a reducer nothing (docs/design.md "Liveness").

An honest member opens its PART streams as soon as it has the GROUP, so a member that has
not even started sending a part when most of its contributors have is most likely silent:
waiting for it until the sender deadline would stall every round it joins. ``StartWatch``
notes when each member's PART stream of a reducer's own part arrives and, once a majority
of the part's contributions (the reducer's own included) has started, drops the members
that have not started by ``adaptive.start_bound`` from the part, so the round goes on
without them. With two members there is no majority without the other, and in a stage
of a staged round members start as their previous stages end, not together: there the
sender deadline applies.

A dropped member is charged an offence (``bans``: repeated ones ban it, and banned peers
are admitted to no group) once the sender deadline has passed without its stream: the
bound that drops it is tight, so an honest member late by a scheduling stall or a JOIN sent
again must not pay for it; silence for the whole sender window is what no honest member
shows. A dropped member whose stream arrives after all is late, not absent: it is served
the average like any late member, uncounted once the gather closed.
"""

from __future__ import annotations

import asyncio
import contextlib

from hivemind.p2p import PeerID

from diloco.protocol.allreduce.part_server import PartServer
from diloco.protocol.core.adaptive import start_bound
from diloco.protocol.core.group import RoundTimeouts
from diloco.protocol.trust.bans import BanList


class StartWatch:
    """Which members started sending this reducer's own part, when to stop waiting for
    the others, and whom to charge."""

    def __init__(
        self,
        server: PartServer,
        t0: float,
        timeouts: RoundTimeouts,
        bans: BanList,
    ) -> None:
        self.server, self.t0, self.timeouts, self.bans = server, t0, timeouts, bans
        self.group, self.me = server.group, server.me
        self.gather = server.deadlines.gather
        """The sender deadline (loop time): silent until then is an offence."""
        self.started: set[int] = set()
        """Members whose PART stream of this reducer's own part arrived."""
        self.dropped: set[int] = set()
        """Members dropped from the part for not having started in time."""
        self._changed = asyncio.Event()

    @property
    def silent(self) -> set[int]:
        """Dropped members that have not started (so far)."""
        return self.dropped - self.started

    def start(self, peer: PeerID) -> None:
        """A PART stream of ``peer`` for this reducer's own part arrived (``routing``: also
        after the round, until the sender deadline)."""
        if peer not in self.group.members or peer == self.me:
            return
        j = self.group.index(peer)
        self.started.add(j)
        if j in self.dropped:  # late, not absent: let the part server serve it as such
            self.server.reducer.excluded.pop(j, None)
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def _until(self, count: int, deadline: float) -> bool:
        """Wait until ``count`` other members started, or ``deadline`` (loop time); whether
        they did."""
        loop = asyncio.get_running_loop()
        while len(self.started) < count:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), remaining)
        return True

    async def drop_silent(self) -> None:
        """Drop from the part the members that have not started by the bound (see the
        module docstring), and charge at the sender deadline those still silent then.
        Runs while the part gathers; the caller cancels it once the gather is over."""
        loop = asyncio.get_running_loop()
        members = len(self.group.members)
        index = self.group.index(self.me)
        needed = members // 2  # others that, with this reducer, are a majority
        if needed >= members - 1 or not await self._until(needed, self.gather):
            return
        majority = loop.time() - self.t0
        bound = start_bound(majority, self.timeouts)
        if await self._until(members - 1, min(self.gather, self.t0 + bound)):
            return
        if loop.time() >= self.gather:
            return  # the part server's own rule
        for j in range(members):
            if j != index and j not in self.started:
                self.dropped.add(j)
                self.server.exclude(j, f"no PART within {bound:.2f} s")
        reason = (
            f"round {self.group.key}: no PART for part {index} by the sender deadline (a "
            f"majority started within {majority:.2f} s)"
        )
        loop.call_at(self.gather, self._charge, reason)

    def _charge(self, reason: str) -> None:
        """The sender deadline passed: charge the dropped members still silent."""
        for j in sorted(self.silent):
            self.bans.offend(self.group.members[j], reason)
