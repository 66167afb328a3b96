"""The event loop of a node's swarm thread: uvloop where it is installed, else asyncio's.

uvloop (libuv) runs the protocol's many small stream reads and writes with less overhead
than asyncio's pure-Python selector loop; hivemind depends on it and runs its own DHT
process on it. Measured on the loopback all-reduce (4 peers, 10^7 values, E3M0; six
alternating pairs of runs, benchmarks/RESULTS.md "uvloop for the swarm thread's event
loop"): median 1.02 s per all-reduce with uvloop against 1.15 s with asyncio's loop, so it
stays.

A stream that a peer (or a stopping p2pd) cuts, or that shutdown cancels, before hivemind
hands it to our handler fails in hivemind's own connection task, where nothing of ours can
catch it; asyncio would print it as an ERROR with a traceback. The loop's exception handler
logs such transport endings at debug (``CUT``): a node never prints a traceback because of
a peer. Anything else goes to asyncio's default handler, loud as before.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")

CUT = (asyncio.IncompleteReadError, asyncio.CancelledError, ConnectionError, EOFError)
"""What a stream cut by its peer or cancelled at shutdown raises."""


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A new loop, not installed as any thread's current loop, whose exception handler
    keeps cut streams quiet (module docstring)."""
    try:
        import uvloop
    except ImportError:  # e.g. Windows, which uvloop does not support
        loop = asyncio.new_event_loop()
    else:
        loop = uvloop.new_event_loop()
    loop.set_exception_handler(_quiet_cut_streams)
    return loop


def _quiet_cut_streams(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    exception = context.get("exception")
    if isinstance(exception, CUT):
        logger.debug("%s: %r", context.get("message", "a stream ended"), exception)
        return
    loop.default_exception_handler(context)


async def wait_set(event: asyncio.Event, timeout: float) -> bool:
    """Wait until ``event`` is set, at most ``timeout`` seconds; whether it is set.

    Not ``asyncio.wait_for(event.wait(), timeout)``: in Python 3.11 that drops a
    cancellation that arrives as the event is set, and a loop around it then waits out its
    whole deadline (a staged round's member moving to another view waited 8 s for its
    cancelled part server, and the view it moved to had ended meanwhile).
    """
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout):
            await event.wait()
    return event.is_set()


def submit(
    coro: Coroutine[Any, Any, T], loop: asyncio.AbstractEventLoop
) -> concurrent.futures.Future[T]:
    """``asyncio.run_coroutine_threadsafe``, but a caller that cancels the future gives its
    result up quietly.

    Cancelling the future cancels the task; a task whose coroutine turns that cancellation
    into an error (a ``wait_for`` that drops it in Python 3.11, then a DHT process that
    ended as the node stopped) ends with an error nobody retrieves, and asyncio prints its
    traceback when the task is collected. Here such a task ends cancelled instead.
    """
    return asyncio.run_coroutine_threadsafe(_cancelled_if_given_up(coro), loop)


async def _cancelled_if_given_up(coro: Coroutine[Any, Any, T]) -> T:
    """``coro``; ends cancelled, not with what it raised, once its task was cancelled."""
    try:
        return await coro
    except Exception as error:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise asyncio.CancelledError from error
        raise
