"""This node's own stalls: spans its event loop did not run (docs/design.md "Liveness").

A node that was stopped (SIGSTOP, a laptop's sleep), swapped out or starved of CPU judged
nothing meanwhile: when it runs again, every deadline that passed while it stood has
passed for its peers' answers too, which sit unread in its sockets. Silence it judges
across such a stall is its own, not its peers'. ``StallWatch`` ticks on the swarm's loop; a
tick later than ``STALL_S`` marks a stall, and ``BanList`` charges no silence while the
loop is late or a stall is recent (``MEMORY_S``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

TICK_S = 0.25
"""Seconds between two ticks."""
STALL_S = 3.0
"""A tick this many seconds late is a stall: far past the loop's usual lag on loaded cores
(tenths of a second), and short of any round deadline a silent peer is charged at."""
MEMORY_S = 120.0
"""Seconds after a stall during which silence is not charged: a round's deadlines (the
widest matchmaking window and the round timeout) lie within it, so a silence judged now
may have begun while this node stood."""


class StallWatch:
    """When this node's loop last ran on time, and when its last stall ended."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._last_tick = clock()
        self._stall_ended: float | None = None

    def tick(self) -> None:
        """The loop runs: a stall if it had not for ``STALL_S`` seconds."""
        now = self._clock()
        late = now - self._last_tick
        if late > STALL_S:
            self._stall_ended = now
            logger.warning(
                "this node stood for %.1f s (stopped, asleep or starved of CPU): silence "
                "judged over the next %.0f s is not charged to peers",
                late,
                MEMORY_S,
            )
        self._last_tick = now

    def stalled(self) -> bool:
        """Whether the loop is late now (a stall it has not ticked since) or stalled within
        the last ``MEMORY_S`` seconds."""
        now = self._clock()
        if now - self._last_tick > STALL_S:
            return True
        return self._stall_ended is not None and now - self._stall_ended <= MEMORY_S

    async def run(self) -> None:
        """Tick every ``TICK_S`` until cancelled (on the loop whose stalls count). The watch
        starts now: the seconds before (the DHT's start, before the loop runs) are no stall."""
        self._last_tick = self._clock()
        while True:
            await asyncio.sleep(TICK_S)
            self.tick()
