"""Short-lived commands (``status``, a refused ``join``) forked by the tests' launcher, with
``subprocess.run``'s result."""

from __future__ import annotations

import os
import subprocess
import tempfile

from diloco.bench.launcher import spawn


def run(argv: list[str], timeout: float | None = None) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(argv, capture_output=True, text=True, timeout=timeout)``, forked by
    the shared launcher (the output through temporary files)."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        child = spawn(argv, out, dict(os.environ), err)
        try:
            code = child.wait(timeout)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
            raise
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(argv, code, out.read(), err.read())
