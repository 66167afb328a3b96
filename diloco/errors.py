"""The root of our exceptions (a leaf module: it imports nothing).

Hierarchy::

    DilocoError
    ├── ConfigError        a run or node configuration that cannot work (says the fix)
    ├── RoundFailed        a fragment round that produced no result (nothing is applied)
    │   └── PriorDiverged  ... because the others start it from another state than ours
    ├── CheckpointError    a checkpoint file that is missing, damaged or of another shape
    └── ProtocolError      a peer broke the protocol; the peer is excluded, never us

``diloco.codecs.CodecError`` (a ``ValueError``) stands apart because ``codecs`` imports
nothing of ours; the CLI maps both families to clear messages.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pathlib import Path


class DilocoError(Exception):
    """Root of every error this package raises on purpose."""


class ConfigError(DilocoError, ValueError):
    """A configuration value, or a combination of them, that cannot work."""


class RoundFailed(DilocoError):
    """A fragment round ended without a usable result; the outer state stays unchanged."""

    def __init__(self, fragment: int, round: int, reason: str) -> None:
        super().__init__(f"fragment {fragment} round {round} failed: {reason}")
        self.fragment = fragment
        self.round = round
        self.reason = reason
        self.others_declared = 0
        """Other peers whose declarations of the round its matchmaking read: the round had
        live peers, so failing it is no reason for a round of one."""


class PriorDiverged(RoundFailed):
    """A round this node found no partner for, while most peers of the round declared one
    other prior state (``prior``, a hash prefix): this node's state of the fragment has
    most likely diverged, and it should heal that fragment now."""

    def __init__(self, fragment: int, round: int, reason: str, prior: str) -> None:
        super().__init__(fragment, round, reason)
        self.prior = prior


class CheckpointError(DilocoError):
    """A checkpoint (or one of its files, ``path``) that cannot be resumed from."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"checkpoint {path}: {reason}")
        self.path = path
        self.reason = reason


class ProtocolError(DilocoError):
    """A message from a peer that violates the protocol."""
