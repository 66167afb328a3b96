"""Round trips on a round's critical path: how many request/response exchanges a member
waits for one after another between its send step and the averaged result.

Across the internet a round costs about (round trips on its path) x RTT more than on
loopback (``docs/design.md "Across the internet"``). The exchanges are marked where they
happen with ``@exchange(kind)`` (declaring and reading the round on the DHT, JOIN -> GROUP,
PART -> AVERAGED, the REPORT exchange, CHECK); ``SwarmReducer`` opens one ``RoundTrips``
per round with ``counting()``, and every marked exchange awaited in that round's task, or
in the tasks it starts, adds its interval. Exchanges that overlap in time ran side by side
(PARTs to every reducer at once) and count once: the path is the longest chain of
intervals, each starting after the one before ended. Outside a round (a stream served for
a peer) nothing is counted, at the cost of one context-variable read.

A DHT store or read is one exchange here though hivemind may ask more than one peer in
turn inside it; each exchange's seconds are kept, so a measurement at a known RTT tells
how many network round trips it really cost.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from typing import Any, ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")

MAX_EXCHANGES = 256
"""Exchanges kept per round (a round with more retries than this keeps its first ones)."""


class RoundTrips:
    """The exchanges of one round at one member: ``(kind, start, end)`` in monotonic time."""

    def __init__(self) -> None:
        self.exchanges: list[tuple[str, float, float]] = []

    def add(self, kind: str, start: float, end: float) -> None:
        if len(self.exchanges) < MAX_EXCHANGES:
            self.exchanges.append((kind, start, end))

    def critical_path(self) -> list[tuple[str, float]]:
        """The longest chain of exchanges, each started after the one before it ended, as
        ``(kind, seconds)`` in order; of equally long chains (and links), the one that ends
        last: what the round waited for."""
        spans = sorted(self.exchanges, key=lambda e: (e[2], e[1]))
        # best[i]: the longest chain ending with spans[i], and the span before it there
        best: list[tuple[int, int]] = []
        for i, (_, start, _) in enumerate(spans):
            before = [(best[j][0], j) for j in range(i) if spans[j][2] <= start]
            length, previous = max(before, default=(0, -1))
            best.append((length + 1, previous))
        if not best:
            return []
        i = max(range(len(best)), key=lambda k: (best[k][0], k))
        path = []
        while i >= 0:
            kind, start, end = spans[i]
            path.append((kind, end - start))
            i = best[i][1]
        return path[::-1]


_CURRENT: contextvars.ContextVar[RoundTrips | None] = contextvars.ContextVar(
    "diloco_round_trips", default=None
)


@contextlib.contextmanager
def counting() -> Iterator[RoundTrips]:
    """Count the exchanges awaited in this task (and the tasks it starts) from now on."""
    trips = RoundTrips()
    token = _CURRENT.set(trips)
    try:
        yield trips
    finally:
        _CURRENT.reset(token)


def exchange(
    kind: str,
) -> Callable[[Callable[P, Awaitable[T]]], Callable[P, Coroutine[Any, Any, T]]]:
    """Mark an async function as one request/response exchange of kind ``kind``."""

    def mark(fn: Callable[P, Awaitable[T]]) -> Callable[P, Coroutine[Any, Any, T]]:
        @functools.wraps(fn)
        async def counted(*args: P.args, **kwargs: P.kwargs) -> T:
            trips = _CURRENT.get()
            if trips is None:
                return await fn(*args, **kwargs)
            start = time.monotonic()
            try:
                return await fn(*args, **kwargs)
            finally:
                trips.add(kind, start, time.monotonic())

        return counted

    return mark


def path_summary(path: list[tuple[str, float]]) -> str:
    """``declare 0.41s, read 0.21s, ...`` for the log."""
    return ", ".join(f"{kind} {seconds:.3f}s" for kind, seconds in path) or "none"
