"""The event loop of a node's swarm thread: uvloop where it is installed, else asyncio's.

uvloop (libuv) runs the protocol's many small stream reads and writes with less overhead
than asyncio's pure-Python selector loop; hivemind depends on it and runs its own DHT
process on it. Measured on the loopback all-reduce (benchmarks/RESULTS.md, "Seeing the
swarm"): it is kept because it does not lose.
"""

from __future__ import annotations

import asyncio


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A new loop, not installed as any thread's current loop."""
    try:
        import uvloop
    except ImportError:  # e.g. Windows, which uvloop does not support
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()
