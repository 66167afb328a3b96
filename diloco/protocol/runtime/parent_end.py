"""A child process that ends with its parent, however the parent ends: a watch on the
parent (a pidfd, or polls of the parent's PID) and the kernel's death signal for a child
started from asyncio (``PR_SET_PDEATHSIG``), and stopping processes held by pidfd.

Apart from ``processes`` (the DHT process built on these), so that it imports neither
hivemind nor torch: a process that needs no more than this (the tests' owners of
children) starts in a fraction of a second, not after seconds of imports.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import logging
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

logger = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
"""``prctl`` option from <linux/prctl.h>: the signal this process gets when its parent ends."""
PARENT_POLL_INTERVAL = 1.0
"""Seconds between looks at the parent's PID where no pidfd can be waited on."""


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return int(stat.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def child_pidfds(pid: int) -> list[int]:
    """pidfds of the running children of ``pid`` (the caller closes them)."""
    if not hasattr(os, "pidfd_open") or not os.path.isdir("/proc"):
        return []
    pidfds = []
    for name in os.listdir("/proc"):
        if name.isdigit() and _parent(int(name)) == pid:
            with contextlib.suppress(OSError):
                pidfd = os.pidfd_open(int(name))
                if _parent(int(name)) == pid:  # still that child, not a reused PID
                    pidfds.append(pidfd)
                else:
                    os.close(pidfd)
    return pidfds


def stop(pidfds: list[int], grace: float = 0.5) -> bool:
    """Make sure the processes behind ``pidfds`` end: SIGTERM, then SIGKILL after
    ``grace`` seconds; close the pidfds. Returns whether any had to be signalled."""
    signalled = False
    for pidfd in pidfds:
        for sig, wait in ((signal.SIGTERM, 0.0), (signal.SIGKILL, grace)):
            if select.select([pidfd], [], [], wait)[0]:  # readable: the process ended
                break
            signalled = True
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(pidfd, sig)
        else:
            select.select([pidfd], [], [], grace)
        os.close(pidfd)
    return signalled


def end_with_parent(parent: int, cleanup: Callable[[], None]) -> threading.Thread:
    """Once process ``parent`` (this process's parent) has ended, however, run ``cleanup``
    and exit this process. Waits in a daemon thread on a pidfd of the parent, which becomes
    readable when the whole process has ended (not one of its threads), or polls
    ``os.getppid()`` where there is no pidfd. A parent already gone counts as ended."""
    watch = threading.Thread(
        target=_wait_for_parent, args=(parent, cleanup), name="diloco-parent-watch", daemon=True
    )
    watch.start()
    return watch


def _wait_for_parent(parent: int, cleanup: Callable[[], None]) -> None:
    pidfd = None
    with contextlib.suppress(AttributeError, OSError):
        pidfd = os.pidfd_open(parent)
    if os.getppid() == parent:  # still our parent: the pidfd names it, not a reused PID
        if pidfd is not None:
            select.select([pidfd], [], [])
        else:
            while os.getppid() == parent:
                time.sleep(PARENT_POLL_INTERVAL)
    logger.warning("parent %d has ended: process %d cleans up and exits", parent, os.getpid())
    try:
        cleanup()
    finally:
        os._exit(0)


def _prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl: Callable[..., int] = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return prctl


def _end_with(parent: int, prctl: Callable[..., int]) -> None:
    """In a forked child before exec: SIGTERM when ``parent``'s forking thread ends."""
    args = (ctypes.c_ulong(signal.SIGTERM), ctypes.c_ulong(0), ctypes.c_ulong(0))
    if prctl(ctypes.c_int(PR_SET_PDEATHSIG), *args, ctypes.c_ulong(0)) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    if os.getppid() != parent:  # it ended before the death signal was set
        raise ChildProcessError(f"parent {parent} ended")


@contextlib.contextmanager
def children_end_with_this_process() -> Iterator[None]:
    """While active, a process started by ``asyncio.subprocess.create_subprocess_exec`` (not
    the alias ``asyncio.create_subprocess_exec``) from this process's main thread gets
    SIGTERM from the kernel when this process ends; from any thread, it starts in a session
    and process group of its own.

    hivemind starts p2pd exactly so and has no hook for it; hence this wrapper, meant for a
    process of our own (the DHT process), where nothing else spawns. Only the main thread:
    the death signal fires when the *thread* that forked ends, and the main thread lasts as
    long as the process. Elsewhere (or on another thread) the child is started as before.
    """
    original = asyncio.subprocess.create_subprocess_exec
    prctl, here = _prctl(), os.getpid()
    if prctl is None:
        logger.info("no PR_SET_PDEATHSIG on %s: p2pd may outlive a killed node", sys.platform)

    async def create(*args: Any, **kwargs: Any) -> asyncio.subprocess.Process:
        if prctl is not None and threading.current_thread() is threading.main_thread():
            kwargs.setdefault("preexec_fn", functools.partial(_end_with, here, prctl))
        # A session (so a process group) of its own: a terminal's Ctrl-C (SIGINT to the
        # foreground group) reaches the node, which stops p2pd once it has left the swarm.
        kwargs.setdefault("start_new_session", True)
        return await original(*args, **kwargs)

    asyncio.subprocess.create_subprocess_exec = create
    try:
        yield
    finally:
        asyncio.subprocess.create_subprocess_exec = original
