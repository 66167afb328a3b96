"""Failed rounds told to a person: by cause, a line when waiting starts and ends, and a
summary at most once a minute, never a line per round.

A node alone in the swarm fails every fragment round (every few seconds) for the same
reason; a line per round would bury everything else, and a bare count at the end ("3
failed rounds") does not say whether something is wrong.
"""

from __future__ import annotations

import logging
import re
import time
from collections import Counter
from collections.abc import Callable

logger = logging.getLogger(__name__)

ALONE = "no partner (alone in the swarm)"
WAITING = (
    "waiting for peers: alone in the swarm, each round applies this node's own outer "
    "gradient meanwhile (a round of one)"
)
SUMMARY_EVERY = 60.0
"""Seconds between two summaries of the rounds that failed meanwhile."""
IN_A_ROW = 5
"""Rounds failed one after another (none applied between) that earn a line saying why."""

_CAUSES = (
    (re.compile(r"^no group: 1 member\b|^no (live )?peer that may lead"), ALONE),
    (re.compile(r"^no group: \d+ member"), "too few partners for the group size"),
    (re.compile(r"^leader \S+ refused"), "refused by the round's leader (not in that round)"),
    (re.compile(r"^abandoned"), "abandoned while stopping or saving"),
    (re.compile(r"deadline passed|in time"), "timed out"),
)


def failure_cause(error: str) -> str:
    """The cause of a failed round, in words, from its error (``RoundFailed``'s message,
    ``fragment F round R failed: REASON``, or the bare reason)."""
    reason = error.split(" failed: ", 1)[-1]
    for pattern, cause in _CAUSES:
        if pattern.search(reason):
            return cause
    return reason


def failure_reason(error: str, cause: str, others: int) -> str:
    """Why a node fails its rounds, in a clause: the cause, what it means when other nodes
    are live, and the last error itself."""
    reason = error.split(" failed: ", 1)[-1]
    if cause in (ALONE, "refused by the round's leader (not in that round)") and others:
        return (
            f"the last: {reason}, with {others} other live node(s): this node reaches its "
            "send steps out of step with theirs (its rounds open when theirs have closed, "
            "or before they open), a slower or faster node than the swarm"
        )
    return f"the last: {reason} ({cause})"


class FailureLog:
    """Counts failed rounds by cause and logs them sparingly: one INFO line when the node
    starts waiting for peers, one when its first group forms, and per minute one line per
    cause (a warning unless the cause is being alone)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.total: Counter[str] = Counter()
        self.recent: Counter[str] = Counter()
        self.since = clock()
        self.waiting = False
        self.grouped = False
        self.streak = 0
        """Rounds failed since the last one applied."""
        self.alone_rounds = 0
        """Rounds of one applied (alone in the run): not failed, not a group either."""

    def failed(self, error: str, others: int = 0) -> None:
        """A round failed with ``error``, while ``others`` other nodes were live."""
        cause = failure_cause(error)
        self.total[cause] += 1
        self.recent[cause] += 1
        self.streak += 1
        if self.streak == IN_A_ROW and (cause != ALONE or others > 0):
            logger.warning(
                "%d rounds in a row failed, %s",
                self.streak,
                failure_reason(error, cause, others),
            )
        if cause == ALONE and not self.waiting and others == 0:
            self.waiting = True
            logger.info(WAITING)
        self._maybe_summarise()

    def succeeded(self, members: int) -> None:
        """A round applied with ``members`` members; a round of one (alone in the run,
        docs/design.md "Algorithm and schedule") means the node is still waiting."""
        self.streak = 0
        if members < 2:
            self.alone_rounds += 1
            if not self.waiting:
                self.waiting = True
                logger.info(WAITING)
            return
        if self.waiting or not self.grouped:
            logger.info("a group formed: %d members in this round", members)
        self.waiting, self.grouped = False, True
        self._maybe_summarise()

    def _maybe_summarise(self) -> None:
        now = self.clock()
        if now - self.since < SUMMARY_EVERY:
            return
        seconds = now - self.since
        for cause, count in self.recent.items():
            log = logger.info if cause == ALONE else logger.warning
            log("%d rounds failed in the last %.0f s: %s", count, seconds, cause)
        self.recent.clear()
        self.since = now
