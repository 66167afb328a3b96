#!/usr/bin/env bash
# Set up if needed, then run the whole test suite (multi-process swarm tests included).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# shellcheck disable=SC1091
. .venv/bin/activate
# Two workers (lanes: tests/conftest.py); the slowest tests listed at the end: the suite
# must stay under 8 minutes on 2 cores.
exec python -m pytest -q -n 2 --dist loadgroup --durations=30 "$@"
