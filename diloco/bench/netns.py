"""Hosts in network namespaces behind throttled links, for benchmarks on one machine (root).

Host ``i`` of a set tagged ``tag`` is the namespace ``dlns{tag}-{i}`` with the address
``10.77.0.{i+1}/24`` on one end of a veth pair (``dlp{tag}-{i}``); the other end
(``dlh{tag}-{i}``) sits on the bridge ``dlbr{tag}``. ``tc tbf`` throttles the host's
upload (the end inside) and, unless ``upload_only``, its download (the end on the bridge),
at ``download_rate`` where given: an asymmetric home line (e.g. 20 Mbit/s up, 100 down).

One helper for every benchmark: ``diloco-node bench allreduce --bandwidth-mbit`` uses
``hosts()`` and ``enter()``; ``examples/throttled_swarm.sh`` calls

    python -m diloco.bench.netns up --tag TAG --hosts 3 --rate 100mbit   # prints the names
    python -m diloco.bench.netns down --tag TAG --hosts 3

``down`` removes whatever of a set exists, so it is safe after a partial ``up``.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

from diloco.errors import ConfigError

SUBNET = "10.77.0"
_CLONE_NEWNET = 0x40000000
_TAG = re.compile(r"^[0-9a-z]{1,6}$")
"""Interface names have at most 15 characters: ``dlh`` + tag + ``-`` + index fits."""
MAX_HOSTS = 99


@dataclass(frozen=True, slots=True)
class Shaping:
    """The ``tc tbf`` of every link (see ``man tc-tbf``)."""

    rate: str
    """Rate per direction in tc's syntax, e.g. ``100mbit``, ``1gbit``."""
    burst: str = "256kb"
    """Bucket size: bytes that may pass at once above the rate."""
    latency: str = "100ms"
    """Longest a packet may wait in the queue before it is dropped."""
    upload_only: bool = False
    """Throttle only what a host sends (its download is then limited by the others' uploads)."""
    download_rate: str | None = None
    """The download's rate where it differs from the upload's (``rate``); None: ``rate``."""


def namespace(tag: str, index: int) -> str:
    return f"dlns{tag}-{index}"


def address(index: int) -> str:
    """Host ``index``'s IPv4 address (without the prefix length)."""
    return f"{SUBNET}.{index + 1}"


def _check(tag: str, count: int) -> None:
    if not _TAG.match(tag):
        raise ConfigError(f"tag {tag!r} must be 1-6 lowercase letters or digits")
    if not 1 <= count <= MAX_HOSTS:
        raise ConfigError(f"need 1 to {MAX_HOSTS} hosts, got {count}")
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        raise ConfigError("network namespaces need root and the iproute2 tools (ip, tc)")


def _run(*command: str) -> None:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"`{' '.join(command)}` failed: {done.stderr.strip()}")


def up(tag: str, count: int, shaping: Shaping) -> list[str]:
    """Create ``count`` hosts; returns their namespaces. On failure removes what it made.

    Raises:
        ConfigError: bad tag or count, not root, or no ``ip``/``tc``.
        RuntimeError: a command failed (e.g. a set with this tag exists already).
    """
    _check(tag, count)
    bridge = f"dlbr{tag}"
    tbf = ["tbf", "burst", shaping.burst, "latency", shaping.latency, "rate"]
    download = shaping.download_rate or shaping.rate
    try:
        _run("ip", "link", "add", bridge, "type", "bridge")
        _run("ip", "link", "set", bridge, "up")
        for index in range(count):
            name = namespace(tag, index)
            outside, inside = f"dlh{tag}-{index}", f"dlp{tag}-{index}"
            _run("ip", "netns", "add", name)
            _run("ip", "link", "add", outside, "type", "veth", "peer", "name", inside)
            _run("ip", "link", "set", inside, "netns", name)
            _run("ip", "link", "set", outside, "master", bridge, "up")
            _run("ip", "-n", name, "addr", "add", f"{address(index)}/24", "dev", inside)
            _run("ip", "-n", name, "link", "set", inside, "up")
            _run("ip", "-n", name, "link", "set", "lo", "up")
            _run("tc", "-n", name, "qdisc", "add", "dev", inside, "root", *tbf, shaping.rate)
            if not shaping.upload_only:
                _run("tc", "qdisc", "add", "dev", outside, "root", *tbf, download)
    except BaseException:
        down(tag, count)
        raise
    return [namespace(tag, index) for index in range(count)]


def down(tag: str, count: int) -> None:
    """Remove the hosts, links and bridge of a set; parts that do not exist are skipped.

    Deleting a namespace deletes the veth end inside it, and with it the pair, once no
    process runs in it.
    """
    _check(tag, count)
    for index in range(count):
        subprocess.run(["ip", "netns", "del", namespace(tag, index)], capture_output=True)
        subprocess.run(["ip", "link", "del", f"dlh{tag}-{index}"], capture_output=True)
    subprocess.run(["ip", "link", "del", f"dlbr{tag}"], capture_output=True)


@contextlib.contextmanager
def hosts(tag: str, count: int, shaping: Shaping) -> Iterator[list[str]]:
    """``up`` for the ``with`` block, ``down`` after it, also on Ctrl-C and SIGTERM."""
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        yield up(tag, count, shaping)
    finally:
        down(tag, count)
        signal.signal(signal.SIGTERM, previous)


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def enter(name: str) -> None:
    """Move the calling process into namespace ``name`` (its later sockets live there)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {name} failed")
    finally:
        os.close(fd)


def link_tx_bytes() -> int:
    """Bytes this process's namespace sent on its veth link (``/proc/self/net/dev``)."""
    with open("/proc/self/net/dev") as f:
        for line in f:
            name, _, counters = line.partition(":")
            if name.strip().startswith("dlp"):
                return int(counters.split()[8])
    return 0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m diloco.bench.netns", description=__doc__)
    parser.add_argument("action", choices=["up", "down"])
    parser.add_argument("--tag", required=True, help="Names the set, e.g. the caller's pid.")
    parser.add_argument("--hosts", type=int, required=True, help="Number of hosts.")
    parser.add_argument("--rate", help="tc rate per direction, e.g. 100mbit (up only).")
    parser.add_argument("--download-rate", help="The download's rate if not --rate's.")
    parser.add_argument("--burst", help="tc tbf burst, e.g. 64kb [default: 256kb].")
    parser.add_argument("--latency", help="tc tbf latency, e.g. 50ms [default: 100ms].")
    parser.add_argument("--upload-only", action="store_true", help="Throttle only uploads.")
    args = parser.parse_args(argv)
    try:
        if args.action == "down":
            down(args.tag, args.hosts)
            return
        if not args.rate:
            parser.error("up needs --rate")
        given = {
            "burst": args.burst,
            "latency": args.latency,
            "download_rate": args.download_rate,
        }
        options = {key: value for key, value in given.items() if value is not None}
        shaping = Shaping(args.rate, upload_only=args.upload_only, **options)
        print("\n".join(up(args.tag, args.hosts, shaping)))
    except (ConfigError, RuntimeError) as error:
        parser.exit(1, f"netns: {error}\n")


if __name__ == "__main__":
    main()
