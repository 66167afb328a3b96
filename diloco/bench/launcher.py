"""Peer processes forked from one warm interpreter instead of started from scratch.

A ``python -m diloco`` process first imports torch, hivemind and the package: about 2 s of
CPU, before it does anything. A benchmark or test that starts dozens of peers on two cores
spends minutes of CPU on those imports, and a peer started while others train takes that
CPU from them. A ``Launcher`` starts one server process that imports all of it once, then
forks a child per peer: the child drops the server's state (its socket, signal handlers),
takes the peer's output file, environment, working directory and session, and runs the
peer's command as the interpreter would (``-m MODULE``, ``-c CODE`` or ``SCRIPT``), so the
peer's code cannot tell the difference, but for the command line in ``/proc`` (the
server's).

The peers are the server's children: it reaps them and reports each exit code, which
``Child`` (the ``subprocess.Popen`` subset the drivers use) waits on. A peer in a network
namespace (``ip netns exec NS python ...``) is forked by the same server and moves itself
into the namespace (``netns.enter``) before it runs: a server of its own in each namespace
imported everything again, 5-8 s of CPU and as many seconds before the peer's start, while
the others waited for it. Other commands cannot be forked: ``spawn`` starts them with
``subprocess.Popen``.

Run as ``python -m diloco.bench.launcher FD [MODULE ...]``, this module is the server; it
imports the modules, then serves the socket ``FD``.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import multiprocessing as mp
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO, Any, NoReturn, Protocol

from diloco.bench import netns

PRELOAD = (
    "torch",
    "torch._dynamo",  # imported by the first optimizer a node builds: 800 modules, sympy's
    "hivemind",
    "diloco.cli",
    "diloco.node.swarm.node",
    "diloco.node.swarm.pinned_run",
)
"""What a server imports by default before it forks: all a node imports at its start."""
_MESSAGE = 1 << 20


class Process(Protocol):
    """What the drivers need of a peer process: ``subprocess.Popen`` and ``Child`` both."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, sig: int) -> None: ...

    def kill(self) -> None: ...


def fork_server(preload: list[str]) -> mp.context.ForkServerContext:
    """A multiprocessing context whose processes fork from a server that imported
    ``preload`` (module names, from the server's own path: Python 3.11's fork server
    ignores the caller's) once: a spawned process imports torch and hivemind itself,
    seconds of CPU each on a loaded machine. The server is a single-threaded interpreter
    that has run nothing else, so forking it is as safe as spawning; it ends with this
    process. The list applies when the server starts, once per process."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(preload)
    return ctx


class LauncherError(RuntimeError):
    """The server is gone, or it could not fork the command."""


def forkable(argv: list[str]) -> bool:
    """Whether ``start`` can run ``argv``: this interpreter with ``-m``, ``-c`` or a script."""
    if len(argv) < 2 or argv[0] != sys.executable:
        return False
    return (argv[1] in ("-m", "-c") and len(argv) > 2) or not argv[1].startswith("-")


def _namespace(argv: list[str]) -> tuple[str | None, list[str]]:
    """The network namespace of an ``ip netns exec NS`` prefix (None: none), and the command
    after it."""
    if argv[:3] == ["ip", "netns", "exec"] and len(argv) > 4:
        return argv[3], argv[4:]
    return None, argv


class Launcher:
    """The client of one server process (``python -m diloco.bench.launcher``) that imported
    ``preload`` (module names) before it forks: 5-8 s of CPU for the default, what a node
    imports."""

    def __init__(self, preload: Sequence[str] = PRELOAD) -> None:
        self._socket, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._server = subprocess.Popen(
            [sys.executable, "-m", __name__, str(theirs.fileno()), *preload],
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        theirs.close()
        self._changed = threading.Condition()
        self._exits: dict[int, int] = {}
        """Child number (the server's count of its forks) -> exit code: a PID may be reused
        (this machine's ``pid_max`` is 32768), a number is not."""
        self._replies: list[dict[str, Any]] = []
        self._closed = False
        self._starting = threading.Lock()
        threading.Thread(target=self._read, name="launcher", daemon=True).start()

    def start(
        self,
        argv: list[str],
        stdout: IO[Any],
        env: dict[str, str],
        stderr: IO[Any] | None = None,
        namespace: str | None = None,
    ) -> Child:
        """Run ``argv`` in a forked child, in a session of its own, with stdin on /dev/null
        and stderr on ``stdout`` unless given, in network namespace ``namespace`` if given
        (root)."""
        if not forkable(argv):
            raise LauncherError(f"not a command of this interpreter: {argv[:3]}")
        request = {"argv": argv[1:], "env": env, "cwd": os.getcwd(), "namespace": namespace}
        with self._starting:
            try:
                outputs = [stdout.fileno(), (stderr or stdout).fileno()]
                socket.send_fds(self._socket, [json.dumps(request).encode()], outputs)
            except OSError as e:
                raise LauncherError(f"the launcher's server is gone: {e}") from e
            with self._changed:
                self._changed.wait_for(lambda: self._replies or self._closed)
                if not self._replies:
                    raise LauncherError("the launcher's server exited")
                reply = self._replies.pop(0)
        if "error" in reply:
            raise LauncherError(reply["error"])
        return Child(self, int(reply["started"]), int(reply["number"]))

    def exit_code(self, number: int, timeout: float | None) -> int | None:
        """Child ``number``'s exit code once the server reaped it (None: not within
        ``timeout``)."""
        with self._changed:
            self._changed.wait_for(lambda: number in self._exits or self._closed, timeout)
            if number not in self._exits and self._closed:
                raise LauncherError("the launcher's server exited")
            return self._exits.get(number)

    def close(self) -> None:
        """End the server (its running children go on, now children of init)."""
        self._socket.shutdown(socket.SHUT_RDWR)  # wakes the reader thread too
        self._socket.close()
        self._server.wait(10)

    def _read(self) -> None:
        while True:
            try:
                data = self._socket.recv(_MESSAGE)
            except OSError:
                data = b""
            with self._changed:
                if not data:
                    self._closed = True
                    self._changed.notify_all()
                    return
                message = json.loads(data)
                if "exited" in message:  # by number
                    self._exits[int(message["exited"])] = int(message["code"])
                else:
                    self._replies.append(message)
                self._changed.notify_all()


@dataclass
class Child:
    """A forked peer: the part of ``subprocess.Popen``'s interface the drivers use."""

    launcher: Launcher
    pid: int
    number: int
    """The server's count of its forks when it forked this child."""
    returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.launcher.exit_code(self.number, 0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self.launcher.exit_code(self.number, timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # as Popen: never signal a PID that may have been reused
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


_shared: list[Launcher] = []
_shared_lock = threading.Lock()


def shared() -> Launcher:
    """This process's launcher, its server started at the first call and ended at exit
    (its children go on, unreported)."""
    with _shared_lock:
        if not _shared:
            _shared.append(Launcher())
            atexit.register(_shared[0].close)
        return _shared[0]


def spawn(
    argv: list[str], stdout: IO[Any], env: dict[str, str], stderr: IO[Any] | None = None
) -> Process:
    """``argv`` forked by the shared launcher if it can be (after ``ip netns exec NS``: into
    that namespace), else a plain ``Popen``; either way in a session of its own, stderr on
    ``stdout`` unless given."""
    namespace, command = _namespace(argv)
    if forkable(command):
        return shared().start(command, stdout, env, stderr, namespace)
    return subprocess.Popen(
        argv,
        stdout=stdout,
        stderr=stderr or subprocess.STDOUT,
        start_new_session=True,
        env=env,
    )


# The server.


@dataclass
class _Request:
    argv: list[str]
    env: dict[str, str]
    cwd: str
    outputs: list[int]
    """stdout's file descriptor, then stderr's."""
    namespace: str | None
    """The network namespace to run in (None: the server's)."""


def _serve(channel: socket.socket) -> _Request | None:
    """Fork a child per request and report each child's exit; returns only in a child (the
    request it runs), or None once the client is gone."""
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # the wakeup fd is what wakes select
    children: dict[int, int] = {}
    """PID -> number of the running children (``forked`` when each was forked)."""
    forked = 0
    while True:
        readable, _, _ = select.select([channel.fileno(), wake_read], [], [])
        if wake_read in readable:
            os.read(wake_read, 4096)
        if not _reap(channel, children):
            return None
        if channel.fileno() not in readable:
            continue
        data, fds, _, _ = socket.recv_fds(channel, _MESSAGE, 2)
        if not data:
            return None
        request = json.loads(data)
        pid = os.fork()
        if pid == 0:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            for fd in (wake_read, wake_write):
                os.close(fd)
            channel.close()
            return _Request(
                request["argv"], request["env"], request["cwd"], fds, request["namespace"]
            )
        for fd in fds:
            os.close(fd)
        forked += 1
        children[pid] = forked
        if not _send(channel, {"started": pid, "number": forked}):
            return None


def _reap(channel: socket.socket, children: dict[int, int]) -> bool:
    """Report every child that ended, by number; False once the client is gone."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return True
        if pid == 0:
            return True
        code = os.waitstatus_to_exitcode(status)
        if not _send(channel, {"exited": children.pop(pid), "code": code}):
            return False


def _send(channel: socket.socket, message: dict[str, int]) -> bool:
    try:
        channel.send(json.dumps(message).encode())
    except OSError:
        return False
    return True


def _own_locks() -> None:
    """Give this (forked) child its own copies of the process-shared locks hivemind creates
    when it is imported (``MPFuture``'s, ``SharedBytes``', its context executor's). Forked
    from the server, every peer would hold the same semaphores: a peer SIGKILLed while it
    held one (a DHT process sends its futures' results under one, many times a second)
    left it held for every later peer, which hung at its DHT's start. A peer started from
    scratch creates its own at import; its helper processes inherit them, as they should."""
    import multiprocessing

    from hivemind.utils import asyncio as hivemind_asyncio
    from hivemind.utils.mpfuture import MPFuture

    MPFuture.reset_backend()  # new _initialization_lock, _update_lock, SharedBytes._lock
    hivemind_asyncio._AsyncContextWrapper.EXECUTOR_LOCK = multiprocessing.Lock()


def _become(request: _Request) -> None:
    """Run the request in this (forked) process as ``python ARGV`` would run it (in its
    network namespace: this process has one thread yet, and its later threads and
    children inherit it)."""
    if request.namespace is not None:
        netns.enter(request.namespace)
    os.setsid()
    _own_locks()
    os.dup2(request.outputs[0], 1)
    os.dup2(request.outputs[1], 2)
    for fd in request.outputs:
        os.close(fd)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.chdir(request.cwd)
    os.environ.clear()
    os.environ.update(request.env)
    flag, *rest = request.argv
    if flag == "-m":
        sys.argv = ["-m", *rest[1:]]
        sys.path[0] = request.cwd
        runpy.run_module(rest[0], run_name="__main__", alter_sys=True)
    elif flag == "-c":
        sys.argv = ["-c", *rest[1:]]
        sys.path[0] = ""
        exec(compile(rest[0], "<string>", "exec"), {"__name__": "__main__"})
    else:
        sys.argv = [flag, *rest]
        sys.path[0] = os.path.dirname(os.path.abspath(flag))
        runpy.run_path(flag, run_name="__main__")


def _exit(code: object) -> NoReturn:
    """End this (forked) child as the interpreter would after ``sys.exit(code)``, less the
    teardown of its modules: the child holds all of the server's (torch, hivemind), and
    freeing them costs about 0.5 s of CPU per peer, with nothing to show for it. What the
    interpreter does before that teardown is done: non-daemon threads are waited for, then
    the ``atexit`` handlers run (multiprocessing's, logging's, the peer's own), and the
    standard streams are flushed."""
    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code
    else:
        print(code, file=sys.stderr)
        status = 1
    threading._shutdown()  # type: ignore[attr-defined]  # what Py_FinalizeEx calls first
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)


def main() -> None:
    channel = socket.socket(fileno=int(sys.argv[1]))
    for module in sys.argv[2:]:
        __import__(module)
    request = _serve(channel)
    if request is None:
        return
    try:
        _become(request)
    except SystemExit as stop:
        _exit(stop.code)
    _exit(0)  # any other exception goes up: the interpreter prints it and exits with 1


if __name__ == "__main__":
    main()
