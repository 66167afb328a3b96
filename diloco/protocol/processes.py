"""The DHT process's p2pd, held by pidfd so that a stalled daemon can be stopped safely.

hivemind starts p2pd as a child of the DHT process. If that process is killed, or stalls
during shutdown, p2pd keeps running. A pidfd taken while p2pd is still the DHT process's
child names that process and no other, so signalling it later can never hit a reused PID
(Linux only; elsewhere nothing is held and nothing is signalled).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal


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
