#!/usr/bin/env bash
# Idempotent set-up: .venv with PyTorch and this package (with its test extra).
# torch is installed first, pinned to 2.13.0 (a CPU wheel on the reference machines); with a
# GPU, install the torch build you want into .venv before running this script.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  echo "creating the virtual environment .venv..."
  "${PYTHON:-python3}" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
if ! python -c "import torch" 2>/dev/null; then
  echo "installing PyTorch 2.13.0 (CPU wheel, ~200 MB; a few minutes)..."
  python -m pip install -q torch==2.13.0
fi
stamp=".venv/.installed-$(sha1sum pyproject.toml | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  echo "installing diloco-node and test tools (hivemind, pytest...)..."
  python -m pip install -q -e ".[test]"
  touch "$stamp"
fi
echo "ready: . .venv/bin/activate, then diloco-node demo"
