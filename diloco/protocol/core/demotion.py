"""Demotion: a node whose reducer part keeps failing takes no part for a while. Pure.

A peer that failed rounds repeatedly as a reducer (slow, overloaded,
frozen, on a flaky link) is not chosen as reducer for a while. Who decides, so that every
member of a group agrees? The node itself, from evidence it holds after each round: its
own part failed when its reducer side could not average it (``PartReducer.failed``), when
the round's deadline passed before its all-reduce ended, or when a member's REPORT says that
part is missing (``own_part_missing``). Once ``max_failures`` of its last ``window`` rounds as a
reducer failed so, it asks to be a *client* in its next ``cooldown`` rounds (the JOIN's
client flag: it reduces no part; unlike a node nobody can dial, it may still lead). The
leader copies each JOIN's flag into GROUP (and reduces itself when nobody else would) and
every member checks its own, so all members take the roles from the same bytes: the
agreement is the GROUP, as for the member list. Rounds without a group count towards the
cooldown too, so a demotion always ends.

Why the node's own view, not its peers': the peers' views differ (each saw other rounds
fail, and views published in the DHT arrive at different times), and a rule over them
would need another agreement step per round. The cost: a node that lies about its failures
is not demoted by this rule; withholding its part fails one part per round, which the
round's agreement already contains (the members then all fail or heal alike).
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

from diloco.protocol.wire.part import Report

logger = logging.getLogger(__name__)


def own_part_missing(index: int, reducer_failed: bool, reports: Mapping[int, Report]) -> bool:
    """Whether member ``index``'s part failed in a round: its reducer side failed, or some
    member's report says it does not hold that part."""
    return reducer_failed or any(not report.parts[index] for report in reports.values())


@dataclass(slots=True)
class Demotion:
    """This node's record as a reducer, and whether it should be a client now."""

    max_failures: int = 2
    """Failed rounds as a reducer, among the last ``window``, that demote the node."""
    window: int = 8
    """Rounds as a reducer looked at."""
    cooldown: int = 8
    """Rounds the node then takes part in as a client, before it reduces again."""
    recent: collections.deque[bool] = field(default_factory=collections.deque)
    """Whether each of the last rounds as a reducer failed, oldest first."""
    remaining: int = 0
    """Client rounds left of the current demotion."""

    def __post_init__(self) -> None:
        if not 1 <= self.max_failures <= self.window:
            raise ValueError(f"need 1 <= max_failures <= window, got {self.max_failures}")
        if self.cooldown < 1:
            raise ValueError(f"cooldown must be >= 1 round, got {self.cooldown}")

    @property
    def demoted(self) -> bool:
        """Whether the next round should be taken as a client."""
        return self.remaining > 0

    def record(self, reduced: bool, failed: bool) -> None:
        """One round this node took part in: as a reducer (``reduced``), whether its part
        failed; as a client, one round of the demotion served."""
        if not reduced:
            self.remaining = max(0, self.remaining - 1)
            return
        self.recent.append(failed)
        while len(self.recent) > self.window:
            self.recent.popleft()
        if sum(self.recent) >= self.max_failures:
            logger.warning(
                "this node's reducer part failed in %d of its last %d rounds: it takes no "
                "part for the next %d rounds",
                sum(self.recent),
                len(self.recent),
                self.cooldown,
            )
            self.remaining = self.cooldown
            self.recent.clear()
