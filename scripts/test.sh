#!/usr/bin/env bash
# Set up if needed, then run the whole test suite (multi-process swarm tests included).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# shellcheck disable=SC1091
. .venv/bin/activate
# Bytecode caches kept even where the environment turns them off (some images set
# PYTHONDONTWRITEBYTECODE): else every interpreter of the suite compiles the package again
# and every pytest process rewrites every test module again, 9 s of CPU for a whole tree.
unset PYTHONDONTWRITEBYTECODE
if [ $# -gt 0 ]; then  # a part of the suite: one process, as asked
  exec python -m pytest -q --durations=30 "$@"
fi
# Three lanes at once. The multi-process tests whose processes train a model (the swarm
# tests of tests/bench, tests/cli and tests/node, the all-reduce bench's included) and the
# 12-peer staged swarm run in one process: they fill about 1.5 of the 2 cores (the staged
# swarm failed once beside them), and a second worker at their priority slowed them and
# made timing-sensitive rounds fail (benchmarks/RESULTS.md "The test suite"). Beside them,
# at normal priority, one process runs the tests that run the protocol on the wall clock
# and train nothing: the in-process ones (marked clocked; mostly asleep on timeouts, which
# a starved process would miss), then the other multi-process ones of the protocol, the
# launcher's, the publisher's (one node mostly waiting on a slow donor) and the run's end's
# (three micro nodes that train 80 steps and mostly wait for one stopped): half a core on
# average. The other in-process tests run on two pytest-xdist workers that get only CPU
# time the others leave: in a session of their own whose autogroup has nice 19, and at the
# idle scheduling priority (SCHED_IDLE). Where the kernel groups tasks by session
# (sched_autogroup, on by default), SCHED_IDLE alone is no lower than any other session:
# each node and each p2pd is a session, and a session that holds only idle tasks still
# gets its full share beside them (benchmarks/RESULTS.md "The test suite"). The beside
# lane's own session gets autogroup nice -5 where that is allowed (root): its in-process
# tests sleep on timeouts and must get the CPU at once when they wake, beside a dozen node
# sessions. The reports of the two beside lanes are printed when all are done, with the
# slowest tests of each: the suite must stay under 8 minutes on 2 cores.
heavy=tests/protocol/test_staged_swarm.py  # 12 peers keep both cores busy
nodes=(tests/bench tests/cli tests/node "$heavy")  # tests/conftest.py: SWARM_FOLDERS
light=(tests/protocol tests/bench/test_launcher.py tests/node/test_publisher.py
    tests/node/test_run_end_swarm.py)
light_log="$(mktemp)"
idle_log="$(mktemp)"
idle=(chrt --idle 0)  # SCHED_IDLE (util-linux); where there is no chrt, the lowest nice
command -v chrt >/dev/null || idle=(nice -n 19)
# A background job of this (non-interactive) shell leads no process group, so setsid makes
# it a session leader in place: $! is the session, and its process group holds its tests.
# `"${session[@]}" NICE COMMAND...` runs COMMAND there at autogroup NICE.
session=(setsid --wait bash -c 'echo "$0" >/proc/self/autogroup 2>/dev/null; exec "$@"')
command -v setsid >/dev/null || session=(bash -c 'exec "$@"')
"${session[@]}" -5 python -m pytest -q -m "clocked or swarm" --durations=15 "${light[@]}" \
    --deselect "$heavy" >"$light_log" 2>&1 &
light_lane=$!
"${session[@]}" 19 "${idle[@]}" python -m pytest -q -m "not swarm and not clocked" -n 2 \
    --durations=15 >"$idle_log" 2>&1 &
idle_lane=$!
# Ctrl-C ends every lane
trap 'kill "$light_lane" "$idle_lane" 2>/dev/null || true
    kill -- -"$light_lane" -"$idle_lane" 2>/dev/null || true
    rm -f "$light_log" "$idle_log"' EXIT
trap 'exit 130' INT TERM
status=0
python -m pytest -q -m swarm --durations=30 "${nodes[@]}" --ignore="${light[1]}" \
    --ignore="${light[2]}" --ignore="${light[3]}" || status=$?
for lane in light_lane idle_lane; do
    lane_status=0
    wait "${!lane}" || lane_status=$?
    [ "$lane_status" -eq 0 ] || status=$lane_status
done
echo "=== beside: the protocol on the wall clock (-m \"clocked or swarm\" ${light[*]} less $heavy)"
cat "$light_log"
echo "=== beside: the other in-process tests (-m \"not swarm and not clocked\", idle priority)"
cat "$idle_log"
exit "$status"
