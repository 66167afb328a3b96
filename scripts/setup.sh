#!/usr/bin/env bash
# Idempotent set-up: .venv with PyTorch and this package (with its test extra).
# torch is installed first, pinned to 2.13.0 (a CPU wheel on the reference machines); with a
# GPU, install the torch build you want into .venv before running this script.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then "${PYTHON:-python3}" -m venv .venv; fi
# shellcheck disable=SC1091
. .venv/bin/activate
python -c "import torch" 2>/dev/null || python -m pip install -q torch==2.13.0
stamp=".venv/.installed-$(sha1sum pyproject.toml | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  python -m pip install -q -e ".[test]"
  touch "$stamp"
fi
