"""Every deadline of one round, computed in one place (docs/design.md "The round"). Pure.

``RoundBudget`` holds a round's three sets of timeouts: the run's (``configured``), those
of its matchmaking (the window and the joins stretched to the measured round trip,
``adaptive.rtt_timeouts``) and those of its all-reduce (the part deadlines adapted to recent
transfers, ``adaptive.adapted_timeouts``). From them it computes what anybody waits for:
the round's end (flat or staged), a stage's length, the phases of an all-reduce
(``Deadlines``), the bounds of the router's and the matchmaker's streams and how long a
finished round answers checks. The reducer, the router, the runners and the staged runner
ask it rather than adding timeouts up themselves; the matchmaker waits on its ``matching``
timeouts.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from diloco.protocol.core.adaptive import adapted_timeouts, rtt_timeouts
from diloco.protocol.core.group import RoundTimeouts

STAGE_ATTEMPTS = 5
"""Stage lengths one stage of a staged round may take at a member: the plan's group, a
view, another view after waiting for its first stream (``staged.runner``)."""


@dataclass(frozen=True, slots=True)
class Deadlines:
    """Loop times at which the phases of one all-reduce end, from its start."""

    gather: float
    """A reducer stops waiting for members' first chunks (``sender_timeout``)."""
    part: float
    """Reducers stop waiting for chunks; members for averaged parts (``reducer_timeout``)."""
    rereduce: float
    """Substitutes stop waiting for the chunks of a failed reducer's part; members for its
    re-reduced average (``rereduce_timeout``)."""
    report: float
    """Members stop waiting for reports (``report_timeout``)."""
    check: float
    """Members stop waiting for answers to their checks (``verify_timeout``)."""
    dispute: float
    """Members stop waiting for a reducer's evidence (``verify_timeout``)."""
    forget: float
    """The round's evidence is dropped: every member's dispute is over."""

    @classmethod
    def starting(cls, t0: float, timeouts: RoundTimeouts) -> Deadlines:
        gather = t0 + timeouts.sender_timeout
        part = gather + timeouts.reducer_timeout
        rereduce = part + timeouts.rereduce_timeout
        report = rereduce + timeouts.report_timeout
        check = report + timeouts.verify_timeout
        dispute = check + timeouts.verify_timeout
        # Members start their rounds up to a matchmaking apart.
        return cls(gather, part, rereduce, report, check, dispute, dispute + timeouts.matchmaking)

    def rereducing(self) -> Deadlines:
        """The deadlines of a substitute's part server: its gather closes halfway through
        the re-reduction window, its chunks and averages are due by its end."""
        return dataclasses.replace(self, gather=(self.part + self.rereduce) / 2, part=self.rereduce)


class StreamBounds(NamedTuple):
    """How long the router serves one stream of each kind, in seconds."""

    part: float
    report: float
    check: float
    """CHECK and EVIDENCE alike."""
    reply: float
    """Writing one small frame (REJECT, ACK, CHECK_RES)."""


@dataclass(frozen=True, slots=True)
class RoundBudget:
    """The timeouts of one round and every deadline computed from them (module docstring)."""

    configured: RoundTimeouts
    """The run's: the router's streams are bounded by these (registered once per run)."""
    matching: RoundTimeouts
    """Matchmaking's: the window and the join timeout stretched to the round trip."""
    running: RoundTimeouts
    """The all-reduce's: the part deadlines adapted to recent transfers (``adapted``)."""

    @classmethod
    def of(
        cls, configured: RoundTimeouts, rtt: float | None = None, out_of_step: bool = False
    ) -> RoundBudget:
        """A round's budget as its matchmaking starts: ``rtt`` (seconds; None: not measured
        yet) stretches the window and the joins; a node ``out_of_step`` with a peer (its
        JOINs came after this node's rounds had ended) gets the widest window and joins any
        round trip may set, so that the peer arrives within it (docs/design.md "The
        round"). The all-reduce runs on the configured timeouts until ``adapted``."""
        matching = rtt_timeouts(configured, math.inf if out_of_step else rtt)
        return cls(configured, matching, configured)

    def adapted(self, transfers: Sequence[float], *, factor: float, floor: float) -> RoundBudget:
        """This budget with the all-reduce's part deadlines following recent ``transfers``
        (seconds; ``factor`` and ``floor`` are the node's): set once the group is known, so a
        round that ended meanwhile counts too."""
        running = adapted_timeouts(self.configured, transfers, factor=factor, floor=floor)
        return dataclasses.replace(self, running=running)

    def round_end(
        self, start: float, stages: int | None = None, matched: float | None = None
    ) -> float:
        """Loop time by which a round begun at ``start`` has ended whatever the peers do: its
        matchmaking, one all-reduce with its checks, a second of slack
        (``RoundTimeouts.total``). A round in ``stages`` stages (None: a flat one) may take
        ``STAGE_ATTEMPTS`` stage lengths per stage: a stage may run its group again as a
        view after a loss (``staged.runner``).

        A follower waits for its GROUP as long as its leader declared it may choose, up to
        ``join_answer`` (``Matchmaker._leader_bound``): until the group is known
        (``matched``: None) the bound holds that wait; once it is known, the all-reduce
        keeps its whole length from then."""
        matchmaking = self.matching.matchmaking
        if matched is None:
            known = start + max(matchmaking, self.join_answer())
        else:
            known = max(start + matchmaking, matched)
        end = known + self.matching.total - matchmaking
        if stages is not None:
            end += (STAGE_ATTEMPTS * stages - 1) * self.stage_length
        return end

    @property
    def stage_length(self) -> float:
        """What one all-reduce with its checks takes at most: one attempt at a stage."""
        return self.running.allreduce + self.running.verification

    def stage_wait(self, stages: float) -> float:
        """How long a stream for a stage group may wait here for it to start: members start
        a round up to a matchmaking apart, then ``stages`` stage lengths come before it."""
        return self.running.matchmaking + stages * self.stage_length

    def deadlines(self, t0: float) -> Deadlines:
        """The phases of an all-reduce that starts at loop time ``t0``."""
        return Deadlines.starting(t0, self.running)

    def streams(self) -> StreamBounds:
        """Bounds of the router's streams: the first frame, up to a matchmaking for this
        node's group to be known, then that stream's phase (a PART stream's goes on to the
        checks asked on it: ``allreduce.channel``)."""
        t = self.configured
        waits = t.connect_timeout + t.matchmaking
        return StreamBounds(
            part=waits + t.allreduce + t.verify_timeout,
            report=waits + t.reply_timeout,
            check=waits + t.allreduce + t.verification,
            reply=t.reply_timeout,
        )

    def join_stream(self) -> float:
        """Bound of a JOIN stream at its leader, registered once per run: it must hold with
        the widest window and joins the round trip may set (``adaptive.MAX_STRETCH``)."""
        return self.join_answer() + rtt_timeouts(self.configured, math.inf).join_timeout

    def join_answer(self) -> float:
        """How long a JOIN waits at its leader for the group: the widest matchmaking, since
        the round it is for may have that window while the next round's budget is narrower
        (a JOIN cut at the narrower one left its sender out of a group that counted it)."""
        return rtt_timeouts(self.configured, math.inf).matchmaking

    @property
    def group_wait(self) -> float:
        """How long a stream that came before this node's group was known waits for it."""
        return self.configured.matchmaking

    def answering_until(self, deadlines: Deadlines) -> float:
        """Until when a member whose all-reduce had ``deadlines`` answers others' checks:
        theirs end a matchmaking after its own at most, their disputes too."""
        return deadlines.check + self.configured.matchmaking
