#!/usr/bin/env bash
# Build the Dockerfile with podman on a Debian base made here, then run `--help` and a
# two-container swarm (host network, loopback addresses) to its end; print the build time,
# the image size and the swarm's summary. For a root shell on a Debian host without access
# to a container registry (apt install podman runc debootstrap):
#   - the base is `debootstrap --variant=minbase bookworm` (with python3 and venv, which
#     the public python:3.11-slim base has) from the mirror apt uses, `podman import`ed;
#   - `podman --runtime runc` (crun refuses some hosts' cgroups), with raised ulimits;
#   - pip in the build gets the host's CA bundle as the secret "ca" (an index behind a
#     TLS-inspecting proxy) and the torch CPU wheel pip resolves here, bind-mounted.
# Environment: WORK (scratch folder), MIRROR, CA, TORCH_VERSION, KEEP=1 keeps the images.
set -euo pipefail
cd "$(dirname "$0")/.."

WORK=${WORK:-/var/tmp/diloco-container}
MIRROR=${MIRROR:-$(grep -h '^URIs:' /etc/apt/sources.list.d/*.sources 2>/dev/null | head -1 | awk '{print $2}')}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
CA=${CA:-/etc/ssl/certs/ca-certificates.crt}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
BASE=localhost/debian:bookworm-python
IMAGE=localhost/diloco-node:check
PODMAN=(podman --runtime runc)
LIMITS=(--ulimit nofile=20000:20000 --ulimit nproc=32768:32768)
mkdir -p "$WORK/wheels" "$WORK/out"
rm -f "$WORK"/out/*.jsonl

started=$(date +%s)
if ! "${PODMAN[@]}" image exists "$BASE"; then
    echo "== base image: debootstrap bookworm from $MIRROR"
    rm -rf "$WORK/rootfs"
    debootstrap --variant=minbase --include=python3,python3-venv bookworm "$WORK/rootfs" "$MIRROR" >"$WORK/debootstrap.log"
    rm -rf "$WORK"/rootfs/var/cache/apt/archives/*.deb "$WORK"/rootfs/var/lib/apt/lists/*
    tar -C "$WORK/rootfs" -c . | "${PODMAN[@]}" import - "$BASE" >/dev/null
    rm -rf "$WORK/rootfs"
fi
base_done=$(date +%s)

echo "== the torch CPU wheel pip resolves on this host"
wheel=$(find "$WORK/wheels" -name "torch-${TORCH_VERSION}*.whl" | head -1)
if [ -z "$wheel" ]; then
    python3 -m pip download -q --disable-pip-version-check "torch==${TORCH_VERSION}" --no-deps -d "$WORK/wheels"
    wheel=$(find "$WORK/wheels" -name "torch-${TORCH_VERSION}*.whl" | head -1)
fi
torch_pin=$(basename "$wheel" | cut -d- -f2)  # e.g. 2.13.0+cpu
echo "$(basename "$wheel")"

echo "== build (base $BASE)"
"${PODMAN[@]}" build -q --network host "${LIMITS[@]}" \
    --build-arg BASE="$BASE" \
    --build-arg TORCH_FROM="--find-links /wheels" \
    --build-arg TORCH="torch==${torch_pin}" \
    --secret id=ca,src="$CA" \
    --volume "$WORK/wheels:/wheels:ro" \
    -t "$IMAGE" . >/dev/null
built=$(date +%s)
size=$("${PODMAN[@]}" image inspect --format '{{.Size}}' "$IMAGE")
base_size=$("${PODMAN[@]}" image inspect --format '{{.Size}}' "$BASE")
torch_size=$("${PODMAN[@]}" run --rm "${LIMITS[@]}" --entrypoint sh "$IMAGE" -c \
    'du -sb /opt/venv/lib/python3*/site-packages/torch | cut -f1')
echo "build: $((built - base_done)) s (base image: $((base_done - started)) s)"
echo "image: $(numfmt --to=si "$size")B ($size bytes; base $(numfmt --to=si "$base_size")B, torch $(numfmt --to=si "$torch_size")B)"

echo "== diloco-node --help"
"${PODMAN[@]}" run --rm "${LIMITS[@]}" "$IMAGE" --help | head -5

echo "== a two-container swarm on the host network"
run=(--name seen --steps 90 --seq-len 32 --batch-size 4 --log-every 30 --threads 1)
a=$("${PODMAN[@]}" run -d --network host "${LIMITS[@]}" -v "$WORK/out:/out" "$IMAGE" \
    start "${run[@]}" --listen /ip4/127.0.0.21/tcp/0 --metrics-out /out/a.jsonl)
b=""
cleanup() {
    "${PODMAN[@]}" rm -f -t 5 "$a" ${b:+"$b"} >/dev/null 2>&1 || true
    if [ "${KEEP:-0}" != 1 ]; then "${PODMAN[@]}" rmi -f "$IMAGE" >/dev/null 2>&1 || true; fi
}
trap cleanup EXIT
address=""
for _ in $(seq 120); do
    address=$("${PODMAN[@]}" logs "$a" 2>/dev/null | grep -m1 '^/ip4/127.0.0.21/' || true)
    [ -n "$address" ] && break
    sleep 1
done
[ -n "$address" ] || { "${PODMAN[@]}" logs "$a"; exit 1; }
b=$("${PODMAN[@]}" run -d --network host "${LIMITS[@]}" -v "$WORK/out:/out" "$IMAGE" \
    join --initial-peers "$address" --listen /ip4/127.0.0.22/tcp/0 --threads 1 \
    --log-every 30 --metrics-out /out/b.jsonl)
status_a=$("${PODMAN[@]}" wait "$a")
status_b=$("${PODMAN[@]}" wait "$b")
for c in "$a" "$b"; do "${PODMAN[@]}" logs "$c" 2>&1 | grep -E '^(run |joined|done at)' || true; done
swarm_done=$(date +%s)
python3 - "$WORK/out/a.jsonl" "$WORK/out/b.jsonl" <<'EOF'
import json, sys
summaries = []
for path in sys.argv[1:]:
    records = [json.loads(line) for line in open(path) if line.strip()]
    summaries.append(next(r for r in records if r["event"] == "summary"))
for name, s in zip("ab", summaries):
    print(f"node {name}: step {s['step']}, eval loss {s['eval_loss']:.4f}, "
          f"sent {s['bytes_sent']:,} B, failed rounds {s['failed_rounds']}, versions {s['versions']}")
same = summaries[0]["outer_sha256"] == summaries[1]["outer_sha256"]
print(f"bit-identical outer states: {'yes' if same else 'NO'}")
sys.exit(0 if same else 1)
EOF
echo "swarm: exit codes $status_a $status_b, $((swarm_done - built)) s; total $((swarm_done - started)) s"
[ "$status_a" = 0 ] && [ "$status_b" = 0 ]
