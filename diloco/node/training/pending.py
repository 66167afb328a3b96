"""A fragment round in flight on one node, between its send and its receive step, and what
happened to it at its receive step (``outer.FragmentSync`` holds and reports them)."""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field

from diloco.errors import RoundFailed
from diloco.protocol.core.reducer import RoundKey, RoundResult


@dataclass(slots=True)
class PendingRound:
    key: RoundKey
    future: Future[RoundResult]
    receive_step: int
    weight: float
    """Tokens of the round (docs/design.md "Algorithm and schedule" step 3); carried to the next
    round if it fails."""

    def failure(self) -> RoundFailed | None:
        """How the round failed, once it has (its result can no longer change the outer
        state); None while it runs, and when it succeeded or was given up."""
        if not self.future.done() or self.future.cancelled():
            return None
        error = self.future.exception()
        return error if isinstance(error, RoundFailed) else None


@dataclass(frozen=True, slots=True)
class AppliedRound:
    """What happened to one round at its receive step (for metrics and tests)."""

    key: RoundKey
    ok: bool
    members: tuple[str, ...] = ()
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0
    matchmaking_seconds: float = 0.0
    blocked_seconds: float = 0.0
    outer_sha256: str = ""
    prior_sha256: str = ""
    """Hash of the fragment's outer state the round started from (its members share it)."""
    error: str = ""
    weight: float = 0.0
    """This replica's own weight in the round (its tokens, docs/design.md "Algorithm and schedule"
    step 3)."""
    member_weights: Mapping[str, float] = field(default_factory=dict)
    """Each member's announced weight, where the round carried it (docs/design.md "Pace")."""
    round_trips: tuple[tuple[str, float], ...] = ()
    """The exchanges on the round's critical path at this node (``RoundResult``)."""
