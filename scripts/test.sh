#!/usr/bin/env bash
# Set up if needed, then run the whole test suite (multi-process swarm tests included).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# shellcheck disable=SC1091
. .venv/bin/activate
if [ $# -gt 0 ]; then  # a part of the suite: one process, as asked
  exec python -m pytest -q --durations=30 "$@"
fi
# Three lanes at once. The multi-process swarm tests run in one process: their nodes wait on
# rounds about a third of the time, and a second worker at their priority slowed them and
# made timing-sensitive rounds fail (benchmarks/RESULTS.md "The test suite"). Beside them:
# the in-process tests that run the protocol on the wall clock (marked clocked; mostly
# asleep on its timeouts) in one process at normal priority, since a starved process fails
# their deadlines; and the other in-process tests on two pytest-xdist workers at the idle
# scheduling priority (SCHED_IDLE), which get only CPU time the others leave. The reports
# of the two in-process lanes are printed when all are done, with the slowest tests of each:
# the suite must stay under 8 minutes on 2 cores.
clocked_log="$(mktemp)"
idle_log="$(mktemp)"
idle=(chrt --idle 0)  # SCHED_IDLE (util-linux); where there is no chrt, the lowest nice
command -v chrt >/dev/null || idle=(nice -n 19)
python -m pytest -q -m "clocked and not swarm" --durations=10 >"$clocked_log" 2>&1 &
clocked=$!
"${idle[@]}" python -m pytest -q -m "not swarm and not clocked" -n 2 --durations=15 \
    >"$idle_log" 2>&1 &
idle_lane=$!
# Ctrl-C ends every lane
trap 'kill "$clocked" "$idle_lane" 2>/dev/null || true; rm -f "$clocked_log" "$idle_log"' EXIT
trap 'exit 130' INT TERM
status=0
python -m pytest -q -m swarm --durations=30 || status=$?
for lane in clocked idle_lane; do
    lane_status=0
    wait "${!lane}" || lane_status=$?
    [ "$lane_status" -eq 0 ] || status=$lane_status
done
echo "=== in-process tests on the wall clock (-m \"clocked and not swarm\", beside, normal priority)"
cat "$clocked_log"
echo "=== the other in-process tests (-m \"not swarm and not clocked\", beside, idle priority)"
cat "$idle_log"
exit "$status"
