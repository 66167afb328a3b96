"""A fragment round in flight on one node, between its send and its receive step
(``outer.FragmentSync`` holds them)."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

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
