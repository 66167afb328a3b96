"""A process's memory of checks that passed: bounded, the least recently met forgotten first,
and a forked child's copy usable even if the parent's lock was held at the fork."""

from __future__ import annotations

import os
import signal
import threading

from diloco.protocol.trust.remembered import Remembered


def test_the_least_recently_met_key_is_forgotten_first() -> None:
    memory = Remembered(2)
    memory.add("a")
    memory.add("b")
    assert "a" in memory  # met again: now the most recent
    memory.add("c")
    assert "b" not in memory and "a" in memory and "c" in memory
    assert len(memory) == 2


def test_a_child_forked_while_the_lock_is_held_can_use_its_copy() -> None:
    memory = Remembered(4)
    memory.add("kept")
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with memory._lock:
            held.set()
            release.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait(10)
    pid = os.fork()
    if pid == 0:  # the child: its copy of the lock must be free (else SIGALRM ends it)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)  # not pytest-timeout's handler
        signal.alarm(10)
        os._exit(0 if "kept" in memory and memory.add("new") is None else 1)
    release.set()
    holder.join()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
