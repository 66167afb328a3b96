"""Where a command's CPU goes, by kind of process: for the swarm tests, which fill two cores.

Runs the command, reads every process's CPU time in /proc every 0.3 s, and prints, once the
command ends, the wall time and the CPU seconds each kind of process spent meanwhile:
p2pd, torch's shared-memory managers, the peers forked by ``diloco.bench.launcher`` (the
tests' nodes and hostile peers: they have the launcher's command line), their children (DHT
processes) and the launcher's servers, nodes started otherwise (``diloco`` on the command
line) and their children, the protocol tests' peers (started through a forkserver), pytest.
A process that lived less than 0.3 s may be missed; its children's time is not folded
into its own. Exits with the command's status.

e.g. ``python benchmarks/suite_cpu.py python -m pytest -q tests/node/test_healing_attacks.py``
"""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import time

TICK = os.sysconf("SC_CLK_TCK")


def sample(seen: dict[int, tuple[str, int, float]]) -> None:
    """Update ``seen`` (pid -> command line, parent pid, CPU seconds) from /proc."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        pid = int(name)
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # it ended meanwhile
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        cpu = (int(fields[11]) + int(fields[12])) / TICK
        if not command and pid in seen:  # a zombie's command line is empty
            command = seen[pid][0]
        seen[pid] = (command, int(fields[1]), cpu)


def kind(command: str, parent: str, grandparent: str) -> str:
    """The kind of process ``command`` is, from its command line, its ``parent``'s and its
    ``grandparent``'s (a fork has the command line of the process it was forked from)."""
    if "p2pd" in command:
        return "p2pd"
    if "torch_shm_manager" in command:  # one per node: hivemind's futures share memory
        return "torch_shm_manager"
    if "pytest" in command:  # before "diloco": a checkout's path may hold that name
        return "pytest"
    if "multiprocessing.forkserver" in command:  # the protocol tests' peers, and their DHTs
        return "forkserver peer"
    if "diloco.bench.launcher" in command:  # the server, a peer it forked, or the peer's fork
        depth = sum("diloco.bench.launcher" in c for c in (parent, grandparent))
        return ("launcher server", "forked peer", "forked peer's child")[depth]
    for mark, name in (("hostile", "hostile peer"), ("diloco", "node")):
        if mark in command:
            return name + (" child" if mark in parent else "")
    return "other"


def main() -> int:
    if len(sys.argv) < 2:
        print(__doc__)
        return 2
    seen: dict[int, tuple[str, int, float]] = {}
    sample(seen)
    before = {pid: cpu for pid, (_, _, cpu) in seen.items()}
    mine = os.getpid()
    start = time.monotonic()
    process = subprocess.Popen(sys.argv[1:])
    while process.poll() is None:
        sample(seen)
        time.sleep(0.3)
    wall = time.monotonic() - start
    spent: dict[str, float] = collections.defaultdict(float)
    count: collections.Counter[str] = collections.Counter()
    for pid, (command, parent_pid, cpu) in seen.items():
        used = cpu - before.get(pid, 0.0)
        if pid == mine or used <= 0.0:
            continue
        parent, grandparent_pid, _ = seen.get(parent_pid, ("", 0, 0.0))
        name = kind(command, parent, seen.get(grandparent_pid, ("", 0, 0.0))[0])
        spent[name] += used
        count[name] += 1
    print(f"wall {wall:.1f} s, CPU {sum(spent.values()):.1f} s")
    for name, used in sorted(spent.items(), key=lambda item: -item[1]):
        print(f"  {name:18s} {used:7.1f} s  ({count[name]} processes)")
    return process.returncode


if __name__ == "__main__":
    sys.exit(main())
