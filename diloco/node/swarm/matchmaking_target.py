"""How many declarations a node's rounds wait for, kept current (docs/design.md "Healing and
joining").

The target (``claims.group_target``) has two inputs that change on two threads: the live
records, read by the publisher's thread after each of its stores, and the peers this node
saw work (``Witness``), which grow on the training thread when a round is applied. Set from
the records alone, it lagged every new worker by a store and a read (several round trips):
with tau near the steps between two sends, a round applied the step before the next
fragment's send, which then still led with the old count and closed its group on the peer
it had just worked with. So both inputs set it, under one lock: the later computation is
also the later one the reducer's loop takes. A round applied only ever raises it: waiting
for one more peer costs a window at most, leaving a live one out costs it the round and a
heal. It falls at the next read of the records, as before (a joiner's anchors give way to
the peers it worked with, and the records tell who left): in the chaos run a restarted
joiner whose first round was with the creator alone, lowering its count at once, led
without the third node, which was out of step then, from the next round on.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from diloco.node.evidence.claims import Evidence, counted_peers, target_for
from diloco.protocol.records.nodes import NodeRecord


class MatchmakingTarget:
    """Sets the reducer's matchmaking target from the last live records read and the
    evidence as it is now; ``heard`` on the publisher's thread, ``witnessed`` on the
    training thread."""

    def __init__(
        self,
        evidence: Callable[[], Evidence],
        min_group_size: int,
        set_target: Callable[[int, int, int], None],
    ) -> None:
        self.evidence = evidence
        self.min_group_size = min_group_size
        self.set_target = set_target
        """``SwarmReducer.set_target_group_size``: target, live record authors, the peers
        counted before the target's floor."""
        self._lock = threading.Lock()
        self._records: Sequence[NodeRecord] | None = None
        self._counted = -1
        """The peers counted when the target was last set."""

    def heard(self, records: Sequence[NodeRecord]) -> None:
        """The run's live records were read."""
        with self._lock:
            self._records = records
            self._set(self._count(records))

    def witnessed(self) -> None:
        """A round was applied: the peers seen working may have grown."""
        with self._lock:
            if (
                self._records is not None
                and (counted := self._count(self._records)) > self._counted
            ):
                self._set(counted)

    def _count(self, records: Sequence[NodeRecord]) -> int:
        return counted_peers(records, self.evidence())

    def _set(self, counted: int) -> None:
        assert self._records is not None
        self._counted = counted
        self.set_target(target_for(counted, self.min_group_size), len(self._records), counted)
