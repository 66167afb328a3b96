"""A node's record of each round it applied or failed, as its metrics file, its dashboard
and its trackers read it (docs/design.md "Watching a run")."""

from __future__ import annotations

from typing import Any

from diloco.node.training.pending import AppliedRound


def round_event(applied: AppliedRound, step: int, final: bool = False) -> dict[str, Any]:
    """The record of ``applied`` at the node's ``step``; ``final``: applied at the run's
    end, before its receive step (its wait is the end's, not a step's)."""
    key = applied.key
    head: dict[str, Any] = {"step": step, "fragment": key.fragment, "round": key.round}
    if final:
        head["final"] = True
    if not applied.ok:
        failed = {"blocked_seconds": applied.blocked_seconds, "error": applied.error}
        return {"event": "round_failed", **head, **failed}
    return {
        "event": "round",
        **head,
        "members": len(applied.members),
        "bytes_sent": applied.bytes_sent,
        "bytes_received": applied.bytes_received,
        "seconds": applied.seconds,
        "matchmaking_seconds": applied.matchmaking_seconds,
        "blocked_seconds": applied.blocked_seconds,
        "weight": applied.weight,
        "outer_sha256": applied.outer_sha256,
        "prior_sha256": applied.prior_sha256,
        "round_trips": len(applied.round_trips),
        "critical_path": [[kind, round(s, 4)] for kind, s in applied.round_trips],
    }
