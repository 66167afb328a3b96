"""Peers whose JOINs come after this node's rounds have ended: nodes out of step with it.

Two nodes whose send steps fall further apart in time than the matchmaking window never
meet: the earlier one waits its window, fails the round and trains on to the next, and the
later one finds that round ended. Both lose about a window per round, so the gap stays
(a joiner starts behind by its state transfer; at 2 s windows it took 40 steps to close
once). A JOIN for a round this node has ended is the evidence that a peer comes that late;
while such a peer has not been in a group with this node since, the node waits the
widest window any round trip may set (``RoundBudget.of``, ``out_of_step``), its peer
arrives within it, and from that round on both apply at the same step. The early node
gets no late JOIN when its peers formed the round without it; its evidence is then a round
it led that found none of the peers it saw work (``alone``), unless it finds itself behind
the swarm (``set_behind``): such rounds were late, not early. A peer that took this node's
state (a joiner, a healer) is out of step with it too, until they met (``took_state``), for
a cycle of rounds at most, once a minute. The wider window costs nothing in a round whose
peers all come: a round ends as soon as they have. Bounded like any peer's word: the peers
kept are at most ``MAX_LATE`` and forgotten after ``LATE_MEMORY`` seconds (docs/design.md
"The round").
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

from hivemind.p2p import PeerID

from diloco.protocol.core.reducer import RoundKey

logger = logging.getLogger(__name__)

LATE_MEMORY = 60.0
"""Seconds a late JOIN keeps this node waiting the widest window (the peer may have left)."""
MAX_LATE = 64
"""Late peers kept at most (the oldest go first): JOINs cost their sender nothing."""
TAKER_ROUNDS = 2
"""Rounds of one fragment this node ends after a peer took its state before that peer no
longer widens its window: by then it has passed a send step of every fragment (a cycle)."""


@dataclass
class _Taken:
    """A peer that took this node's state and has not been in a group with it since."""

    when: float
    """When it took the state (loop time)."""
    rounds: dict[int, int] = field(default_factory=dict)
    """Fragment -> the rounds of it this node ended since."""

    @property
    def waited(self) -> bool:
        """Whether this node has waited a cycle of rounds for it."""
        return any(n >= TAKER_ROUNDS for n in self.rounds.values())


class LatePeers:
    """The rounds this node ended and the peers that JOINed them afterwards."""

    def __init__(self) -> None:
        self._ended: dict[int, int] = {}
        """Fragment -> the latest round this node ended (formed or failed)."""
        self._late: dict[PeerID, float] = {}
        """Peer -> when its last late JOIN came (loop time)."""
        self._alone: float | None = None
        """When a round this node led last found too few of the peers it saw work."""
        self._behind = False
        """Whether this node is behind the swarm (``set_behind``)."""
        self._takers: dict[PeerID, _Taken] = {}
        """Peers that took this node's state and have not been in a group with it since."""

    def ended(self, key: RoundKey) -> None:
        """This node's matchmaking of round ``key`` ended."""
        if key.round > self._ended.get(key.fragment, -1):
            for taken in self._takers.values():
                taken.rounds[key.fragment] = taken.rounds.get(key.fragment, 0) + 1
        self._ended[key.fragment] = max(key.round, self._ended.get(key.fragment, key.round))

    def came(self, peer: PeerID, key: RoundKey, now: float) -> bool:
        """A JOIN of ``peer`` for round ``key`` found no open lobby here: whether it came
        after this node ended that round (a round not reached yet is no evidence)."""
        if key.round > self._ended.get(key.fragment, -1):
            return False
        logger.info("round %s: JOIN of %s came after the round ended here", key, peer)
        self._mark(peer, now)
        return True

    def took_state(self, peer: PeerID, when: float) -> None:
        """``peer`` took this node's state at ``when`` (loop time): it starts behind this node
        (the transfer, and the step of the record it starts at, up to a publishing interval
        old) and looks for it in its rounds, so it is out of step until a group with it. At
        6 nodes and 200 ms the creator led its first round alone on its usual window, and
        the joiners' JOINs came after it had ended: the round failed for every node.

        For a cycle of rounds at most (``TAKER_ROUNDS``): a joiner JOINs within it, and one
        that comes late is marked by its late JOIN (``came``). And once per
        ``LATE_MEMORY`` until it has been in a group with this node: a peer that downloads
        the state again and again and never works (a forger did, 52 times in one run) would
        keep every round of this node on the widest window."""
        taken = self._takers.get(peer)
        if taken is not None and when - taken.when <= LATE_MEMORY:
            return
        self._takers.pop(peer, None)
        self._takers[peer] = _Taken(when)
        while len(self._takers) > MAX_LATE:
            del self._takers[next(iter(self._takers))]

    def _mark(self, peer: PeerID, when: float) -> None:
        """``peer`` is out of step since ``when``; the oldest go first past ``MAX_LATE``."""
        self._late.pop(peer, None)
        self._late[peer] = when
        while len(self._late) > MAX_LATE:
            del self._late[next(iter(self._late))]

    def alone(self, counted: int, now: float) -> None:
        """A round this node led formed no group. With one or more ``counted`` peers (the
        peers it saw work and the run's creator, which no record or JOIN of a stranger
        raises), those peers are live and out of step: they reach their send steps after
        this node's window (an early node gets no late JOIN: it led, alone). One is enough: a
        joiner counts the creator alone until they have worked together (docs/design.md
        "The round")."""
        if counted >= 1 and not self._behind:
            self._alone = now

    def set_behind(self, behind: bool) -> None:
        """Whether this node is behind the swarm: records of peers it counts are past its
        step, or it has just skipped ahead to the swarm's step. While it is, the rounds it
        leads alone come after its peers' rounds, not before, so they are no evidence that
        its peers come late, and waiting the widest window for peers that passed them only
        puts it further behind: in one chaos run a joiner 1.5-3 s behind its creator (steps
        of 0.07 s) waited 4 s alone in every other round, skipped ahead and fell behind
        again, for 70 steps. Late JOINs and state takers stay evidence."""
        self._behind = behind
        if behind:
            self._alone = None

    @property
    def behind(self) -> bool:
        """Whether this node is behind the swarm (``set_behind``)."""
        return self._behind

    def met(self, members: Iterable[PeerID]) -> None:
        """A group formed with ``members``: they are in step with this node now."""
        self._alone = None
        for peer in members:
            self._late.pop(peer, None)
            self._takers.pop(peer, None)

    def out_of_step(self, now: float) -> bool:
        """Whether, in the last ``LATE_MEMORY`` seconds, a peer JOINed one of this node's
        ended rounds and has not been in a group with it since, or a round it led found
        none of the peers it counts and no group formed since, or a peer took its state
        and this node has not waited a cycle of rounds for it yet."""
        taking = [taken.when for taken in self._takers.values() if not taken.waited]
        alone = [self._alone] if self._alone is not None else []
        recent = [*self._late.values(), *alone, *taking]
        return any(now - when <= LATE_MEMORY for when in recent)
