"""The swarm thread's loop: uvloop where installed, asyncio's own otherwise."""

from __future__ import annotations

import asyncio
import logging
import sys

import pytest
import uvloop

from diloco.protocol.runtime.event_loop import new_event_loop


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
