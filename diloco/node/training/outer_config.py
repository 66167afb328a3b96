"""The outer loop's configuration, shared by every node of a run (docs/design.md "Algorithm
and schedule"): H, the outer optimizer, tau and alpha, and the weight cap of one round."""

from __future__ import annotations

from dataclasses import dataclass

from diloco.errors import ConfigError


@dataclass(kw_only=True, slots=True)
class OuterConfig:
    """Outer optimisation and its schedule (docs/design.md "Algorithm and schedule", 2.4); shared by
    every node of a run."""

    sync_every: int = 30
    """H: inner steps between two syncs of one fragment."""
    outer_lr: float = 0.7
    """Learning rate of the outer SGD with Nesterov momentum (DiLoCo's 0.7; the Streaming
    DiLoCo paper uses 0.4 for its larger models, docs/design.md "Algorithm and schedule")."""
    outer_momentum: float = 0.9
    """mu: Nesterov momentum of the outer optimizer (0 disables it)."""
    fragment_sync_delay: int = 1
    """tau: steps between sending a fragment's outer gradient and applying the result."""
    fragment_update_alpha: float | None = None
    """alpha: share of the local weights kept when merging; None means 0.5 if tau > 0 else 0."""

    def __post_init__(self) -> None:
        if self.sync_every < 1:
            raise ConfigError(f"sync_every (H) must be >= 1, got {self.sync_every}")
        check_tau(self.fragment_sync_delay, self.sync_every)
        if self.fragment_update_alpha is not None and not 0 <= self.fragment_update_alpha <= 1:
            raise ConfigError(f"alpha must be in [0, 1], got {self.fragment_update_alpha}")
        if self.outer_lr <= 0 or not 0 <= self.outer_momentum < 1:
            raise ConfigError(
                f"need outer_lr > 0 and 0 <= outer_momentum < 1, got {self.outer_lr}, "
                f"{self.outer_momentum}"
            )

    def alpha_for(self, tau: int) -> float:
        if self.fragment_update_alpha is not None:
            return self.fragment_update_alpha
        return 0.5 if tau > 0 else 0.0


CAP_SEQUENCES = 32
"""Sequences per inner step behind the default weight cap (``RunConfig.max_round_tokens``)."""


def round_token_cap(max_round_tokens: int | None, seq_len: int, sync_every: int) -> int:
    """A member's largest weight in one round, in tokens: ``max_round_tokens``, or
    ``CAP_SEQUENCES`` sequences of ``seq_len`` tokens for each of the H (``sync_every``)
    steps of a round (four rounds of a node with the default batch of 8)."""
    if max_round_tokens is not None:
        return max_round_tokens
    return CAP_SEQUENCES * seq_len * sync_every


def check_tau(tau: int, sync_every: int) -> None:
    if not 0 <= tau < sync_every:
        raise ConfigError(f"tau must satisfy 0 <= tau < H={sync_every}, got {tau}; lower --tau")
