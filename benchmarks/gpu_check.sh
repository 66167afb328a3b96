#!/usr/bin/env bash
# The GPU check on one CUDA device, in about 5 minutes (at most 8): correctness of
# the asynchronous outer loop on the GPU, node vs plain-loop tokens/s (fp32/TF32, bf16, outer
# state on the device, torch.compile) and E3M0 on the device. Writes gpu_check.json and
# gpu_check.md into $OUT (default ./gpu_check_out).
#
# Runs on a bare machine with this repository and a Python that has torch with CUDA, numpy,
# click and safetensors (no network, no install: the package is used from the source tree;
# hivemind is not needed). Uses $PYTHON, else .venv/bin/python, else python3.
#   bash benchmarks/gpu_check.sh            # needs a GPU; exits 3 without one
#   bash benchmarks/gpu_check.sh --dry-run  # the same code on the CPU, tiny sizes
set -euo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-}"
if [ -z "$py" ]; then
  if [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi
fi
out="${OUT:-$PWD/gpu_check_out}"
dry=()
if [ "${1:-}" = "--dry-run" ]; then dry=(--dry-run); fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export CUBLAS_WORKSPACE_CONFIG=:4096:8  # deterministic cuBLAS for the correctness section
# One interpreter start for both checks (importing torch takes seconds): prints torch's
# version and whether it sees a CUDA device.
if ! probe=$("$py" -c "import numpy, click, safetensors, torch; print(torch.__version__, torch.cuda.is_available())" 2>/dev/null); then
  echo "gpu_check: $py lacks torch, numpy, click or safetensors; set PYTHON to one that has them" >&2
  exit 2
fi
if [ ${#dry[@]} -eq 0 ] && [ "${probe##* }" != "True" ]; then
  echo "gpu_check: torch ${probe% *} sees no CUDA device;" \
    "this check needs one GPU (use --dry-run to test the script on a CPU)" >&2
  exit 3
fi
mkdir -p "$out"
timeout 480 "$py" benchmarks/gpu_check.py --out "$out" ${dry[@]+"${dry[@]}"} 2>&1 | tee "$out/gpu_check.log"
