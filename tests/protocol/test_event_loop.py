"""The swarm thread's loop: uvloop where installed, asyncio's own otherwise; ``wait_set``
keeps a cancellation that arrives as the event is set (``asyncio.wait_for`` in Python 3.11
drops it, and a loop around it then waits out its deadline); ``submit`` lets a caller give
a call up without an unread error left behind."""

from __future__ import annotations

import asyncio
import gc
import logging
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import uvloop

from diloco.protocol.runtime.event_loop import new_event_loop, submit, wait_set


def test_uvloop_when_installed() -> None:
    loop = new_event_loop()
    try:
        assert isinstance(loop, uvloop.Loop)
        assert loop.run_until_complete(asyncio.sleep(0, "ran")) == "ran"
    finally:
        loop.close()


def test_asyncio_loop_without_uvloop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # `import uvloop` raises ImportError
    loop = new_event_loop()
    try:
        assert not isinstance(loop, uvloop.Loop)
        assert isinstance(loop, asyncio.AbstractEventLoop)
    finally:
        loop.close()


@pytest.mark.parametrize(
    "cut",
    [asyncio.IncompleteReadError(b"", 4), ConnectionResetError("reset"), asyncio.CancelledError()],
)
def test_a_stream_cut_outside_our_handlers_is_logged_at_debug(
    caplog: pytest.LogCaptureFixture, cut: BaseException
) -> None:
    """What hivemind's connection task raises when a stream is cut (or cancelled at
    shutdown) before our handler has it: no ERROR, no traceback."""
    loop = new_event_loop()
    try:
        with caplog.at_level(logging.DEBUG):
            loop.call_exception_handler({"message": "Exception in callback", "exception": cut})
    finally:
        loop.close()
    assert [r.levelno for r in caplog.records] == [logging.DEBUG]


def test_any_other_exception_is_still_an_error_with_its_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    loop = new_event_loop()
    try:
        with caplog.at_level(logging.DEBUG):
            loop.call_exception_handler({"message": "a bug", "exception": KeyError("bug")})
    finally:
        loop.close()
    assert [r.levelno for r in caplog.records] == [logging.ERROR]
    assert caplog.records[0].exc_info is not None


async def waiter(event: asyncio.Event, deadline_s: float) -> None:
    """What the part server and matchmaking do: wait for a condition that stays false, on
    an event each change sets, until a deadline."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + deadline_s
    while (remaining := deadline - loop.time()) > 0:
        event.clear()
        await wait_set(event, remaining)


def test_a_cancel_that_arrives_as_the_event_is_set_ends_the_wait() -> None:
    async def main() -> None:
        event = asyncio.Event()
        task = asyncio.create_task(waiter(event, 3.0))
        await asyncio.sleep(0.01)  # it waits
        event.set()  # the event's waiter is woken ...
        task.cancel()  # ... and cancelled in the same turn of the loop
        # with the cancel lost, the waiter returns normally at its deadline instead
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())


def test_waits_until_set_or_the_timeout() -> None:
    async def main() -> tuple[bool, bool]:
        event = asyncio.Event()
        asyncio.get_running_loop().call_later(0.05, event.set)
        return await wait_set(event, 5.0), await wait_set(asyncio.Event(), 0.05)

    assert asyncio.run(main()) == (True, False)


@pytest.fixture
def running() -> Iterator[tuple[asyncio.AbstractEventLoop, list[dict[str, Any]]]]:
    """A loop running in a thread, as a swarm's, and what its exception handler was given."""
    loop = new_event_loop()
    reported: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _, context: reported.append(context))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop, reported
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    loop.close()


async def _turns_its_cancel_into_an_error(started: threading.Event) -> None:
    started.set()
    try:
        await asyncio.sleep(30)
    except asyncio.CancelledError:
        raise RuntimeError("the DHT process ended") from None


def test_a_call_given_up_ends_quietly_whatever_it_raises(running: Any) -> None:
    """Cancelled by its caller, a coroutine that turns the cancel into an error (a Python
    3.11 ``wait_for`` dropping it, then a helper that ended as the node stopped): nothing
    reaches the loop's exception handler when its task is collected. With
    ``asyncio.run_coroutine_threadsafe`` the handler gets "Task exception was never
    retrieved", which asyncio prints with its traceback."""
    loop, reported = running
    started = threading.Event()
    future = submit(_turns_its_cancel_into_an_error(started), loop)
    assert started.wait(5)
    future.cancel()
    submit(asyncio.sleep(0), loop).result(5)  # queued after the cancel: the task has ended
    del future  # its callbacks hold the task
    submit(asyncio.sleep(0), loop).result(5)
    gc.collect()
    submit(asyncio.sleep(0), loop).result(5)  # the handler runs on the loop
    assert reported == []


def test_a_call_not_given_up_still_raises_its_error(running: Any) -> None:
    loop, _ = running

    async def fails() -> None:
        raise RuntimeError("the DHT process ended")

    with pytest.raises(RuntimeError, match="the DHT process ended"):
        submit(fails(), loop).result(5)
