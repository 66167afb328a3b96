"""What this node has itself seen peers do: the members of rounds it applied.

Identities are free, rounds are not. A peer counted in a round this node applied sent
parts its reducers decoded and sealed, and this node's reports agreed on it: that is work
the node witnessed. Only such peers (and the run's creator, who signed the configuration)
may move anything of this node's (docs/design.md "Evidence"): whose vouches make a state
adoptable, whose steps set the robust step, whose step times set the pace. A key that only
writes DHT records never enters this ledger, however many there are.

The ledger is bounded (the last ``horizon`` rounds this node applied) so a peer's say
fades once it stops working with this node. Thread-safe: rounds are recorded on the
training thread and read from the publisher's and the healer's.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

HORIZON_ROUNDS = 256
"""Rounds remembered: with 5 fragments and H = 10 that is the last ~500 steps."""


@dataclass(frozen=True, slots=True)
class WitnessedRound:
    """One round this node applied: who was counted, and with what weight (tokens)."""

    fragment: int
    round: int
    members: tuple[str, ...]
    outer_sha256: str
    weights: Mapping[str, float] = field(default_factory=dict)
    """Each member's declared weight (tokens trained), where the node knows it."""


class Witness:
    """The rounds this node applied, newest last, and the peers that worked in them."""

    def __init__(self, me: str, horizon: int = HORIZON_ROUNDS) -> None:
        self.me = me
        self._rounds: deque[WitnessedRound] = deque(maxlen=horizon)
        self._lock = threading.Lock()
        self.restored: frozenset[tuple[int, int]] = frozenset()
        """(fragment, round) of the rounds a resumed node's checkpoint held in flight."""

    def record(self, applied: WitnessedRound) -> None:
        """Remember a round this node applied (only rounds it was counted in with a peer: a
        round it sat out proves nothing to it, and a round of one, applied alone in the run,
        witnesses nobody; keeping it would push the rounds of its peers out of the ledger).

        A round restored from a checkpoint is not remembered either: the ledger empties on
        restart, and a resumed node counts its anchors until its next round. Remembering
        that one round made its members (the creator alone, frozen, in the chaos run) the
        only peers whose word counted, and the node never healed from its anchor.
        """
        if self.me not in applied.members or len(applied.members) < 2:
            return
        if (applied.fragment, applied.round) in self.restored:
            return
        with self._lock:
            self._rounds.append(applied)

    def rounds(self) -> tuple[WitnessedRound, ...]:
        with self._lock:
            return tuple(self._rounds)

    def workers(self) -> frozenset[str]:
        """Peers other than this node counted in at least one remembered round."""
        return frozenset(m for r in self.rounds() for m in r.members if m != self.me)

    def rounds_with(self, peer: str) -> int:
        """How many remembered rounds counted ``peer`` (0 for a paper identity)."""
        return sum(peer in r.members for r in self.rounds())

    def weights(self) -> dict[str, list[float]]:
        """Each peer's announced weights (tokens) in the remembered rounds that carried
        them, oldest first: the work a peer's claimed step time must agree with
        (docs/design.md "Pace")."""
        found: dict[str, list[float]] = {}
        for r in self.rounds():
            for peer, weight in r.weights.items():
                if peer != self.me and peer in r.members:
                    found.setdefault(peer, []).append(weight)
        return found
