"""CPU work of a round: on the event loop when it is small, in the default executor when not.

A hop to the executor costs two thread wake-ups (a worker's, then the loop's), each a
scheduling delay on a busy machine, and hands the GIL over twice; for the small chunks of
a small fragment (tens of thousands of values: a fraction of a millisecond of codec work)
that wait is several times the work itself and lies on the round's critical path. Large
chunks still go to the executor, so the loop keeps serving streams while one is encoded
(docs/design.md "The round").
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

INLINE_VALUES = 1 << 16
"""Values up to which work runs on the loop: encoding this many with E3M0 takes under a
millisecond, about what one executor hop costs on a loaded machine."""


async def offload(values: int, fn: Callable[..., T], *args: object) -> T:
    """``fn(*args)``: run on the loop if it touches at most ``INLINE_VALUES`` values, else
    in the loop's default executor. Either way other tasks run before it returns, as they
    did while a hop was under way: the order of a round's tasks stays as it was."""
    loop = asyncio.get_running_loop()
    if values > INLINE_VALUES:
        return await loop.run_in_executor(None, fn, *args)
    result = fn(*args)
    await asyncio.sleep(0)
    return result
