"""Caps on what peers may ask of a server; pure bookkeeping.

A STATE_REQ is about 30 bytes; answering it streams the node's whole outer state (8 bytes
per parameter). Without caps one peer, or many identities of one, could keep a node
streaming its state to them all the time. ``StreamLimiter`` admits a stream only if

- the peer has no other stream of this kind open (one at a time per peer),
- fewer than ``max_streams`` are open in total (all peers together), and
- the peer's token bucket holds a request: ``burst`` at once, then one more every
  ``refill_seconds`` (a joiner asks once for everything, a healer once per fragment it
  heals; a burst of 8 and 10 a minute leave honest nodes room and cap a spammer at 10
  full states a minute per identity).

Refusals are answered with REJECT BUSY (``wire.RejectCode``); the caller logs them. Time is
passed in, so the rules are tested without sleeping. Known limit: identities are free, so
many identities can still occupy all ``max_streams`` slots (each for at most the server's
stream deadline); a closed swarm (swarm key) bounds who may ask at all.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_TRACKED_PEERS = 4096
"""Buckets kept before full ones (peers quiet long enough) are forgotten."""


@dataclass(frozen=True, slots=True)
class StreamLimits:
    """The caps of one kind of stream (module docstring)."""

    max_streams: int = 4
    """Streams open at once, all peers together."""
    burst: int = 8
    """Requests a peer may make at once after a quiet while (its bucket's size)."""
    refill_seconds: float = 6.0
    """Seconds until a peer regains one request."""

    def __post_init__(self) -> None:
        if self.max_streams < 1 or self.burst < 1 or not self.refill_seconds > 0:
            raise ValueError(f"stream limits must be positive, got {self}")


class StreamLimiter:
    """Who may open a stream now; ``release`` each admitted stream when it ends."""

    def __init__(self, limits: StreamLimits) -> None:
        self.limits = limits
        self.open: set[str] = set()
        self.buckets: dict[str, tuple[float, float]] = {}
        """Peer -> (requests left, when counted)."""

    def admit(self, peer: str, now: float) -> str | None:
        """None if ``peer`` may open a stream at time ``now`` (then it counts as open),
        else why not."""
        limits = self.limits
        if peer in self.open:
            return "one stream at a time per peer"
        if len(self.open) >= limits.max_streams:
            return f"{limits.max_streams} streams open already"
        tokens = self._tokens(peer, now)
        if tokens < 1:
            return f"over {limits.burst} requests, then one per {limits.refill_seconds:g} s"
        if len(self.buckets) >= MAX_TRACKED_PEERS:
            self._forget_full(now)
        self.buckets[peer] = (tokens - 1, now)
        self.open.add(peer)
        return None

    def release(self, peer: str) -> None:
        self.open.discard(peer)

    def _tokens(self, peer: str, now: float) -> float:
        tokens, at = self.buckets.get(peer, (float(self.limits.burst), now))
        regained = max(0.0, now - at) / self.limits.refill_seconds
        return min(float(self.limits.burst), tokens + regained)

    def _forget_full(self, now: float) -> None:
        """Drop the buckets that have filled up again: forgetting them changes nothing."""
        full = [p for p in self.buckets if self._tokens(p, now) >= self.limits.burst]
        for peer in full:
            del self.buckets[peer]
