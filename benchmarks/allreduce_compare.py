"""All-reduce benchmark for RESULTS.md: ours (e3m0, none) against hivemind's averager (fp16).

Runs ``diloco.bench.allreduce.run_allreduce_bench`` for each configuration on loopback and,
with ``--bandwidth-mbit``, on throttled per-peer links, and writes one JSON with every
result. Network namespaces need root.

    python benchmarks/allreduce_compare.py --numel 10000000 --rounds 3 --bandwidth-mbit 100 \
        --json benchmarks/results/allreduce.json
"""

from __future__ import annotations

import argparse
import json
import logging

from diloco.bench.allreduce import BenchConfig, run_allreduce_bench, summary
from diloco.bench.provenance import provenance

logger = logging.getLogger(__name__)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--numel", type=int, default=10_000_000)
    parser.add_argument("--bandwidth-mbit", type=float, default=None)
    parser.add_argument("--window", type=float, default=2.0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    cases = [("e3m0", False, None), ("none", False, None), ("fp16", True, None)]
    if args.bandwidth_mbit:
        cases += [("e3m0", False, args.bandwidth_mbit), ("fp16", True, args.bandwidth_mbit)]
    results = []
    for codec, hivemind, bandwidth in cases:
        config = BenchConfig(
            peers=args.peers,
            rounds=args.rounds,
            numel=args.numel,
            codec=codec,
            compare_hivemind=hivemind,
            bandwidth_mbit=bandwidth,
            matchmaking_window=args.window,
        )
        result = run_allreduce_bench(config)
        logger.info("%s\n  bandwidth: %s Mbit/s", summary(result), bandwidth or "loopback")
        results.append(result.to_json() | {"provenance": provenance()})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
