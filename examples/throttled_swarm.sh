#!/usr/bin/env bash
# Three nodes, each in its own network namespace, joined by veth links to a bridge and
# throttled with `tc ... tbf` to RATE (default 100mbit). Root only; namespaces and links are
# removed on exit. Usage: sudo examples/throttled_swarm.sh [RATE] [STEPS] [START FLAGS...]
# e.g. DiLoCo instead of streaming: ... 100mbit 300 --fragment-size 99 --embedding-fragment
# first --tau 0 --codec none. OUT=folder keeps the logs and metrics there.
set -euo pipefail
cd "$(dirname "$0")/.."
rate=${1:-100mbit}; steps=${2:-300}; shift $(( $# < 2 ? $# : 2 ))
[ "$(id -u)" = 0 ] || { echo "run as root (network namespaces and tc need it)" >&2; exit 1; }
. .venv/bin/activate
out=${OUT:-$(mktemp -d)}; mkdir -p "$out"; br=dlbr$$
cleanup() {
  for i in 0 1 2; do ip netns pids dl$$n$i 2>/dev/null | xargs -r kill -INT; done
  sleep 5
  for i in 0 1 2; do ip netns del dl$$n$i 2>/dev/null || true; done
  ip link del $br 2>/dev/null || true
}
trap cleanup EXIT
ip link add $br type bridge && ip link set $br up
for i in 0 1 2; do
  ns=dl$$n$i
  ip netns add $ns
  ip link add v$$h$i type veth peer name v$$n$i
  ip link set v$$n$i netns $ns
  ip link set v$$h$i master $br up
  ip -n $ns addr add 10.77.0.$((i + 1))/24 dev v$$n$i
  ip -n $ns link set v$$n$i up
  ip -n $ns link set lo up
  tc -n $ns qdisc add dev v$$n$i root tbf rate "$rate" burst 64kb latency 50ms
done
ip netns exec dl$$n0 .venv/bin/diloco-node start --name throttled --steps "$steps" \
  --threads 1 --listen /ip4/10.77.0.1/tcp/31337 --metrics-out "$out/node0.jsonl" "$@" \
  > "$out/node0.log" 2>&1 &
until addr=$(grep -m1 '^/ip4/10.77' "$out/node0.log"); do sleep 1; done
for i in 1 2; do
  ip netns exec dl$$n$i .venv/bin/diloco-node join --initial-peers "$addr" --threads 1 \
    --listen /ip4/10.77.0.$((i + 1))/tcp/31337 --metrics-out "$out/node$i.jsonl" \
    > "$out/node$i.log" 2>&1 &
done
wait
grep -h '^done' "$out"/node*.log
echo "metrics in $out"
