"""Silent senders: members of a group that send a reducer nothing (docs/design.md "Liveness").

An honest member opens its PART streams as soon as it has the GROUP, before it reduces its
own part, so a member whose averaged part already came back to this reducer (it runs the
round, it reduced its part from the others' streams) while its own stream of this
reducer's part has not even arrived is silent: waiting for it until the sender deadline
would stall every round it joins. ``StartWatch`` notes when each member's PART stream of a
reducer's own part arrives and when each member's averaged part came back (``serving``),
and drops from the part the members that have not started:

- *on evidence*: a member seen serving its part, once as long again has passed as the
  all-reduce took until then, at least ``EVIDENCE_FLOOR_S``, and at least ``OPEN_FACTOR``
  times the longest a stream this member opened in this round took to open (its own
  stream was opened before it reduced, but it may have started after this reducer, and a
  stream takes that long to arrive).
  Both are measured in this very round, so the bound follows loaded cores and long links
  alike; it applies in every all-reduce, a stage of a staged round and a group of two
  included;
- *by time* (``timed``), for a member that gives no such evidence: once a majority of
  the part's contributions (the reducer's own included) has started, by
  ``adaptive.start_bound``. Not with two members (no majority without the other), nor in a
  stage of a staged round (members start it as their previous stages end, not together):
  there the sender deadline applies.

A dropped member is charged an offence (``bans``: repeated ones ban it, and banned peers
are admitted to no group) once the sender deadline has passed without its stream: the
bounds that drop it are tight, so an honest member late by a scheduling stall or a stream
opened again must not pay for it; silence for the whole sender window is what no honest
member shows. A dropped member whose stream arrives after all is late, not absent: it is
served the average like any late member, uncounted once the gather closed.
"""

from __future__ import annotations

import asyncio

from hivemind.p2p import PeerID

from diloco.protocol.allreduce.clock import Clock
from diloco.protocol.allreduce.part_server import PartServer
from diloco.protocol.core.adaptive import start_bound
from diloco.protocol.core.group import RoundTimeouts
from diloco.protocol.runtime.event_loop import wait_set
from diloco.protocol.trust.bans import BanList

OPEN_FACTOR = 4.0
"""A member seen serving its part is waited for at least this many times the longest
stream open of the round here: its stream, opened when it started, may still be on its
way."""
EVIDENCE_FLOOR_S = 0.5
"""And at least this many seconds: on loaded cores an honest member's stream open can be
scheduled well after it served its part (12 peers on 2 cores: an honest member dropped
0.07 s after it served, in a round of 0.13 s)."""


class StartWatch:
    """Which members started sending this reducer's own part, when to stop waiting for
    the others, and whom to charge."""

    def __init__(
        self,
        server: PartServer,
        t0: float,
        timeouts: RoundTimeouts,
        bans: BanList,
        clock: Clock | None = None,
    ) -> None:
        self.server, self.t0, self.timeouts, self.bans = server, t0, timeouts, bans
        self.clock = clock
        """What charges at the sender deadline run on; None: the running event loop."""
        self.group, self.me = server.group, server.me
        self.gather = server.deadlines.gather
        """The sender deadline (loop time): silent until then is an offence."""
        self.started: set[int] = set()
        """Members whose PART stream of this reducer's own part arrived."""
        self.served: dict[int, float] = {}
        """Members whose averaged part came back here, and when (loop time)."""
        self.longest_open = 0.0
        """Seconds the slowest stream this member opened in the round took to open."""
        self.dropped: set[int] = set()
        """Members dropped from the part for not having started in time."""
        self._why: dict[int, str] = {}
        """Why each dropped member was, for its offence."""
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
        self._notify()

    def serving(self, j: int) -> None:
        """Member ``j``'s first averaged chunk of its own part came back here, valid: it
        runs this round and has reduced from the others' streams (``AllReduceRunner``)."""
        if j not in self.served:
            self.served[j] = asyncio.get_running_loop().time()
            self._notify()

    def opened(self, seconds: float) -> None:
        """A stream this member opened in the round took ``seconds`` to open."""
        if seconds > self.longest_open:
            self.longest_open = seconds
            self._notify()

    def _notify(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def drop_silent(self, timed: bool) -> None:
        """Drop from the part the members that have not started by their bound (see the
        module docstring; the bound by time only with ``timed``), and charge at the sender
        deadline those still silent then. Runs while the part gathers; the caller cancels
        it once the gather is over."""
        loop = asyncio.get_running_loop()
        index = self.group.index(self.me)
        others = [j for j in range(len(self.group.members)) if j != index]
        needed = len(self.group.members) // 2  # others that, with this reducer, are a majority
        timed = timed and needed < len(others)
        majority: float | None = None  # seconds the majority took to start, once it did
        while loop.time() < self.gather:
            if timed and majority is None and len(self.started) >= needed:
                majority = loop.time() - self.t0
            waiting = [j for j in others if j not in self.started and j not in self.dropped]
            if not waiting:
                return
            now = loop.time()
            due = {j: self._due(j, majority) for j in waiting}
            for j, (when, why) in due.items():
                if when <= now:
                    self._drop(j, why)
            upcoming = [when for when, _ in due.values() if when > now]
            changed = self._changed
            await wait_set(changed, min([self.gather, *upcoming]) - now)

    def _due(self, j: int, majority: float | None) -> tuple[float, str]:
        """When member ``j``, not started, is dropped (loop time; the sender deadline when
        no bound applies yet), and the evidence that makes its silence an offence."""
        when, why = self.gather, ""
        if majority is not None:
            bound = start_bound(majority, self.timeouts)
            when, why = self.t0 + bound, f"a majority started within {majority:.2f} s"
        served = self.served.get(j)
        if served is not None:
            wait = max(served - self.t0, OPEN_FACTOR * self.longest_open, EVIDENCE_FLOOR_S)
            by_evidence = served + wait
            if by_evidence < when:
                when = by_evidence
                why = f"it served its own part at {served - self.t0:.2f} s"
        return when, why

    def _drop(self, j: int, why: str) -> None:
        """Drop member ``j`` from the part; charge it at the sender deadline if still silent."""
        loop = asyncio.get_running_loop()
        self.dropped.add(j)
        self._why[j] = why
        self.server.exclude(j, f"no PART within {loop.time() - self.t0:.2f} s ({why})")
        (loop if self.clock is None else self.clock).call_at(self.gather, self._charge, j)

    def _charge(self, j: int) -> None:
        """The sender deadline passed: charge member ``j`` if it is still silent."""
        if j in self.silent:
            index = self.group.index(self.me)
            reason = (
                f"round {self.group.key}: no PART for part {index} by the sender deadline "
                f"({self._why[j]})"
            )
            self.bans.offend(self.group.members[j], reason, silence=True)
