"""Loop the protocol's swarm tests on busy cores and count the streams cut in transport.

"The cut streams": on two busy cores a libp2p stream between peers sometimes
ended early. This script reproduces the conditions: one busy-loop process per core, the
protocol's multi-process tests run ``--runs`` times in a row without reruns, the peers
logging at DEBUG. Tests that kill a peer or cut a stream on purpose are left out, so every
stream that ends early is unexpected; the script counts, per run, their log lines (a
member's part stream cut, a reducer's PART stream cut, a JOIN that failed in transport)
and says whether a test failed. Run it under the heavy
lock of a shared machine; it takes about 2.5 minutes per run on two cores::

    flock /tmp/diloco-heavy.lock python benchmarks/stream_cuts.py --runs 3 --log-dir /tmp/cuts

Add ``--p2pd-log "error,p2pd=debug"`` for the daemons' own log lines (``GOLOG_LOG_LEVEL``).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

TESTS = ["tests/protocol/test_allreduce.py", "tests/protocol/test_matchmaking.py"]
TESTS += ["tests/protocol/test_swarm.py"]
SKIP = "not killed and not dead_leader and not cut"
"""The tests that end streams on purpose (pytest -k)."""
CUT = re.compile(r"stream cut \(|PART stream of member \d+ cut:|JOIN to \S+ failed:")


def count_cuts(log: str) -> list[str]:
    """The log lines of streams that ended early."""
    return [line for line in log.splitlines() if CUT.search(line)]


def run_once(log_path: Path, p2pd_log: str | None, timeout: float) -> tuple[int, list[str]]:
    """One pass of the tests; returns pytest's exit code and the cut-stream lines."""
    env = {**os.environ, "DILOCO_TEST_LOG_LEVEL": "DEBUG"}
    if p2pd_log:
        env["GOLOG_LOG_LEVEL"] = p2pd_log
    command = [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider"]
    command += ["-m", "swarm", "-k", SKIP, *TESTS]
    with log_path.open("w") as log:
        code = subprocess.run(
            command, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout
        ).returncode
    return code, count_cuts(log_path.read_text(errors="replace"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="passes of the tests, e.g. 3")
    parser.add_argument("--log-dir", type=Path, required=True, help="where run_N.log go")
    parser.add_argument("--p2pd-log", help='GOLOG_LOG_LEVEL for p2pd, e.g. "error,p2pd=debug"')
    parser.add_argument("--busy", type=int, default=os.cpu_count() or 1, help="busy processes")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    args = parser.parse_args(argv)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    spin = [sys.executable, "-c", "while True: pass"]
    busy = [subprocess.Popen(spin) for _ in range(args.busy)]
    failed = 0
    try:
        for n in range(1, args.runs + 1):
            code, cuts = run_once(args.log_dir / f"run_{n}.log", args.p2pd_log, args.timeout)
            failed += code != 0
            print(f"run {n}: pytest exit {code}, {len(cuts)} cut streams", flush=True)
            for line in cuts:
                print("   ", line[:200], flush=True)
    finally:
        for process in busy:
            process.kill()
            process.wait()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
