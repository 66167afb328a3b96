"""benchmarks/gpu_check.sh refuses clearly where there is no GPU (its --dry-run is the CPU
path, run by hand: benchmarks/RESULTS.md)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "gpu_check.sh"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the check would run")
def test_gpu_check_without_cuda_exits_3_and_says_why(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path)}
    done = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=env)
    assert done.returncode == 3, done.stderr
    assert "sees no CUDA device" in done.stderr and "--dry-run" in done.stderr
    assert not list(tmp_path.iterdir())  # nothing half-written
