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

import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import TimeoutError as FutureTimeout
from multiprocessing.connection import Connection
from types import TracebackType
from typing import Any

from hivemind import DHT

from diloco.protocol.runtime.parent_end import (
    child_pidfds,
    children_end_with_this_process,
    end_with_parent,
    stop,
)

logger = logging.getLogger(__name__)

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
