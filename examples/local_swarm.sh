#!/usr/bin/env bash
# A swarm by hand on this machine: `start` one node, then two `join` it with its address.
# Each node is its own process with its own DHT and p2pd, listening on loopback.
# Ctrl-C stops all three (each finishes or abandons its rounds, saves, leaves the swarm).
# Until the joiners arrive node0 is alone: it says so once, and each of its rounds is a
# round of one (its own outer gradient through the outer optimizer: DiLoCo with M = 1), so
# its outer weights improve meanwhile; the joiners download them, and the first round they
# reach forms a group ("a group formed" in node0.log).
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
out=$(mktemp -d)
diloco-node start --name example --steps 600 --threads 1 --checkpoint-dir "$out/ckpt0" \
  --metrics-out "$out/node0.jsonl" > "$out/node0.log" 2>&1 &
pids=($!)
trap 'kill -INT "${pids[@]}" 2>/dev/null; wait' EXIT
until addr=$(grep -m1 '^/ip4/' "$out/node0.log"); do sleep 1; done
echo "node0 at $addr (logs in $out)"
for i in 1 2; do
  diloco-node join --initial-peers "$addr" --threads 1 --metrics-out "$out/node$i.jsonl" \
    > "$out/node$i.log" 2>&1 &
  pids+=($!)
done
tail -f "$out/node0.log" "$out/node1.log" "$out/node2.log" &
pids+=($!)
wait "${pids[0]}"
