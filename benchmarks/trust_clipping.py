"""Cost of norm clipping on honest runs: eval loss with clipping vs the plain mean.

Runs ``diloco-node local`` (streaming, its defaults) for each replica count, seed and clip
factor C (0 is the plain weighted mean), and records, for every chunk every round combined,
the ratio of the largest member norm to the lower median (the reference): clipping at C
fires exactly on the chunks whose ratio exceeds C, so one plain run tells how often any C
would fire; with two replicas, also the cosine of the two contributions. Writes every
summary to a JSON file (with its provenance) and prints a markdown table, then per replica
count and variant the mean and spread over the seeds of the loss
against the plain mean of the same seed.

    nice -n 10 python benchmarks/trust_clipping.py --replicas 2 4 --seeds 0 1 \
        --clip-factors 0 2 3 --out benchmarks/results/trust_clipping.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from diloco.bench.provenance import provenance
from diloco.node.data.corpus import load_corpus
from diloco.node.training.local import LocalConfig, LocalTrainer
from diloco.protocol.core import aggregation, reducer
from diloco.protocol.core.aggregation import Combined

RATIOS: list[float] = []
"""Per combined chunk: largest norm / lower median (the reference), of the current run."""
COSINES: list[float] = []
"""Per combined chunk of two members: the cosine of their two contributions."""


def recording_robust_mean(
    parts: Sequence[torch.Tensor], weights: Sequence[float], clip_factor: float
) -> Combined:
    """``aggregation.robust_mean``, noting each chunk's largest norm over its reference."""
    combined = aggregation.robust_mean(parts, weights, clip_factor)
    ref = sorted(combined.norms)[(len(combined.norms) - 1) // 2]
    if ref > 0:
        RATIOS.append(max(combined.norms) / ref)
        if len(parts) == 2:
            dot = float(torch.dot(parts[0].double(), parts[1].double()))
            COSINES.append(dot / (combined.norms[0] * combined.norms[1]))
    return combined


PLACEBO = False
"""``--placebo``: clipping's scales applied to the members in reverse order."""


def placebo_robust_mean(
    parts: Sequence[torch.Tensor], weights: Sequence[float], clip_factor: float
) -> Combined:
    """A control for a pair: the mean as clipping at ``clip_factor`` would take it, but with
    the scale of the larger contribution applied to the smaller one (a change to the mean
    of the same size that does not aim at the larger member). Other group sizes: as
    ``recording_robust_mean``."""
    combined = recording_robust_mean(parts, weights, clip_factor)
    if len(parts) != 2:
        return combined
    scales = combined.scales[::-1]
    mean = aggregation.weighted_mean(parts, combined.weights, scales)
    return Combined(mean, combined.norms, combined.weights, scales)


def run(config: LocalConfig, corpus: Any, lr_scale: float = 1.0) -> dict[str, Any]:
    RATIOS.clear()
    COSINES.clear()
    summary = LocalTrainer(config, corpus).train()
    ratios, cosines = sorted(RATIOS), sorted(COSINES)
    return {
        "replicas": config.replicas,
        "seed": config.seed,
        "clip_factor": config.clip_factor,
        "lr_scale": lr_scale,
        "placebo": PLACEBO and config.clip_factor > 0,
        "eval_loss": summary["eval_loss"],
        "clipped": summary["clipped_contributions"],
        "combined": summary["combined_contributions"],
        "chunks": len(ratios),
        "ratio_max": ratios[-1],
        "ratio_p99": ratios[int(0.99 * (len(ratios) - 1))],
        "ratio_median": ratios[(len(ratios) - 1) // 2],
        "pair_cosine_min": cosines[0] if cosines else None,
        "pair_cosine_median": cosines[(len(cosines) - 1) // 2] if cosines else None,
        "wall_s": summary["wall_s"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--replicas", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--clip-factors", type=float, nargs="+", default=[0.0, 2.0, 3.0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--eval-batches", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument(
        "--control-lr-scales",
        type=float,
        nargs="*",
        default=[],
        help="also run the plain mean with the outer lr times each of these (a control: how "
        "far the loss moves when the update is only shortened, without clipping)",
    )
    parser.add_argument(
        "--placebo",
        action="store_true",
        help="with two replicas, apply clipping's scale to the smaller contribution instead "
        "of the larger (a control: a change of the same size, not aimed at the larger)",
    )
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    reducer.robust_mean = recording_robust_mean  # type: ignore[assignment]  # measure only
    if args.placebo:
        global PLACEBO
        PLACEBO = True
        reducer.robust_mean = placebo_robust_mean  # type: ignore[assignment]  # a control

    corpus = load_corpus(None)
    results = []
    variants = [(c, 1.0) for c in args.clip_factors] + [(0.0, s) for s in args.control_lr_scales]
    for replicas in args.replicas:
        for seed in args.seeds:
            for clip_factor, lr_scale in variants:
                config = LocalConfig(
                    replicas=replicas,
                    steps=args.steps,
                    seed=seed,
                    eval_batches=args.eval_batches,
                    log_every=10**9,
                    clip_factor=clip_factor,
                )
                outer = replace(config.outer, outer_lr=config.outer.outer_lr * lr_scale)
                config = replace(config, outer=outer)
                start = time.perf_counter()
                result = run(config, corpus, lr_scale)
                results.append(result)
                print(
                    f"M={replicas} seed {seed} C={clip_factor:g} lr x{lr_scale:g}: "
                    f"eval {result['eval_loss']:.4f} "
                    f"clipped {result['clipped']}/{result['combined']} "
                    f"norm ratio max {result['ratio_max']:.3f} p99 {result['ratio_p99']:.3f} "
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
    print(
        "\n| M | seed | C | outer lr | eval loss | vs plain | clipped / combined | norm ratio max |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    plain = {
        (r["replicas"], r["seed"]): r["eval_loss"]
        for r in results
        if r["clip_factor"] == 0 and r["lr_scale"] == 1
    }
    for r in results:
        base = plain.get((r["replicas"], r["seed"]))
        diff = f"{100 * (r['eval_loss'] / base - 1):+.3f}%" if base else ""
        print(
            f"| {r['replicas']} | {r['seed']} | {r['clip_factor']:g} | x{r['lr_scale']:g} | "
            f"{r['eval_loss']:.4f} | "
            f"{diff} | {r['clipped']} / {r['combined']} | {r['ratio_max']:.3f} |"
        )
    print_spread(results, plain)


def print_spread(results: list[dict[str, Any]], plain: dict[tuple[int, int], float]) -> None:
    """Per replica count and variant (clip factor, outer lr scale): mean, sample standard
    deviation, min and max over the seeds of the loss against the plain mean of the same
    seed, in percent."""
    print("\n| M | C | outer lr | seeds | vs plain: mean | std | min | max |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    variants = sorted({(r["clip_factor"], r["lr_scale"]) for r in results} - {(0.0, 1.0)})
    for replicas in sorted({r["replicas"] for r in results}):
        for clip_factor, lr_scale in variants:
            diffs = [
                100 * (r["eval_loss"] / plain[(replicas, r["seed"])] - 1)
                for r in results
                if r["replicas"] == replicas
                and (r["clip_factor"], r["lr_scale"]) == (clip_factor, lr_scale)
                and (replicas, r["seed"]) in plain
            ]
            if not diffs:
                continue
            std = statistics.stdev(diffs) if len(diffs) > 1 else float("nan")
            print(
                f"| {replicas} | {clip_factor:g} | x{lr_scale:g} | {len(diffs)} | "
                f"{statistics.mean(diffs):+.3f}% | {std:.3f}% | {min(diffs):+.3f}% | "
                f"{max(diffs):+.3f}% |"
            )


if __name__ == "__main__":
    main()
