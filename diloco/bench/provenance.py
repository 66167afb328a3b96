"""Where a benchmark's figures came from: the commit, whether the tree had changes, when, on
what machine and with which torch.

Every script under ``benchmarks/`` that writes JSON puts this under a ``"provenance"`` key, so
a result file can be matched to the code that produced it without trusting the prose around
it (benchmarks/RESULTS.md heads each table with the same facts).
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import torch

TREE = Path(__file__).resolve().parents[2]
"""The source tree of the ``diloco`` package that runs: the code being measured, whatever the
working directory is."""


def _git(root: Path, *args: str) -> str | None:
    """Output of one git command in ``root``; None where git or the repository is missing."""
    try:
        done = subprocess.run(
            ["git", "-C", str(root), *args], capture_output=True, text=True, check=True
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    return done.stdout.strip()


def _cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def provenance(root: Path = TREE) -> dict[str, Any]:
    """Commit (``git rev-parse HEAD`` in ``root``, or "unknown"), ``dirty`` (tracked files
    differ from that commit; False where the commit is unknown), the time in ISO 8601 UTC, the
    machine (platform, CPU model, CPU count) and the torch version."""
    commit = _git(root, "rev-parse", "HEAD")
    status = _git(root, "status", "--porcelain", "--untracked-files=no") if commit else None
    return {
        "commit": commit or "unknown",
        "dirty": bool(status),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "cpu": _cpu_model(),
            "cpus": os.cpu_count(),
        },
        "torch": str(torch.__version__),
    }
