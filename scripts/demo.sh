#!/usr/bin/env bash
# Set up if needed, then run the demo (pass extra options through, e.g. --steps 200).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# shellcheck disable=SC1091
. .venv/bin/activate
exec diloco-node demo "$@"
