"""A node's helper processes end with it however it ends: the parent watch, the death
signal of spawned children, and a real Swarm (DHT process + p2pd) whose owner is SIGKILLed.

Every scenario runs in a fresh interpreter in its own session (``_Owner``), which the test
SIGKILLs as the OOM killer would; the test then polls /proc for what is left (generous
bound, no timing threshold). Processes a failing test leaves are killed by PID.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import pickle
import signal
import struct
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing import resource_sharer
from multiprocessing.connection import Client
from multiprocessing.process import current_process
from pathlib import Path

import pytest
from hivemind.utils.mpfuture import MPFuture

from diloco.protocol.runtime.processes import (
    HelperEnded,
    TiedDHT,
    WholeMessages,
    quiet_helper_disconnects,
)

GONE_BOUND_S = 30.0
"""Generous bound for a process to end once its owner is gone (typically about 1 s)."""


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in "ZX"


def children(pid: int) -> list[int]:
    """Running children of ``pid``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and alive(int(entry.name)):
            try:
                stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if stat[1] == str(pid):
                found.append(int(entry.name))
    return found


def wait_gone(pids: list[int]) -> list[int]:
    """Those of ``pids`` still running after ``GONE_BOUND_S`` seconds (empty: all ended)."""
    deadline = time.monotonic() + GONE_BOUND_S
    while (left := [pid for pid in pids if alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def held_unix_sockets() -> set[str]:
    """Paths of unix sockets that some running process holds open."""
    inodes = set()
    for entry in Path("/proc").glob("[0-9]*/fd/*"):
        try:
            link = os.readlink(entry)
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[len("socket:[") : -1])
    lines = Path("/proc/net/unix").read_text().splitlines()[1:]
    return {f[7] for f in map(str.split, lines) if len(f) == 8 and f[6] in inodes}


class _Owner:
    """A Python process (``code``) in its own session; reads the PIDs it prints."""

    def __init__(self, code: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(code)],
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.started: list[int] = []

    def read_pid(self) -> int:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        assert line.strip().isdigit(), f"owner printed {line!r}, exit {self.process.poll()}"
        self.started.append(int(line))
        return int(line)

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(10)

    def clean_up(self) -> None:
        if self.process.poll() is None:
            self.kill()
        for pid in self.started:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def owners() -> Iterator[list[_Owner]]:
    started: list[_Owner] = []
    yield started
    for owner in started:
        owner.clean_up()


def start(owners: list[_Owner], code: str) -> _Owner:
    owner = _Owner(code)
    owners.append(owner)
    return owner


def test_end_with_parent_runs_cleanup_and_exits_when_parent_is_killed(
    owners: list[_Owner], tmp_path: Path
) -> None:
    marker = tmp_path / "cleaned"
    owner = start(
        owners,
        f"""
        import os, time
        from diloco.protocol.runtime import parent_end
        parent = os.getpid()
        if (child := os.fork()) == 0:
            parent_end.end_with_parent(parent, lambda: open({str(marker)!r}, "w").close())
            time.sleep(600)
            os._exit(1)
        print(child, flush=True)
        time.sleep(600)
        """,
    )
    child = owner.read_pid()
    assert alive(child)
    owner.kill()
    assert not wait_gone([child])
    assert marker.exists()


def test_end_with_parent_counts_a_parent_gone_before_the_watch(
    owners: list[_Owner], tmp_path: Path
) -> None:
    marker = tmp_path / "cleaned"
    owner = start(
        owners,
        f"""
        import os, time
        from diloco.protocol.runtime import parent_end
        parent = os.getpid()
        if (child := os.fork()) == 0:
            while os.getppid() == parent:
                time.sleep(0.05)
            parent_end.end_with_parent(parent, lambda: open({str(marker)!r}, "w").close())
            time.sleep(600)
            os._exit(1)
        print(child, flush=True)
        time.sleep(600)
        """,
    )
    child = owner.read_pid()
    owner.kill()
    assert not wait_gone([child])
    assert marker.exists()


SPAWN_SLEEP = """
    import asyncio, os, threading, time, uvloop
    from diloco.protocol.runtime import parent_end

    async def spawn():  # as hivemind starts p2pd
        process = await asyncio.subprocess.create_subprocess_exec("sleep", "600")
        print(process.pid, flush=True)

    def run():
        with parent_end.children_end_with_this_process():
            {run}

    {main}
    time.sleep(600)
"""


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_children_end_with_this_process_gives_spawned_children_a_death_signal(
    owners: list[_Owner], loop: str
) -> None:
    owner = start(owners, SPAWN_SLEEP.format(run=f"{loop}.run(spawn())", main="run()"))
    child = owner.read_pid()
    assert alive(child)
    owner.kill()
    assert not wait_gone([child])


def test_spawned_children_are_out_of_reach_of_a_terminals_ctrl_c(
    owners: list[_Owner],
) -> None:
    """p2pd leads a session and process group of its own: Ctrl-C, which a terminal sends
    to its foreground process group (the node's), does not stop it before the node."""
    owner = start(owners, SPAWN_SLEEP.format(run="asyncio.run(spawn())", main="run()"))
    child = owner.read_pid()
    assert os.getsid(child) == child and os.getpgid(child) == child
    assert os.getpgid(child) != os.getpgid(owner.process.pid)


def test_children_end_with_this_process_leaves_children_of_other_threads_alone(
    owners: list[_Owner],
) -> None:
    """The death signal fires when the forking *thread* ends: a child started from a
    thread that then ends must keep running (its process still lives)."""
    main = "thread = threading.Thread(target=run); thread.start(); thread.join()\n"
    main += "    time.sleep(0.3); print(os.getpid(), flush=True)"
    owner = start(owners, SPAWN_SLEEP.format(run="asyncio.run(spawn())", main=main))
    child = owner.read_pid()
    owner.read_pid()  # printed 0.3 s after its spawning thread ended (a death signal is at once)
    assert alive(child)


def test_children_end_with_this_process_restores_the_spawn_function() -> None:
    import asyncio

    from diloco.protocol.runtime import parent_end

    original = asyncio.subprocess.create_subprocess_exec
    with parent_end.children_end_with_this_process():
        assert asyncio.subprocess.create_subprocess_exec is not original
    assert asyncio.subprocess.create_subprocess_exec is original


def test_whole_messages_waits_for_a_body_written_after_its_length() -> None:
    """A message over 16 KiB goes down the DHT's pipe as two writes; read as hivemind
    leaves the pipe (non-blocking), the body's late bytes must be waited for, not fail
    the read with EAGAIN (which killed a DHT process of the protocol tests)."""
    reader, writer = multiprocessing.Pipe(duplex=False)
    os.set_blocking(reader.fileno(), False)
    message = ("_store", [], {"value": b"x" * 100_000})
    body = pickle.dumps(message)
    os.write(writer.fileno(), struct.pack("!i", len(body)))

    def write_body() -> None:
        time.sleep(0.2)  # the owner preempted between its two writes
        view = memoryview(body)
        while view:
            view = view[os.write(writer.fileno(), view) :]

    thread = threading.Thread(target=write_body)
    thread.start()
    pipe = WholeMessages(reader)
    try:
        assert pipe.poll(5.0)
        assert pipe.recv() == message
        assert not os.get_blocking(reader.fileno())  # as the event loop set it
    finally:
        thread.join()
        pipe.close()
        writer.close()


SWARM_OWNER = """
    import os, threading, time
    from diloco.protocol.runtime.network import NetworkOptions
    from diloco.protocol.wire.run_id import make_run_id
    from diloco.protocol.swarm import Swarm

    def start():
        global swarm
        net = NetworkOptions(host_maddrs=("/ip4/127.0.0.1/tcp/0",))
        swarm = Swarm(make_run_id("orphans", {}), net)

    # Started from a thread that then ends: the DHT process must live on regardless.
    thread = threading.Thread(target=start); thread.start(); thread.join()
    time.sleep(1)
    print(swarm.dht.pid, flush=True)
    time.sleep(600)
"""


def _swarm(owners: list[_Owner]) -> tuple[_Owner, int, int, set[str]]:
    """A Swarm in its own process: (owner, DHT process, p2pd, p2pd's socket paths)."""
    owner = start(owners, SWARM_OWNER)
    dht = owner.read_pid()
    (p2pd,) = children(dht)
    owner.started.append(p2pd)
    sockets = {path for path in held_unix_sockets() if "/hivemind-p2pd-" in path}
    cmdline = Path(f"/proc/{p2pd}/cmdline").read_text()
    mine = {path for path in sockets if path in cmdline}
    assert len(mine) == 1, (sockets, cmdline)
    assert alive(dht) and alive(p2pd)
    return owner, dht, p2pd, mine


@pytest.mark.swarm
def test_swarm_helpers_end_when_its_process_is_killed(owners: list[_Owner]) -> None:
    owner, dht, p2pd, sockets = _swarm(owners)
    owner.kill()
    assert not wait_gone([dht, p2pd])
    assert not [path for path in sockets if Path(path).exists()]
    assert not sockets & held_unix_sockets()


@pytest.mark.swarm
def test_p2pd_ends_when_its_dht_process_is_killed(owners: list[_Owner]) -> None:
    """As when the OOM killer picks the DHT process: nothing runs in it to stop p2pd."""
    owner, dht, p2pd, sockets = _swarm(owners)
    os.kill(dht, signal.SIGKILL)
    assert not wait_gone([dht, p2pd])
    assert owner.process.poll() is None
    assert not [path for path in sockets if Path(path).exists()]


async def _stall(_dht: object, _node: object) -> None:
    """A DHT-process coroutine that never answers in time (a stalled DHT process)."""
    await asyncio.sleep(3600)


def _in_thread(call: Callable[[], object]) -> BaseException | None:
    """Run ``call`` in a thread; what it raised (None: it returned). A call still waiting
    after ``GONE_BOUND_S`` fails the test instead of hanging it."""
    raised: list[BaseException | None] = []

    def run() -> None:
        try:
            call()
        except BaseException as error:
            raised.append(error)
        else:
            raised.append(None)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(GONE_BOUND_S)
    assert raised, f"still waiting on the DHT process after {GONE_BOUND_S} s"
    return raised[0]


@pytest.fixture
def tied_dht() -> Iterator[TiedDHT]:
    dht = TiedDHT(
        start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False, auto_nat=False
    )
    yield dht
    dht.kill()
    dht.join(10)
    for pid in children(os.getpid()):  # p2pd, if its death signal did not get it
        if "p2pd" in Path(f"/proc/{pid}/cmdline").read_text():
            os.kill(pid, signal.SIGKILL)
    # hivemind's MPFuture shares one multiprocessing lock with every process forked from
    # this one; a DHT process killed while it held that lock leaves it taken for ever, and the
    # next DHT forked from this test process hangs reporting that it is ready. Fresh locks
    # for the forks to come (a node never forks a DHT again after killing one).
    MPFuture.reset_backend()


@pytest.mark.swarm
def test_a_call_to_a_killed_dht_process_fails_instead_of_waiting_for_ever(
    tied_dht: TiedDHT,
) -> None:
    assert tied_dht.get_visible_maddrs()  # answers while it runs
    os.kill(tied_dht.pid, signal.SIGKILL)
    assert isinstance(_in_thread(tied_dht.get_visible_maddrs), HelperEnded)


@pytest.mark.swarm
def test_a_call_to_a_stalled_dht_process_fails_at_its_deadline(tied_dht: TiedDHT) -> None:
    tied_dht.call_timeout = 1.0
    assert isinstance(_in_thread(lambda: tied_dht.run_coroutine(_stall)), HelperEnded)
    assert tied_dht.is_alive()


@pytest.mark.swarm
def test_calls_after_the_pipe_closed_fail_as_helper_ended(tied_dht: TiedDHT) -> None:
    """A node stopping closes the pipe to its DHT process while rounds still call it: each
    call fails with ``HelperEnded`` (a round then fails in one line), not a pipe error."""
    tied_dht._outer_pipe.close()  # what hivemind's shutdown does, the process still alive
    assert tied_dht.is_alive()
    for call in (
        lambda: tied_dht.get("k", return_future=True),
        lambda: tied_dht.store("k", b"v", expiration_time=1e12, return_future=True),
        lambda: tied_dht.run_coroutine(_stall, return_future=True),
    ):
        with pytest.raises(HelperEnded, match="takes no more calls"):
            call()


_CALL_WITHOUT_SHARED_MEMORY = textwrap.dedent(
    """
    import os, signal, time
    from pathlib import Path
    from hivemind.utils.mpfuture import SharedBytes
    from diloco.protocol.runtime.processes import HelperEnded, TiedDHT

    dht = TiedDHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                  nat_port_map=False, auto_nat=False)
    managers = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_text()
                parent = (entry / "stat").read_text().rsplit(")", 1)[1].split()[1]
            except OSError:
                continue
            program = Path(cmdline.split("\\0")[0]).name
            if program == "torch_shm_manager" and parent == str(os.getpid()):
                os.kill(int(entry.name), signal.SIGTERM)  # as systemd stops every process
                managers.append(int(entry.name))
    assert managers, "no shared-memory manager to end"
    time.sleep(1)
    SharedBytes._buffer = None  # the next call's future needs new shared memory
    try:
        dht.get("k", return_future=True)
    except HelperEnded as error:
        print("HelperEnded:", error)
    dht.shutdown()
    """
)


@pytest.mark.swarm
def test_a_call_after_the_shared_memory_manager_ended_fails_as_helper_ended() -> None:
    """systemd's SIGTERM reaches torch's shared-memory manager too; a round calling the DHT
    after that failed with a RuntimeError ("Broken pipe") and a traceback, not one line."""
    done = subprocess.run(
        [sys.executable, "-c", _CALL_WITHOUT_SHARED_MEMORY],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "HelperEnded: no shared memory" in done.stdout, done.stdout + done.stderr


def test_a_thread_cut_off_from_a_killed_helper_prints_no_traceback(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """multiprocessing's resource sharer thread raised ConnectionResetError when the DHT
    process died with the node (SIGTERM to the group): a traceback on a clean stop."""
    monkeypatch.setattr(threading, "excepthook", threading.__excepthook__)
    quiet_helper_disconnects()

    def fail(error: BaseException) -> None:
        raise error

    for error in (ConnectionResetError(104, "Connection reset by peer"), KeyError("a bug")):
        thread = threading.Thread(target=fail, args=(error,), name="resource-sharer")
        thread.start()
        thread.join()
    err = capsys.readouterr().err
    assert "ConnectionResetError" not in err
    assert "KeyError: 'a bug'" in err  # anything else is printed as before


def test_the_resource_sharers_thread_cut_off_from_a_helper_prints_no_traceback(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real thread: multiprocessing's resource sharer catches what its connection
    raises and reports it through ``sys.excepthook``, living on (a helper that dies while
    it asks for a file descriptor: here a client that hangs up before asking)."""
    monkeypatch.setattr(threading, "excepthook", threading.__excepthook__)
    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)
    quiet_helper_disconnects()
    read, write = os.pipe()
    try:
        shared = resource_sharer.DupFd(read)  # starts the sharer's thread
        address = shared._id[0]  # type: ignore[attr-defined]
        Client(address, authkey=current_process().authkey).close()  # hangs up before asking
        received = shared.detach()  # served after the hung-up connection was dealt with
        os.write(write, b"x")
        assert os.read(received, 1) == b"x"
        os.close(received)
    finally:
        os.close(read)
        os.close(write)
    err = capsys.readouterr().err
    assert "EOFError" not in err and "Traceback" not in err, err

    def report() -> None:
        try:
            raise KeyError("a bug")
        except KeyError:
            sys.excepthook(*sys.exc_info())  # type: ignore[arg-type]

    thread = threading.Thread(target=report)
    thread.start()
    thread.join()
    assert "KeyError: 'a bug'" in capsys.readouterr().err  # anything else still printed
