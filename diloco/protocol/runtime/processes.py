"""The helper processes of a node (the DHT process and its p2pd): they end with the node,
however it ends, and a stalled one can be stopped safely.

hivemind forks the DHT process from the node and the DHT process starts p2pd. Neither
notices by itself when its parent is gone: after a SIGKILL of the node (as the OOM killer
sends) both would run on for ever, serving in the swarm and holding sockets. So
``TiedDHT``'s process watches the node and, once it is gone, stops p2pd and exits; and
p2pd gets SIGTERM from the kernel when the DHT process ends (``PR_SET_PDEATHSIG``), also
when that one is killed outright.

A pidfd taken while p2pd is still the DHT process's child names that process and no other,
so signalling it later can never hit a reused PID. pidfds and the death signal are Linux
only; elsewhere the watch polls the parent's PID and p2pd gets no death signal (logged).

p2pd runs in a session and process group of its own, so a signal to the node's process
group (Ctrl-C, ``kill -TERM -PGID``, ``timeout``) reaches the node and the DHT process, not
p2pd: the node leaves the swarm, then stops p2pd (which, stopped first, would leave with an
error line and hold up the DHT process's shutdown; docs/design.md "Watching a run"). A
signal to each of the node's processes (systemd) reaches the helpers too: SIGTERM ends the
DHT process and p2pd at once (and SIGTERM to the group ends the DHT process, then p2pd by
its death signal). So no wait of the node on the DHT process is without a deadline: a call
to a DHT process that has ended fails within ``ALIVE_POLL_INTERVAL``, one that is stalled
after ``DHT_CALL_TIMEOUT``, and the node still saves and leaves.
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
from concurrent.futures import TimeoutError as FutureTimeout
from multiprocessing.connection import Connection
from types import TracebackType
from typing import Any

from hivemind import DHT

logger = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
"""``prctl`` option from <linux/prctl.h>: the signal this process gets when its parent ends."""
PARENT_POLL_INTERVAL = 1.0
"""Seconds between looks at the parent's PID where no pidfd can be waited on."""
DHT_CALL_TIMEOUT = 30.0
"""Seconds a blocking call to the DHT process waits for its answer."""
ALIVE_POLL_INTERVAL = 0.2
"""Seconds between two looks at whether the DHT process still runs, during a call."""


def quiet_helper_disconnects() -> None:
    """Threads of this process that serve its helper processes (multiprocessing's resource
    sharer: file descriptors of shared tensors) raise ``ConnectionError`` or ``EOFError``
    when a helper is killed with the node, e.g. by SIGTERM to the whole process group;
    Python would print each as a traceback while the node stops cleanly. Such endings are
    logged at debug; any other exception of a thread is printed as before.

    Both hooks: a thread that dies of the exception goes through ``threading.excepthook``,
    but the resource sharer's thread catches it and lives on, reporting it through
    ``sys.excepthook`` (only the main thread's own errors keep the default there)."""
    default = threading.excepthook
    default_sys = sys.excepthook

    def hook(args: threading.ExceptHookArgs) -> None:
        if isinstance(args.exc_value, (ConnectionError, EOFError)):
            name = args.thread.name if args.thread is not None else "a thread"
            logger.debug("%s ended: %r", name, args.exc_value)
            return
        default(args)

    def sys_hook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        thread = threading.current_thread()
        if isinstance(value, (ConnectionError, EOFError)) and thread is not threading.main_thread():
            logger.debug("%s cut off: %r", thread.name, value)
            return
        default_sys(kind, value, tb)

    threading.excepthook = hook
    sys.excepthook = sys_hook


class HelperEnded(RuntimeError):
    """The DHT process ended (or stalled) while the node waited for its answer."""


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


class WholeMessages:
    """The DHT process's end of its command pipe, read one whole message at a time.

    hivemind's ``DHT.run`` watches the pipe with uvloop's ``add_reader``, which makes the
    descriptor non-blocking, and reads a message once ``poll()`` sees its first bytes. The
    owner writes a message over 16 KiB as two writes (length, then body); on busy cores
    the body can come later, the read fails with EAGAIN after the length was consumed,
    and the next read starts mid-message: the DHT process dies (``EOFError``) and every
    later call of its owner waits for ever (seen in the protocol tests on two loaded
    cores; hivemind PR #660). Reading in blocking mode waits for the rest instead.
    """

    def __init__(self, connection: Connection) -> None:
        self.connection = connection

    def fileno(self) -> int:
        return self.connection.fileno()

    def poll(self, timeout: float | None = 0.0) -> bool:
        return self.connection.poll(timeout)

    def recv(self) -> Any:
        fd = self.connection.fileno()
        blocking = os.get_blocking(fd)
        os.set_blocking(fd, True)
        try:
            return self.connection.recv()
        finally:
            os.set_blocking(fd, blocking)

    def close(self) -> None:
        self.connection.close()


class TiedDHT(DHT):  # type: ignore[misc]  # hivemind ships no type hints
    """A ``hivemind.DHT`` whose process and p2pd end with the process that started it.

    Its process watches the starting process (``end_with_parent``): once that has ended,
    by SIGKILL too, it stops p2pd, removes the daemon's and its p2p client's sockets and
    exits, within about a second. p2pd also gets SIGTERM when the DHT process ends
    (``children_end_with_this_process``). A clean ``shutdown`` is unchanged. Arguments
    are ``hivemind.DHT``'s. (The node's own p2p client socket, a file of the node, stays
    behind after a SIGKILL of the node, held by no process.)
    """

    call_timeout = DHT_CALL_TIMEOUT
    """Seconds ``run_coroutine`` waits for an answer (hivemind's waits for ever)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._owner_pid = os.getpid()  # before the fork: in the child the parent may be gone
        super().__init__(*args, **kwargs)

    def run_coroutine(self, coro: Any, return_future: bool = False) -> Any:
        """hivemind's, but a blocking call has a deadline (``call_timeout``) and fails
        within ``ALIVE_POLL_INTERVAL`` once the DHT process has ended: hivemind's waits on
        a dead process for ever (also behind ``get_visible_maddrs``, ``peer_id`` and
        ``replicate_p2p``).

        Raises:
            HelperEnded: the DHT process ended, takes no more calls (its pipe is closed: a
                node stopping), or gave no answer in time.
        """
        with self._calling():
            future = super().run_coroutine(coro, return_future=True)
        if return_future:
            return future
        deadline = time.monotonic() + self.call_timeout
        while True:
            try:
                return future.result(min(ALIVE_POLL_INTERVAL, deadline - time.monotonic()))
            except FutureTimeout:
                if not self.is_alive() or time.monotonic() >= deadline:
                    future.cancel()
                    ended = "has ended" if not self.is_alive() else "gave no answer in time"
                    raise HelperEnded(f"the DHT process {self.pid} {ended}") from None

    def get(self, *args: Any, **kwargs: Any) -> Any:
        """hivemind's; raises ``HelperEnded`` when the DHT process takes no more calls."""
        with self._calling():
            return super().get(*args, **kwargs)

    def store(self, *args: Any, **kwargs: Any) -> Any:
        """hivemind's; raises ``HelperEnded`` when the DHT process takes no more calls."""
        with self._calling():
            return super().store(*args, **kwargs)

    @contextlib.contextmanager
    def _calling(self) -> Iterator[None]:
        """Send a call to the DHT process: one that has ended, or whose pipe closed under
        the call (the node is stopping), fails with ``HelperEnded``, not a pipe error."""
        if not self.is_alive():
            raise HelperEnded(f"the DHT process {self.pid} has ended")
        try:
            yield
        except (OSError, EOFError) as exc:
            raise HelperEnded(f"the DHT process {self.pid} takes no more calls ({exc!r})") from exc
        except RuntimeError as exc:
            # A call's future lives in shared memory; once torch's shared-memory manager
            # has ended (systemd's SIGTERM reaches every process of the node), making one
            # fails with "Broken pipe". Every call sent here returns its future without
            # waiting, so no error of the call itself can arrive in this block.
            raise HelperEnded(f"no shared memory for a call to the DHT process ({exc!r})") from exc

    def run(self) -> None:
        end_with_parent(self._owner_pid, self._orphaned)
        pipe: Connection = self.__dict__["_inner_pipe"]  # hivemind's, before its loop
        self.__dict__["_inner_pipe"] = WholeMessages(pipe)
        with children_end_with_this_process():
            super().run()

    def _orphaned(self) -> None:
        """In the DHT process, whose owner has ended: stop p2pd, remove the sockets."""
        stop(child_pidfds(os.getpid()))
        p2p = getattr(getattr(self, "_node", None), "p2p", None)
        # What hivemind's P2P._terminate removes; that one runs on the (maybe busy) loop.
        for name in ("_daemon_listen_maddr", "_client_listen_maddr"):
            with contextlib.suppress(OSError, TypeError, KeyError):
                os.remove(getattr(p2p, name)["unix"])
