"""The event loop of a node's swarm thread: uvloop where it is installed, else asyncio's.

uvloop (libuv) runs the protocol's many small stream reads and writes with less overhead
than asyncio's pure-Python selector loop; hivemind depends on it and runs its own DHT
process on it. Measured on the loopback all-reduce (4 peers, 10^7 values, E3M0; six
alternating pairs of runs, benchmarks/RESULTS.md "uvloop for the swarm thread's event
loop"): median 1.02 s per all-reduce with uvloop against 1.15 s with asyncio's loop, so it
stays.
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
