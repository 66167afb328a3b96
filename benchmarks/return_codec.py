"""The second quantisation: which codec the reducers send the mean back in.

Two measurements. ``error``: M members' outer gradients (1M Gaussian values each) go
through ``InProcessReducer`` (the swarm's wire path: E3M0 up, FP32 mean, the return codec
down); relative L2 error and cosine of the result against the exact FP32 mean of the raw
vectors. ``loss``: streaming runs of ``diloco-node local`` (the settings of
``local_methods.py``) for each return codec and replica count, eval loss of the outer
weights and bytes per replica; each run is appended to ``--out`` as one JSON line as soon
as it ends, so a long sweep can be stopped and its table printed (``--table``).

    python benchmarks/return_codec.py error
    python benchmarks/return_codec.py loss --replicas 2 4 8 --steps 300 --seeds 0 \
        --out benchmarks/results/return_codec.jsonl
    python benchmarks/return_codec.py table --out benchmarks/results/return_codec.jsonl
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from diloco.bench.provenance import provenance
from diloco.codecs import get_codec
from diloco.node.config import return_codec_for
from diloco.node.data.corpus import load_corpus
from diloco.node.training.inner import InnerConfig
from diloco.node.training.local import LocalConfig, LocalTrainer
from diloco.node.training.outer_config import OuterConfig
from diloco.protocol.core.reducer import Contribution, InProcessReducer, RoundKey

RETURN_CODECS = ("e3m0", "int8", "bf16", "none")


def error(numel: int, replicas: list[int], seed: int) -> list[dict[str, Any]]:
    """Relative error and cosine of the round's result against the exact mean."""
    codec = get_codec("e3m0")
    rows = []
    for m in replicas:
        generator = torch.Generator().manual_seed(seed)
        deltas = [torch.randn(numel, generator=generator) for _ in range(m)]
        exact = torch.stack(deltas).mean(0)
        contributions = [Contribution(f"m{i}", d, 1.0) for i, d in enumerate(deltas)]
        for name in RETURN_CODECS:
            reducer = InProcessReducer(codec, return_codec_for(name, codec, "nearest"))
            result = reducer.reduce(RoundKey(0, 1), contributions).result()
            rows.append(
                {
                    "replicas": m,
                    "return_codec": name,
                    "rel_error": ((result.delta - exact).norm() / exact.norm()).item(),
                    "cosine": torch.nn.functional.cosine_similarity(
                        result.delta, exact, dim=0
                    ).item(),
                    "bytes_sent_per_member": result.bytes_sent,
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    return rows


def loss(args: argparse.Namespace) -> None:
    corpus = load_corpus(None)
    for seed in args.seeds:
        for m in args.replicas:
            for name in args.codecs:
                config = LocalConfig(
                    replicas=m,
                    steps=args.steps,
                    batch_size=8,
                    seq_len=64,
                    fragment_size=1,
                    taus=[1],
                    codec="e3m0",
                    return_codec=name,
                    eval_batches=32,
                    log_every=10**9,
                    seed=seed,
                    inner=InnerConfig(lr=1e-3, warmup_steps=30),
                    outer=OuterConfig(
                        sync_every=30,
                        outer_lr=0.7,
                        outer_momentum=0.9,
                        fragment_sync_delay=1,
                        fragment_update_alpha=0.5,
                    ),
                )
                start = time.perf_counter()
                summary = LocalTrainer(config, corpus).train()
                row = {
                    "replicas": m,
                    "return_codec": name,
                    "seed": seed,
                    "steps": args.steps,
                    "eval_loss": summary["eval_loss"],
                    "bytes_sent_per_replica": summary["bytes_sent_per_replica"],
                    "rounds_pending": summary["rounds_pending"],
                    "wall_s": time.perf_counter() - start,
                    "provenance": provenance(),
                }
                with args.out.open("a") as f:
                    f.write(json.dumps(row) + "\n")
                print(json.dumps(row), flush=True)


def table(path: Path) -> None:
    """Markdown: eval loss (mean over seeds) and MB sent per replica, per M and codec."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    by: dict[tuple[int, str], list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        by[(r["replicas"], r["return_codec"])].append(r)
    print("| M | return codec | seeds | eval loss | vs e3m0 | MB sent per replica |")
    print("|---:|---|---:|---:|---:|---:|")
    order = sorted(by.items(), key=lambda kv: (kv[0][0], RETURN_CODECS.index(kv[0][1])))
    for (m, name), runs in order:
        mean = sum(r["eval_loss"] for r in runs) / len(runs)
        base = by.get((m, "e3m0"), [])
        seeds = {r["seed"] for r in runs} & {r["seed"] for r in base}
        rel = ""
        if seeds:
            ours = sum(r["eval_loss"] for r in runs if r["seed"] in seeds)
            theirs = sum(r["eval_loss"] for r in base if r["seed"] in seeds)
            rel = f"{100 * (ours / theirs - 1):+.2f}%"
        mb = runs[0]["bytes_sent_per_replica"] / 1e6
        print(f"| {m} | {name} | {len(runs)} | {mean:.4f} | {rel} | {mb:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("what", choices=["error", "loss", "table"])
    parser.add_argument("--replicas", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--codecs", nargs="+", default=list(RETURN_CODECS))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--numel", type=int, default=1_000_000)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/return_codec.jsonl"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.what == "error":
        error(args.numel, args.replicas, seed=0)
    elif args.what == "loss":
        loss(args)
    else:
        table(args.out)


if __name__ == "__main__":
    main()
