"""What each test of a lane costs in wall time and CPU: a pytest plugin, and its summary.

As a plugin (``benchmarks`` on the path), it appends one JSON line per test to the file
``LANE_CPU_OUT`` names: the test's wall time, the machine's busy CPU meanwhile (from
``/proc/stat``: right for a lane run alone, whatever processes its tests start) and the
CPU of the pytest process and its reaped children (``getrusage``: right per xdist worker,
for in-process tests). The first line of a run holds the commit. Run as a script, it sums a
file's lines per test module.

e.g. ``LANE_CPU_OUT=/tmp/nodes.jsonl PYTHONPATH=benchmarks python -m pytest -q -p lane_cpu
-m swarm tests/node`` then ``python benchmarks/lane_cpu.py /tmp/nodes.jsonl``
"""

from __future__ import annotations

import collections
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

TICK = os.sysconf("SC_CLK_TCK")


def machine_busy() -> float:
    """Seconds of CPU the machine spent busy since boot (user, nice, system, irq, softirq;
    not idle, iowait or steal)."""
    with open("/proc/stat") as stat:
        user, nice, system, _, _, irq, softirq = (int(x) for x in stat.readline().split()[1:8])
    return (user + nice + system + irq + softirq) / TICK


def own_cpu() -> float:
    """Seconds of CPU of this process and its reaped children."""
    me, children = (resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return me.ru_utime + me.ru_stime + children.ru_utime + children.ru_stime


def _write(line: dict[str, Any]) -> None:
    with open(os.environ["LANE_CPU_OUT"], "a") as out:
        out.write(json.dumps(line) + "\n")


def pytest_sessionstart(session: pytest.Session) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER") is None:  # once per run, not per worker
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True)
        _write({"commit": commit.stdout.strip(), "argv": sys.argv[1:]})


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    start, busy, own = time.monotonic(), machine_busy(), own_cpu()
    yield
    wall = time.monotonic() - start
    _write(
        {"id": item.nodeid, "wall": round(wall, 2), "machine_cpu": round(machine_busy() - busy, 2)}
        | {"own_cpu": round(own_cpu() - own, 2)}
    )


def main() -> None:
    totals: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0.0])
    with open(sys.argv[1]) as lines:
        for line in map(json.loads, lines):
            if "id" in line:
                sums = totals[line["id"].split("::")[0]]
                for i, key in enumerate(("wall", "machine_cpu", "own_cpu")):
                    sums[i] += line[key]
    print(f"{'module':60s} {'wall':>8s} {'machine':>8s} {'own':>8s}")
    for module, (wall, machine, own) in sorted(totals.items(), key=lambda kv: -kv[1][1]):
        print(f"{module:60s} {wall:8.1f} {machine:8.1f} {own:8.1f}")
    wall, machine, own = (sum(v[i] for v in totals.values()) for i in range(3))
    print(f"{'all':60s} {wall:8.1f} {machine:8.1f} {own:8.1f}")


if __name__ == "__main__":
    main()
