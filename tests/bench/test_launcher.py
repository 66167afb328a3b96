"""The launcher's children run as ``python ARGV`` would: argv, environment, working
directory, stdin, session, output and exit codes."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import forked_commands
import pytest

from diloco.bench import launcher

pytestmark = pytest.mark.swarm  # a server process: the tier rule


def test_children_run_as_the_interpreter_would_and_report_their_exit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "sibling.py").write_text("VALUE = 'from beside the script'\n")
    script = tmp_path / "peer.py"
    script.write_text(
        "import json, os, sys\n"
        "import sibling\n"
        "print(json.dumps({'argv': sys.argv, 'name': __name__, 'sibling': sibling.VALUE,\n"
        "    'env': os.environ.get('LAUNCHED'), 'cwd': os.getcwd(), 'stdin': sys.stdin.read(),\n"
        "    'session': os.getsid(0) == os.getpid()}))\n"
        "print('to stderr', file=sys.stderr)\n"
        "sys.exit(3)\n"
    )
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    env = {**os.environ, "LAUNCHED": "yes"}
    out, err = tmp_path / "out", tmp_path / "err"
    with out.open("w") as stdout, err.open("w") as stderr:
        child = launcher.spawn([sys.executable, str(script), "x", "y"], stdout, env, stderr)
    assert isinstance(child, launcher.Child)  # forked, not a Popen
    assert child.wait(60) == 3 and child.returncode == 3
    seen = json.loads(out.read_text())
    assert seen == {
        "argv": [str(script), "x", "y"],
        "name": "__main__",
        "sibling": "from beside the script",
        "env": "yes",
        "cwd": str(work),
        "stdin": "",
        "session": True,
    }
    assert err.read_text() == "to stderr\n"

    # -m and -c, an uncaught exception, a signal
    done = forked_commands.run([sys.executable, "-m", "json.tool", "--help"], timeout=60)
    assert done.returncode == 0 and "usage:" in done.stdout and done.stderr == ""
    failed = forked_commands.run(
        [sys.executable, "-c", "import sys; raise ValueError(sys.argv)", "z"]
    )
    assert failed.returncode == 1 and "ValueError: ['-c', 'z']" in failed.stderr
    with (tmp_path / "sleep").open("w") as log:
        sleeper = launcher.spawn([sys.executable, "-c", "import time; time.sleep(60)"], log, env)
    assert sleeper.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        sleeper.wait(0.2)
    sleeper.send_signal(signal.SIGKILL)
    assert sleeper.wait(30) == -signal.SIGKILL
    sleeper.kill()  # reaped: never signals the PID again


def test_other_commands_are_started_as_they_are(tmp_path: Path) -> None:
    with (tmp_path / "out").open("w") as out:
        process = launcher.spawn(["sh", "-c", "echo plain"], out, dict(os.environ))
    assert isinstance(process, subprocess.Popen)
    assert process.wait(30) == 0 and (tmp_path / "out").read_text() == "plain\n"


def test_a_closed_launcher_says_so(tmp_path: Path) -> None:
    mine = launcher.Launcher(preload=())  # imports nothing first: a server is all it needs
    with (tmp_path / "out").open("w") as out:
        child = mine.start([sys.executable, "-c", "import time; time.sleep(60)"], out, {})
        mine.close()
        with pytest.raises(launcher.LauncherError, match="exited"):
            child.wait(10)
        with pytest.raises(launcher.LauncherError):
            mine.start([sys.executable, "-c", "pass"], out, {})
    os.kill(child.pid, signal.SIGKILL)  # now init's child, which reaps it


def test_a_child_asked_for_a_network_namespace_runs_in_it(tmp_path: Path) -> None:
    """A peer of ``ip netns exec NS python ...`` is forked by the same server, then moves
    itself into NS; the others stay in the server's namespace."""
    if sys.platform != "linux" or os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root on Linux and iproute2 (network namespaces)")
    name = f"dllt{os.getpid()}"
    added = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if added.returncode != 0:
        pytest.skip(f"cannot add a network namespace here: {added.stderr.strip()}")
    mine = launcher.Launcher(preload=())
    try:
        code = "import os; print(os.stat('/proc/self/ns/net').st_ino)"
        found = {}
        for where in (name, None):
            with (tmp_path / f"{where}").open("w") as out:
                child = mine.start([sys.executable, "-c", code], out, dict(os.environ), None, where)
            assert child.wait(60) == 0, (tmp_path / f"{where}").read_text()
            found[where] = int((tmp_path / f"{where}").read_text())
        assert found[name] == os.stat(f"/run/netns/{name}").st_ino
        assert found[None] == os.stat("/proc/self/ns/net").st_ino != found[name]
    finally:
        mine.close()
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


LOCKS = (
    "from hivemind.utils.mpfuture import MPFuture, SharedBytes\n"
    "from hivemind.utils.asyncio import _AsyncContextWrapper as Wrapper\n"
    "locks = [MPFuture._update_lock, MPFuture._initialization_lock, SharedBytes._lock,\n"
    "    Wrapper.EXECUTOR_LOCK]\n"
)


def test_a_child_killed_holding_hiveminds_locks_blocks_no_later_child(tmp_path: Path) -> None:
    """hivemind creates process-shared locks at import, which the server did: a DHT process
    SIGKILLed while it sent a result under one must not hang the next peer's DHT."""
    mine = launcher.Launcher(preload=("hivemind",))
    try:
        with (tmp_path / "holder").open("w") as out:
            hold = LOCKS + "[lock.acquire() for lock in locks]\nprint('held', flush=True)\n"
            hold += "import time; time.sleep(600)\n"
            holder = mine.start([sys.executable, "-c", hold], out, dict(os.environ))
        for _ in range(600):
            if (tmp_path / "holder").read_text() == "held\n" or holder.poll() is not None:
                break
            time.sleep(0.1)
        assert (tmp_path / "holder").read_text() == "held\n"
        holder.send_signal(signal.SIGKILL)
        assert holder.wait(30) == -signal.SIGKILL
        with (tmp_path / "next").open("w") as out:
            take = LOCKS + "print([lock.acquire(timeout=2) for lock in locks])\n"
            later = mine.start([sys.executable, "-c", take], out, dict(os.environ))
        assert later.wait(60) == 0
        assert (tmp_path / "next").read_text() == "[True, True, True, True]\n"
    finally:
        mine.close()
