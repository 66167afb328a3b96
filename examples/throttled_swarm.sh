#!/usr/bin/env bash
# Three nodes, each in its own network namespace, joined by veth links to a bridge; each
# node's upload throttled with `tc ... tbf` to RATE (default 100mbit). Root only; namespaces
# and links are removed on exit (diloco/bench/netns.py makes and removes them).
# Usage: sudo examples/throttled_swarm.sh [RATE] [STEPS] [START FLAGS...]
# e.g. DiLoCo instead of streaming: ... 100mbit 300 --fragment-size 99 --embedding-fragment
# first --tau 0 --codec none. OUT=folder keeps the logs and metrics there.
set -euo pipefail
cd "$(dirname "$0")/.."
rate=${1:-100mbit}; steps=${2:-300}; shift $(( $# < 2 ? $# : 2 ))
[ "$(id -u)" = 0 ] || { echo "run as root (network namespaces and tc need it)" >&2; exit 1; }
. .venv/bin/activate
out=${OUT:-$(mktemp -d)}; mkdir -p "$out"; tag=$(( $$ % 100000 ))
netns() { .venv/bin/python -m diloco.bench.netns "$1" --tag "$tag" --hosts 3 "${@:2}"; }
names=$(netns up --rate "$rate" --burst 64kb --latency 50ms --upload-only)
mapfile -t ns <<< "$names"
cleanup() {
  for n in "${ns[@]}"; do ip netns pids "$n" 2>/dev/null | xargs -r kill -INT; done
  sleep 5
  netns down
}
trap cleanup EXIT
ip netns exec "${ns[0]}" .venv/bin/diloco-node start --name throttled --steps "$steps" \
  --threads 1 --listen /ip4/10.77.0.1/tcp/31337 --metrics-out "$out/node0.jsonl" "$@" \
  > "$out/node0.log" 2>&1 &
until addr=$(grep -m1 '^/ip4/10.77' "$out/node0.log"); do sleep 1; done
for i in 1 2; do
  ip netns exec "${ns[$i]}" .venv/bin/diloco-node join --initial-peers "$addr" --threads 1 \
    --listen /ip4/10.77.0.$((i + 1))/tcp/31337 --metrics-out "$out/node$i.jsonl" \
    > "$out/node$i.log" 2>&1 &
done
wait
grep -h '^done' "$out"/node*.log
echo "metrics in $out"
