"""Every deadline of one round (``Deadlines``: the loop times at which its phases end). Pure."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from diloco.protocol.core.group import RoundTimeouts


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
