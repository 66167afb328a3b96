"""A screenshot of `diloco-node dashboard` following a 3-node demo swarm on loopback.

Starts one node and joins two (each its own process, DHT and p2pd; the demo's settings,
with outer-weight evaluations every 30 steps), starts the dashboard on their address, and
when the swarm is near its end renders the page with headless Chromium into a PNG.

    python benchmarks/dashboard_screenshot.py --out benchmarks/figures/dashboard.png
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

NODE = ["--log-every", "25", "--threads", "1", "--eval-every", "30"]
CHROMIUM = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--hide-scrollbars",
    "--virtual-time-budget=3000",
]


def spawn(folder: Path, name: str, *args: str) -> tuple[subprocess.Popen[bytes], Path]:
    log = folder / f"{name}.log"
    with log.open("w") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "diloco", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    return process, log


def wait_line(log: Path, pattern: str, timeout: float = 180.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if match := re.search(pattern, log.read_text()):
            return match.group(1)
        time.sleep(0.5)
    raise SystemExit(f"{log.name}: no {pattern!r}:\n{log.read_text()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/figures/dashboard.png"))
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--at", type=float, default=0.95, help="Share of the run to wait for.")
    opts = parser.parse_args()
    chromium = shutil.which("chromium") or sys.exit("needs chromium (apt install chromium)")
    folder = Path(tempfile.mkdtemp(prefix="diloco-dashboard-"))
    started: list[subprocess.Popen[bytes]] = []
    try:
        first, log = spawn(
            folder,
            "node0",
            "start",
            "--name",
            "demo",
            "--steps",
            str(opts.steps),
            *NODE,
            "--listen",
            "/ip4/127.0.0.2/tcp/0",
        )
        started.append(first)
        address = wait_line(log, r"(?m)^(/ip4/127\.0\.0\.2/\S+)$")
        for i in (1, 2):
            process, _ = spawn(
                folder,
                f"node{i}",
                "join",
                "--initial-peers",
                address,
                *NODE,
                "--listen",
                f"/ip4/127.0.0.{i + 2}/tcp/0",
            )
            started.append(process)
        dashboard, log = spawn(
            folder,
            "dashboard",
            "dashboard",
            "--initial-peers",
            address,
            "--port",
            "0",
            "--listen",
            "/ip4/127.0.0.9/tcp/0",
        )
        started.append(dashboard)
        url = wait_line(log, r"dashboard at (http://\S+/)")
        print(f"dashboard at {url}; logs in {folder}", flush=True)
        while True:
            with urllib.request.urlopen(url + "api/totals", timeout=10) as response:
                totals = json.loads(response.read())
            if totals["global_step"] >= opts.at * opts.steps:
                break
            if any(p.poll() is not None for p in started):
                sys.exit(f"a process ended early; logs in {folder}")
            time.sleep(2.0)
        time.sleep(3.0)  # one more poll of every node's newest records
        opts.out.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [
                chromium,
                *CHROMIUM,
                f"--user-data-dir={folder / 'profile'}",
                "--window-size=1400,1500",
                f"--screenshot={opts.out.resolve()}",
                url,
            ],
            check=True,
            capture_output=True,
            timeout=120,
        )
        print(f"wrote {opts.out} at step {totals['global_step']}")
    finally:
        for process in reversed(started):
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGINT)
        for process in started:
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)


if __name__ == "__main__":
    main()
