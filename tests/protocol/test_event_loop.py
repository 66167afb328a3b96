"""The swarm thread's loop: uvloop where installed, asyncio's own otherwise."""

from __future__ import annotations

import asyncio
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
