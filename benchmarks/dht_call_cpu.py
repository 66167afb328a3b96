"""What one call to a hivemind DHT costs in CPU, every process counted.

Starts two DHTs on loopback (B bootstraps from A; each with its DHT process and p2pd), then
times ``CALLS`` calls of ``get(key, latest=True)``: first on A, whose key it holds itself
(the call crosses only the pipe to its DHT process), then on B (one lookup that asks A
through both p2pds). Prints the CPU seconds of this process and of all its descendants.
hivemind's sharing strategy is read from ``HIVEMIND_MEMORY_SHARING_STRATEGY`` at import
(``file_system`` unless set): run it again with ``file_descriptor`` to compare.

e.g. ``python benchmarks/dht_call_cpu.py 1000``
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import hivemind
from hivemind.utils import get_dht_time

TICK = os.sysconf("SC_CLK_TCK")


def descendants_cpu(root: int) -> float:
    """CPU seconds of the running descendants of ``root`` (not ``root`` itself)."""
    parents: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        parents[int(name)] = int(fields[1])
        cpu[int(name)] = (int(fields[11]) + int(fields[12])) / TICK
    total = 0.0
    for pid in cpu:
        ancestor = parents.get(pid, 0)
        while ancestor > 1 and ancestor != root:
            ancestor = parents.get(ancestor, 0)
        total += cpu[pid] if ancestor == root else 0.0
    return total


def timed(dht: hivemind.DHT, calls: int) -> dict[str, float]:
    me = os.getpid()
    own, helpers = time.process_time(), descendants_cpu(me)
    for _ in range(calls):
        dht.get("key", latest=True)
    return {
        "caller_s": round(time.process_time() - own, 2),
        "helpers_s": round(descendants_cpu(me) - helpers, 2),
    }


def main() -> None:
    calls = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
    options = {"nat_port_map": False, "auto_nat": False, "host_maddrs": ["/ip4/127.0.0.1/tcp/0"]}
    a = hivemind.DHT(start=True, **options)
    peers = [str(addr) for addr in a.get_visible_maddrs()]
    b = hivemind.DHT(start=True, initial_peers=peers, **options)
    try:
        a.store("key", 1, get_dht_time() + 600)
        time.sleep(1.0)
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
        result = {
            "commit": commit,
            "strategy": os.environ.get("HIVEMIND_MEMORY_SHARING_STRATEGY", "file_system"),
            "calls": calls,
            "local": timed(a, calls),
            "remote": timed(b, calls),
        }
        print(json.dumps(result))
    finally:
        b.shutdown()
        a.shutdown()


if __name__ == "__main__":
    main()
