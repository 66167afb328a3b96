"""Method comparison: dp vs diloco vs streaming (vs one replica alone), equal tokens.

Runs the in-process trainer (``diloco.node.training.local``) for each method and replica count,
writes every summary to a JSON file and prints a markdown table.

    python benchmarks/local_methods.py --replicas 2 4 --steps 300 \
        --out benchmarks/results/methods_300.json
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from diloco.bench.provenance import provenance
from diloco.node.data.corpus import load_corpus
from diloco.node.training.inner import InnerConfig
from diloco.node.training.local import LocalConfig, LocalTrainer
from diloco.node.training.outer_config import OuterConfig


def run(config: LocalConfig, corpus: Any) -> dict[str, Any]:
    summary = LocalTrainer(config, corpus).train()
    return {k: v for k, v in summary.items() if k != "config"} | {"label": label(config)}


def label(config: LocalConfig) -> str:
    if config.method == "dp":
        return f"dp M={config.replicas}"
    if config.replicas == 1 and config.outer.fragment_update_alpha == 1.0:
        return "single replica"
    return f"{config.method} M={config.replicas} codec={config.codec_name}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--replicas", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--H", type=int, default=30)
    parser.add_argument("--outer-lr", type=float, default=0.4)
    parser.add_argument("--outer-momentum", type=float, default=0.9)
    parser.add_argument("--inner-lr", type=float, default=4e-4)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--methods", nargs="+", default=["single", "dp", "diloco", "streaming"])
    parser.add_argument("--eval-batches", type=int, default=16)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (1 avoids OpenMP spinning on a shared machine)",
    )
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    corpus = load_corpus(None)
    base = LocalConfig(
        preset=args.preset,
        steps=args.steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        fragment_size=1,
        taus=[1],
        codec="e3m0",
        eval_batches=args.eval_batches,
        log_every=10**9,
        inner=InnerConfig(lr=args.inner_lr, warmup_steps=args.warmup),
        outer=OuterConfig(
            sync_every=args.H,
            outer_lr=args.outer_lr,
            outer_momentum=args.outer_momentum,
            fragment_sync_delay=1,
            fragment_update_alpha=0.5,
        ),
    )
    results = []
    for seed in args.seeds:
        for replicas in args.replicas:
            configs = {
                "single": replace(
                    base,
                    replicas=1,
                    seed=seed,
                    outer=replace(base.outer, fragment_update_alpha=1.0),
                ),
                "dp": replace(base, method="dp", replicas=replicas, seed=seed),
                "diloco": replace(
                    base,
                    method="diloco",
                    replicas=replicas,
                    seed=seed,
                    codec="none",
                    outer=replace(base.outer, fragment_update_alpha=None),
                ),
                "streaming": replace(base, replicas=replicas, seed=seed),
            }
            for method in args.methods:
                if method == "single" and replicas != args.replicas[0]:
                    continue
                start = time.perf_counter()
                result = run(configs[method], corpus) | {"seed": seed}
                results.append(result)
                print(
                    f"{result['label']:<32} seed {seed}  eval {result['eval_loss']:.4f}  "
                    f"replicas {result['eval_loss_replicas']:.4f}  "
                    f"sent {result['bytes_sent_per_replica'] / 1e6:9.3f} MB  "
                    f"peak {result['peak_bytes_per_step'] / 1e6:7.3f} MB  "
                    f"({time.perf_counter() - start:.0f} s)",
                    flush=True,
                )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "args": vars(args) | {"out": str(args.out)},
                "results": results,
                "provenance": provenance(),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
