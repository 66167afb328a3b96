"""What the trust checks cost an honest round, in bytes and in time (docs/design.md
"Evidence", "Aggregation bounds").

Bytes, exact, from the real encoders (no network): per node and fragment round in a group of
``m``, what it stores in the DHT (a declaration, its vouch record, its node record: each a
msgpack envelope as ``envelopes.seal`` makes it) in an open swarm and in a closed one (the
record proof, and the declaration's own proof); the vouch record is a trust cost as a whole.
Against it, the round's all-reduce bytes per member (``InProcessReducer``, the run's codec)
and what of them are norms: every AVERAGED chunk carries each member's chunk norm (8 bytes)
and the reducer's block norms (4 bytes per 256 values, for verification), from
``Averaged.body_size``.

Time, in one process, on the same inputs: a round of ``InProcessReducer`` with the trust
rules (``clip_factor`` 1: median weight cap and norm clipping, the default) against the
plain weighted mean (``clip_factor`` 0), the same codec both ways; one check of the
evidence rules as a node runs it per publish (``claims.assess`` over ``n`` nodes' records
and vouches, ``group_target``, the witness ledger of 256 rounds, ``pace.weigh_claims``);
one record proof made and checked (HMAC) against the Ed25519 signature every record has
anyway. Each figure is the median of ``--calls`` calls, repeated ``--repeats`` times: the
median and range of the repeats are printed and written with the provenance.

    nice -n 10 python benchmarks/trust_cost.py --members 2 3 8 \\
        --json benchmarks/results/trust_cost.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import torch

from diloco.bench.provenance import provenance
from diloco.codecs import get_codec
from diloco.node.evidence.claims import Evidence, Schedule, assess, group_target
from diloco.node.evidence.witness import Witness, WitnessedRound
from diloco.node.training.pace import weigh_claims
from diloco.protocol.core.reducer import Contribution, InProcessReducer, RoundKey
from diloco.protocol.core.round import chunk_spans
from diloco.protocol.records.declarations import parse_declaration, prior_tag
from diloco.protocol.records.nodes import (
    MAX_VOUCH_ROUNDS,
    FragmentVersion,
    NodeRecord,
    Vouch,
    nodes_key,
    parse_vouches,
    vouch_key,
    vouch_payload,
)
from diloco.protocol.trust.envelopes import open_envelope, pack_payload, seal
from diloco.protocol.trust.identity import Identity
from diloco.protocol.trust.swarm_key import ClosedSwarm, SwarmKey
from diloco.protocol.wire.part import Averaged
from diloco.protocol.wire.run_id import make_run_id, run_digest

FRAGMENTS, H, STEPS = 5, 30, 3000
"""The run's schedule as ``diloco-node start`` defaults it (F, H) and a long run's T."""
TTL = 60.0


def envelope_bytes(identity: Identity, key: str, payload: bytes, proof: bytes | None) -> int:
    """Bytes of the value the DHT stores: the msgpack envelope (checked by opening it)."""
    expiration = time.time() + TTL
    envelope = seal(identity, key, payload, expiration, proof)
    open_envelope(key, identity.peer_id, envelope, expiration)
    return len(msgpack.packb(envelope, use_bin_type=True))


def declaration_payload(closed: ClosedSwarm | None, key: str, me: str) -> bytes:
    """A declaration as ``declarations.declare_round`` writes it for a node with a prior
    (checked by its parser)."""
    proof = b"" if closed is None else closed.declaration_proof(key, me)
    payload = pack_payload([float(H * 8 * 64), proof, False, prior_tag("ab" * 32)])
    parse_declaration(payload)
    return payload


def stored_bytes(members: int, closed: ClosedSwarm | None, run_id: str) -> dict[str, int]:
    """Per record kind, bytes a node stores per fragment round (see module doc)."""
    ids = [Identity.generate() for _ in range(members)]
    me, names = ids[0], sorted(i.peer_id for i in ids)

    def proof(key: str, payload: bytes) -> bytes | None:
        return None if closed is None else closed.record_proof(key, me.peer_id, payload)

    round_key = f"{run_id}/frag0/round7"
    declaration = declaration_payload(closed, round_key, me.peer_id)
    vouches = [
        Vouch(me.peer_id, 0, k, "cd" * 32, tuple(names)) for k in range(5, 5 + MAX_VOUCH_ROUNDS)
    ]
    vouched = vouch_payload(vouches)
    parse_vouches(vouch_key(run_id, 0), me.peer_id, vouched)
    frags = tuple(FragmentVersion(p, 7, "ef" * 32) for p in range(FRAGMENTS))
    addrs = (f"/ip4/10.0.0.1/tcp/4100/p2p/{me.peer_id}",)
    record = NodeRecord(me.peer_id, addrs, 210, frags, 12345.6, "0.1.0", 0.25)
    node = pack_payload(record.to_wire())
    return {
        "declaration": envelope_bytes(me, round_key, declaration, proof(round_key, declaration)),
        "vouch_record": envelope_bytes(
            me, vouch_key(run_id, 0), vouched, proof(vouch_key(run_id, 0), vouched)
        ),
        "node_record": envelope_bytes(me, nodes_key(run_id), node, proof(nodes_key(run_id), node)),
    }


def contributions(members: int, numel: int) -> list[Contribution]:
    generator = torch.Generator().manual_seed(members)
    return [
        Contribution(f"m{i}", torch.randn(numel, generator=generator) * 1e-3, float(H * 8 * 64))
        for i in range(members)
    ]


def round_bytes(members: int, numel: int, codec: str) -> dict[str, int]:
    """All-reduce bytes a member sends per round, and the norms of its AVERAGED chunks."""
    reducer = InProcessReducer(get_codec(codec), clip_factor=1.0)
    result = reducer.reduce(RoundKey(0, 1), contributions(members, numel)).result()
    part = -(-numel // members)
    chunks = chunk_spans(0, part)
    blocks = sum(-(-(b - a) // 256) for a, b in chunks)
    return {
        "allreduce_sent": result.bytes_sent,
        "member_norms": len(chunks) * 8 * members * (members - 1),
        "block_norms": 4 * blocks * (members - 1),
        "averaged_header": Averaged.body_size(members, 0, 0),
    }


def timed(fn: Callable[[], object], calls: int, repeats: int) -> dict[str, float]:
    """Median seconds of ``calls`` calls, ``repeats`` times: median, min and max of those."""
    medians = []
    for _ in range(repeats):
        seconds = []
        for _ in range(calls):
            start = time.perf_counter()
            fn()
            seconds.append(time.perf_counter() - start)
        medians.append(statistics.median(seconds))
    return {"median": statistics.median(medians), "min": min(medians), "max": max(medians)}


def spread(t: dict[str, float], digits: int) -> str:
    return f"{t['min']:.{digits}f}-{t['max']:.{digits}f}"


def round_times(
    members: int, numel: int, codec: str, calls: int, repeats: int
) -> dict[str, dict[str, float]]:
    """``timed`` for an in-process round with the trust rules (C 1) and with the plain
    mean (C 0), the two taking turns call by call (a shared machine's load hits both)."""
    parts = contributions(members, numel)
    variants = {
        "round, plain mean (C 0)": InProcessReducer(get_codec(codec), clip_factor=0.0),
        "round, trust rules (C 1)": InProcessReducer(get_codec(codec), clip_factor=1.0),
    }
    medians: dict[str, list[float]] = {what: [] for what in variants}
    for _ in range(repeats):
        seconds: dict[str, list[float]] = {what: [] for what in variants}
        for _ in range(calls):
            for what, reducer in variants.items():
                start = time.perf_counter()
                reducer.reduce(RoundKey(0, 1), parts).result()
                seconds[what].append(time.perf_counter() - start)
        for what, s in seconds.items():
            medians[what].append(statistics.median(s))
    return {
        what: {"median": statistics.median(m), "min": min(m), "max": max(m)}
        for what, m in medians.items()
    }


def evidence_check(nodes: int) -> Callable[[], object]:
    """One node's check per publish among ``nodes`` honest nodes that all work together."""
    ids = [Identity.generate().peer_id for _ in range(nodes)]
    me, schedule = ids[0], Schedule(STEPS, H, FRAGMENTS)
    witness = Witness(me)
    for k in range(256):
        weights = {p: float(H * 8 * 64) for p in ids}
        witness.record(
            WitnessedRound(k % FRAGMENTS, k // FRAGMENTS + 1, tuple(ids), "ab" * 32, weights)
        )
    frags = tuple(FragmentVersion(p, 50, "ab" * 32) for p in range(FRAGMENTS))
    records = [NodeRecord(p, (), 1500, frags, 1e4, "0.1.0", 0.25) for p in ids]
    vouches = [
        Vouch(p, f, k, "ab" * 32, tuple(sorted(ids)))
        for p in ids
        for f in range(FRAGMENTS)
        for k in range(48, 51)
    ]
    initial = ["00" * 32] * FRAGMENTS

    def check() -> object:
        evidence = Evidence(me, witness.workers(), frozenset(ids[1:2]), ids[1])
        view = assess(records[1:], vouches, schedule, initial, evidence)
        claims = {r.peer_id: 0.25 for r in records[1:]}
        weigh_claims(claims, witness.weights(), 0.25, 8, 64.0 * H)
        return view, group_target(records, evidence, 2)

    return check


def record_checks(closed: ClosedSwarm, key: str) -> dict[str, Callable[[], object]]:
    """Per record of 300 bytes: the closed swarm's proof made (by the author) and checked
    (by a reader), against the Ed25519 signature made and checked that every record has."""
    me = Identity.generate()
    payload = pack_payload(["x" * 300])

    def proof() -> object:
        made = closed.record_proof(key, me.peer_id, payload)
        return closed.check(closed.record_proof(key, me.peer_id, payload), made)

    def signature() -> object:
        expiration = time.time() + TTL
        return open_envelope(key, me.peer_id, seal(me, key, payload, expiration), expiration)

    return {
        "record proof: make + check (HMAC-SHA256)": proof,
        "record signature: sign + verify (Ed25519)": signature,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--members", type=int, nargs="+", default=[2, 3, 8])
    parser.add_argument("--numel", type=int, nargs="+", default=[188_736, 4_194_304])
    parser.add_argument("--codec", default="e3m0")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--calls", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--json", type=Path, default=None)
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)
    run_id = make_run_id("trust-cost", {"name": "trust-cost"})
    closed = ClosedSwarm(SwarmKey.generate(), run_digest(run_id))
    out: dict[str, Any] = {"config": vars(opts) | {"json": None}, "bytes": [], "time": []}

    print("| m | record | open (B) | closed (B) |")
    print("|---:|---|---:|---:|")
    for m in opts.members:
        open_, shut = stored_bytes(m, None, run_id), stored_bytes(m, closed, run_id)
        for kind in open_:
            print(f"| {m} | {kind} | {open_[kind]} | {shut[kind]} |")
        for numel in opts.numel:
            wire = round_bytes(m, numel, opts.codec)
            out["bytes"].append(
                {"members": m, "numel": numel, "open": open_, "closed": shut} | wire
            )
            print(
                f"| {m} | all-reduce sent per member, {numel} values | {wire['allreduce_sent']} "
                f"(member norms {wire['member_norms']}, block norms {wire['block_norms']}) | |"
            )

    print("\n| m | values | what | median s | range s |")
    print("|---:|---:|---|---:|---:|")
    for m in opts.members:
        for numel in opts.numel:
            for what, t in round_times(m, numel, opts.codec, opts.calls, opts.repeats).items():
                out["time"].append({"members": m, "numel": numel, "what": what} | t)
                print(f"| {m} | {numel} | {what} | {t['median']:.4f} | {spread(t, 4)} |")
        t = timed(evidence_check(m), opts.calls * 10, opts.repeats)
        out["time"].append({"members": m, "what": "evidence check"} | t)
        print(f"| {m} | | evidence check | {t['median']:.6f} | {spread(t, 6)} |")
    for what, fn in record_checks(closed, nodes_key(run_id)).items():
        t = timed(fn, opts.calls * 100, opts.repeats)
        out["time"].append({"what": what} | t)
        print(f"| | | {what} | {t['median']:.7f} | {spread(t, 7)} |")
    if opts.json:
        opts.json.parent.mkdir(parents=True, exist_ok=True)
        opts.json.write_text(json.dumps(out | {"provenance": provenance()}, indent=1))


if __name__ == "__main__":
    main()
