"""Network namespaces for benchmarks: made, throttled, reachable, and always removed.

Needs root and iproute2 (skipped otherwise). Each test uses its own tag, so sets of other
runs on the machine are never touched.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from diloco.bench import netns
from diloco.errors import ConfigError

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
    reason="network namespaces need root and iproute2",
)


def tag(n: int) -> str:
    return f"t{os.getpid() % 10000}{n}"


def namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def links() -> str:
    return subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout


def qdisc(device: str, namespace: str | None = None) -> str:
    prefix = ["ip", "netns", "exec", namespace] if namespace else []
    command = [*prefix, "tc", "qdisc", "show", "dev", device]
    return subprocess.run(command, capture_output=True, text=True, check=True).stdout


def in_namespace(name: str, code: str) -> subprocess.Popen[str]:
    command = ["ip", "netns", "exec", name, sys.executable, "-c", code]
    return subprocess.Popen(command, stdout=subprocess.PIPE, text=True)


def test_hosts_are_throttled_reach_each_other_and_are_removed() -> None:
    t = tag(1)
    with netns.hosts(t, 2, netns.Shaping("8mbit")) as names:
        assert names == [f"dlns{t}-0", f"dlns{t}-1"]
        assert set(names) <= namespaces()
        assert "rate 8Mbit" in qdisc(f"dlp{t}-0", names[0])  # upload
        assert "rate 8Mbit" in qdisc(f"dlh{t}-1")  # download
        server = in_namespace(
            names[1],
            "import socket; s = socket.create_server(('10.77.0.2', 5555)); print('up', flush=True)"
            "; c, a = s.accept(); c.sendall(a[0].encode()); c.close()",
        )
        assert server.stdout is not None and server.stdout.readline().strip() == "up"
        client = in_namespace(
            names[0],
            "import socket; c = socket.create_connection(('10.77.0.2', 5555), timeout=30)"
            "; print(c.recv(100).decode())",
        )
        out, _ = client.communicate(timeout=60)
        server.wait(60)
        assert out.strip() == "10.77.0.1"  # host 0 reached host 1 with its own address
    assert not set(names) & namespaces()
    assert f"{t}-" not in links() and f"dlbr{t}" not in links()


def test_upload_only_leaves_the_bridge_end_alone() -> None:
    t = tag(2)
    with netns.hosts(t, 1, netns.Shaping("8mbit", "64kb", "50ms", upload_only=True)) as names:
        assert "tbf" in qdisc(f"dlp{t}-0", names[0])
        assert "tbf" not in qdisc(f"dlh{t}-0")


def test_a_home_line_uploads_slower_than_it_downloads() -> None:
    t = tag(6)
    with netns.hosts(t, 1, netns.Shaping("20mbit", download_rate="100mbit")) as names:
        assert "rate 20Mbit" in qdisc(f"dlp{t}-0", names[0])  # upload
        assert "rate 100Mbit" in qdisc(f"dlh{t}-0")  # download


def test_hosts_are_removed_when_the_block_fails() -> None:
    t = tag(3)
    with pytest.raises(KeyboardInterrupt), netns.hosts(t, 2, netns.Shaping("8mbit")):
        raise KeyboardInterrupt
    assert not {f"dlns{t}-0", f"dlns{t}-1"} & namespaces()
    assert f"dlbr{t}" not in links()


def test_a_failed_up_removes_what_it_made() -> None:
    t = tag(4)
    subprocess.run(["ip", "netns", "add", f"dlns{t}-1"], check=True)  # in the way of host 1
    with pytest.raises(RuntimeError, match="netns add"):
        netns.up(t, 2, netns.Shaping("8mbit"))
    assert not {f"dlns{t}-0", f"dlns{t}-1"} & namespaces()
    assert f"dlh{t}-0" not in links() and f"dlbr{t}" not in links()


def test_bad_tags_and_counts_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="tag"):
        netns.up("Bad-Tag!", 2, netns.Shaping("8mbit"))
    with pytest.raises(ConfigError, match="hosts"):
        netns.up("ok", 0, netns.Shaping("8mbit"))


def test_command_line_up_prints_the_names_and_down_removes_them() -> None:
    t = tag(5)
    module = [sys.executable, "-m", "diloco.bench.netns"]
    try:
        up = subprocess.run(
            [*module, "up", "--tag", t, "--hosts", "2", "--rate", "8mbit", "--upload-only"],
            capture_output=True,
            text=True,
            check=True,
        )
        assert up.stdout.split() == [f"dlns{t}-0", f"dlns{t}-1"]
        assert "tbf" not in qdisc(f"dlh{t}-0")
    finally:
        subprocess.run([*module, "down", "--tag", t, "--hosts", "2"], check=True)
    assert not {f"dlns{t}-0", f"dlns{t}-1"} & namespaces()
