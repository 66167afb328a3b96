"""Ablations: the Streaming DiLoCo paper's findings, reproduced at CPU scale.

Each named sweep is a list of points (a series, an x value, a ``LocalConfig`` and the
summary metric to read); every point runs once per seed with the in-process trainer
(``diloco.node.training.local``). A sweep writes ``abl_<name>.json`` (every run, plus mean and std
per point) and ``abl_<name>.png``. Runs are cached in a JSON-lines file keyed by their full
configuration, so sweeps that share a configuration (the base run is in most) run it once,
and adding a seed later runs only the new seed.

    python benchmarks/ablations.py compression tau          # two sweeps, default seeds
    python benchmarks/ablations.py all --seeds 0 1 2       # everything
    python benchmarks/ablations.py compression --markdown  # print the table from the JSON

Base (every sweep changes only what it studies): tiny preset, 2 replicas, 300 inner steps of
8 x 64 tokens per replica, AdamW lr 1e-3 with 30 warm-up steps, H 30, outer Nesterov lr 0.7
momentum 0.9, streaming with fragments of one block (strided) plus the embedding fragment,
tau 1, alpha 0.5, e3m0 nearest.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from diloco.bench.provenance import provenance
from diloco.node.data.corpus import Corpus, load_corpus
from diloco.node.model.fragments import fragment_blocks
from diloco.node.model.transformer import preset
from diloco.node.training.inner import InnerConfig
from diloco.node.training.local import LocalConfig, LocalTrainer
from diloco.node.training.outer_config import OuterConfig
from diloco.sim.plots import require_matplotlib

logger = logging.getLogger("ablations")

RESULTS_DIR = Path(__file__).parent / "results"
FIGURES_DIR = Path(__file__).parent / "figures"
DEFAULT_SEEDS = (0, 1)
DROP_KEEP = 4.25 / 32
"""Random drop keeps this fraction as FP32: 4.25 bits per value, e3m0's budget."""
TOPK_KEEP = 4.25 / 64
"""Top-k keeps this fraction as (uint32 index, FP32 value): 4.25 bits per value."""
METRIC_NAMES = {
    "eval_loss": "outer",
    "eval_loss_first_replica": "first replica",
    "eval_loss_replica_average": "replica average",
    "eval_loss_replicas": "replicas' mean loss",
}
SUMMARY_KEYS = (
    "eval_loss",
    "eval_loss_replicas",
    "eval_loss_first_replica",
    "eval_loss_replica_average",
    "bytes_sent_per_replica",
    "peak_bytes_per_step",
    "num_fragments",
    "rounds_applied",
    "outer_states_identical",
    "tokens",
    "wall_s",
)


def base_config() -> LocalConfig:
    """The base run of every sweep: the setting where averaging clearly pays off here."""
    return LocalConfig(
        method="streaming",
        replicas=2,
        preset="tiny",
        steps=300,
        batch_size=8,
        seq_len=64,
        fragment_size=1,
        pattern="strided",
        embedding_fragment="own",
        taus=[1],
        codec="e3m0",
        eval_batches=16,
        log_every=10**9,
        inner=InnerConfig(lr=1e-3, warmup_steps=30),
        outer=OuterConfig(
            sync_every=30,
            outer_lr=0.7,
            outer_momentum=0.9,
            fragment_sync_delay=1,
            fragment_update_alpha=None,
        ),
    )


def toy(config: LocalConfig) -> LocalConfig:
    """The same run at a few steps and tiny batches (tests); the eval set shrinks alike."""
    scale = max(1, config.batch_size // 2)
    return replace(
        config,
        steps=4,
        batch_size=max(1, config.batch_size // scale),
        seq_len=16,
        eval_batches=max(1, config.eval_batches // 16),
    )


def with_outer(config: LocalConfig, **changes: Any) -> LocalConfig:
    """``config`` with outer-optimizer fields changed (``sync_every``, alpha, tau...)."""
    return replace(config, outer=replace(config.outer, **changes))


def with_tau(config: LocalConfig, taus: list[int], alpha: float | None = None) -> LocalConfig:
    return replace(
        with_outer(config, fragment_sync_delay=taus[0], fragment_update_alpha=alpha),
        taus=taus,
    )


def diloco(config: LocalConfig, sync_every: int) -> LocalConfig:
    """DiLoCo: one fragment, tau 0, FP32 (``method="diloco"`` forces the first two)."""
    return replace(
        with_tau(with_outer(config, sync_every=sync_every), [0]), method="diloco", codec="none"
    )


@dataclass(frozen=True, slots=True)
class Point:
    """One bar or line point: a configuration and the summary metric read from its runs."""

    series: str
    x: str | int
    config: LocalConfig
    metric: str = "eval_loss"


@dataclass(frozen=True, slots=True)
class Sweep:
    """A named sweep: its points, how to plot them, and what the paper reports."""

    name: str
    title: str
    xlabel: str
    points: Callable[[LocalConfig], list[Point]]
    plot: str = "bar"
    """``bar`` (categorical x), ``line`` (numeric x), ``logline`` or ``cosine``."""
    show_bytes: bool = False
    paper: str = ""
    notes: list[str] = field(default_factory=list)


def _methods(b: LocalConfig) -> list[Point]:
    single = with_outer(replace(b, replicas=1), fragment_update_alpha=1.0)
    fp32 = replace(with_tau(b, [0]), codec="none")
    return [
        Point("method", "single replica", single, "eval_loss_first_replica"),
        Point("method", "dp", replace(b, method="dp")),
        Point("method", "diloco H30", diloco(b, 30)),
        Point("method", "diloco H100", diloco(b, 100)),
        Point("method", "streaming fp32", fp32),
        Point("method", "+ overlap tau 1", replace(b, codec="none")),
        Point("method", "+ overlap + e3m0", b),
    ]


def _fragments(b: LocalConfig) -> list[Point]:
    layers = preset(b.preset).n_layers
    points = []
    for pattern in ("strided", "sequential"):
        for size in (1, 2, 3, "all"):
            if size == "all":
                config = replace(b, fragment_size=layers, embedding_fragment="first")
            else:
                config = replace(b, fragment_size=size, pattern=pattern)  # type: ignore[arg-type]
            points.append(Point(pattern, str(size), canonical(config)))
    return points


def canonical(config: LocalConfig) -> LocalConfig:
    """The run with the same partition and the smallest (size, pattern): reuses equal runs.

    With one block per fragment, or all blocks in one, both patterns give the same
    fragments; with strided fragments only their number matters.
    """
    layers = preset(config.preset).n_layers
    blocks = fragment_blocks(layers, config.fragment_size, config.pattern)
    for size in range(1, layers + 1):
        for pattern in ("strided", "sequential"):
            if fragment_blocks(layers, size, pattern) == blocks:  # type: ignore[arg-type]
                return replace(config, fragment_size=size, pattern=pattern)  # type: ignore[arg-type]
    return config


def _tau(b: LocalConfig) -> list[Point]:
    return [
        Point(f"alpha {alpha}", tau, with_tau(b, [tau], alpha))
        for alpha in (0.0, 0.5)
        for tau in (0, 1, 2, 5, 10)
    ]


def _hetero_tau(b: LocalConfig) -> list[Point]:
    return [Point("replica 1 at tau 1", tau, with_tau(b, [1, tau])) for tau in (1, 2, 5, 10)]


def _compression(b: LocalConfig) -> list[Point]:
    return [
        Point("codec", "fp32", replace(b, codec="none")),
        Point("codec", "bf16", replace(b, codec="bf16")),
        Point("codec", "int8", replace(b, codec="int8")),
        Point("codec", "e3m0 nearest", b),
        Point("codec", "e3m0 stochastic", replace(b, rounding="stochastic")),
        Point("codec", f"drop q={DROP_KEEP:.3f}", replace(b, codec="drop", keep=DROP_KEEP)),
        Point("codec", f"top-k q={TOPK_KEEP:.3f}", replace(b, codec="topk", keep=TOPK_KEEP)),
    ]


def _fedpart(b: LocalConfig) -> list[Point]:
    return [
        Point("method", "ours (all trained)", b),
        Point("method", "FedPart (next fragment trained)", replace(b, freeze_unsynced=True)),
    ]


def _replicas(b: LocalConfig) -> list[Point]:
    """Constant token budget: the global batch (replicas x batch) and the steps stay fixed."""
    total = b.replicas * b.batch_size
    points = []
    for m in (2, 4, 8):
        batch = total // m
        eval_batches = b.eval_batches * b.batch_size // batch  # the same held-out tokens
        config = replace(b, replicas=m, batch_size=batch, eval_batches=eval_batches)
        points.append(Point("streaming", m, config))
    return points


def _sync_every(b: LocalConfig) -> list[Point]:
    points = []
    for h in (5, 10, 30, 100):
        points.append(Point("diloco", h, diloco(b, h)))
        points.append(Point("streaming", h, with_outer(b, sync_every=h)))
    return points


def _eval_weights(b: LocalConfig) -> list[Point]:
    metrics = {
        "outer": "eval_loss",
        "first replica": "eval_loss_first_replica",
        "replica average": "eval_loss_replica_average",
        "replicas' mean loss": "eval_loss_replicas",
    }
    return [
        Point(series, x, config, metric)
        for series, config in (("diloco H30", diloco(b, 30)), ("streaming", b))
        for x, metric in metrics.items()
    ]


def _cosine(b: LocalConfig) -> list[Point]:
    return [Point("streaming", "base", b, "outer_grad_cosine")]


SWEEPS: dict[str, Sweep] = {
    s.name: s
    for s in (
        Sweep(
            "methods",
            "1. Methods at equal tokens",
            "method",
            _methods,
            show_bytes=True,
            paper="streaming (+ overlap, + 4-bit) matches DiLoCo, approaching DP",
        ),
        Sweep(
            "fragments",
            "2. Fragment size x pattern",
            "blocks per fragment",
            _fragments,
            paper="strided ~ sequential; fragment size matters little",
        ),
        Sweep(
            "tau",
            "3. Overlap tau x alpha",
            "tau (steps)",
            _tau,
            plot="line",
            paper="tau up to 5 costs under ~1% of eval loss; alpha 0.5 helps at larger tau",
        ),
        Sweep(
            "hetero_tau",
            "4. Heterogeneous tau (replica 2's tau)",
            "tau of replica 2",
            _hetero_tau,
            plot="line",
            paper="a slower replica costs little",
        ),
        Sweep(
            "compression",
            "5. Outer-gradient compression",
            "codec",
            _compression,
            show_bytes=True,
            paper="4-bit ~ FP32, both clearly better than value dropping",
        ),
        Sweep(
            "fedpart",
            "6. FedPart freezing vs ours",
            "method",
            _fedpart,
            paper="FedPart freezing is clearly worse",
        ),
        Sweep(
            "replicas",
            "7. Replicas at constant token budget",
            "replicas M",
            _replicas,
            plot="line",
            paper="loss degrades slowly with more replicas",
        ),
        Sweep(
            "sync_every",
            "8. H: DiLoCo vs streaming",
            "H (inner steps)",
            _sync_every,
            plot="logline",
            paper="streaming at least as robust as DiLoCo; smaller H is better",
        ),
        Sweep(
            "eval_weights",
            "9. Which weights to evaluate",
            "weights",
            _eval_weights,
            paper="outer parameters evaluate at least as well as any replica",
        ),
        Sweep(
            "cosine",
            "10. Cosine similarity between replicas' outer gradients",
            "inner step",
            _cosine,
            plot="cosine",
            paper="replicas' outer gradients stay aligned",
        ),
    )
}
SWEEP_ORDER = tuple(SWEEPS)


class RunCache:
    """Finished runs in a JSON-lines file, keyed by the full configuration.

    Re-read before every lookup and appended one line per run, so two sweep processes can
    share the file (a line is written in one call).
    """

    def __init__(self, path: Path) -> None:
        self.path = path

    @staticmethod
    def key(config: LocalConfig) -> str:
        return json.dumps(asdict(config), sort_keys=True, default=str)

    def get(self, config: LocalConfig) -> dict[str, Any] | None:
        if not self.path.exists():
            return None
        key = self.key(config)
        found = None
        for line in self.path.read_text().splitlines():
            record = json.loads(line)
            if record["key"] == key:
                found = record["summary"]
        return found

    def put(self, config: LocalConfig, summary: dict[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        record = {"key": self.key(config), "summary": summary, "provenance": provenance()}
        line = json.dumps(record) + "\n"
        with self.path.open("a") as sink:
            sink.write(line)


def run_config(config: LocalConfig, corpus: Corpus, cache: RunCache) -> dict[str, Any]:
    """The summary of one run, from the cache or by training."""
    cached = cache.get(config)
    if cached is not None:
        return cached
    start = time.perf_counter()
    full = LocalTrainer(config, corpus).train()
    summary = {k: full[k] for k in SUMMARY_KEYS} | {"outer_grad_cosine": full["outer_grad_cosine"]}
    cache.put(config, summary)
    logger.info(
        "ran %s seed %d: eval %.4f in %.0f s",
        config.method,
        config.seed,
        summary["eval_loss"],
        time.perf_counter() - start,
    )
    return summary


def run_sweep(
    sweep: Sweep,
    seeds: list[int],
    cache: RunCache,
    corpus: Corpus,
    shrink: Callable[[LocalConfig], LocalConfig] | None = None,
) -> dict[str, Any]:
    """Run every point of ``sweep`` for every seed; return the JSON-ready results."""
    base = base_config()
    runs, points = [], []
    for point in sweep.points(base):
        config = shrink(point.config) if shrink else point.config
        values = []
        for seed in seeds:
            summary = run_config(replace(config, seed=seed), corpus, cache)
            value = summary[point.metric]
            values.append(value)
            runs.append(
                {"series": point.series, "x": point.x, "seed": seed, "metric": point.metric}
                | summary
            )
        record = {
            "series": point.series,
            "x": point.x,
            "metric": point.metric,
            "codec": config.codec_name if config.method != "dp" else "none",
            "partition": fragment_blocks(
                preset(config.preset).n_layers, config.fragment_size, config.pattern
            )
            if config.method != "dp"
            else None,
        }
        if point.metric == "outer_grad_cosine":
            record["cosine_by_fragment"] = _cosine_by_fragment(values)
        else:
            record |= _stats(values)
            same = [r for r in runs if r["series"] == point.series and r["x"] == point.x]
            for key in ("bytes_sent_per_replica", "peak_bytes_per_step"):
                record[key] = statistics.fmean(r[key] for r in same)
        points.append(record)
    return {
        "sweep": sweep.name,
        "title": sweep.title,
        "paper": sweep.paper,
        "seeds": seeds,
        "base": json.loads(json.dumps(asdict(shrink(base) if shrink else base), default=str)),
        "command": f"python benchmarks/ablations.py {sweep.name} --seeds "
        + " ".join(map(str, seeds)),
        "points": points,
        "runs": runs,
        "provenance": provenance(),
    }


def _stats(values: list[float]) -> dict[str, float]:
    mean = statistics.fmean(values)
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return {"mean": mean, "std": std, "min": min(values), "max": max(values)}


def _cosine_by_fragment(logs: list[list[dict[str, float]]]) -> dict[str, list[list[float]]]:
    """Per fragment: ``[step, mean cosine over seeds]`` for every round."""
    by_round: dict[tuple[int, int], list[float]] = {}
    for log in logs:
        for entry in log:
            key = (int(entry["fragment"]), int(entry["step"]))
            by_round.setdefault(key, []).append(entry["cosine"])
    out: dict[str, list[list[float]]] = {}
    for (fragment, step), values in sorted(by_round.items()):
        out.setdefault(str(fragment), []).append([step, statistics.fmean(values)])
    return out


def plot_sweep(sweep: Sweep, results: dict[str, Any], path: Path) -> None:
    """One PNG per sweep: eval loss (mean, min-max bars over seeds), bytes where relevant."""
    require_matplotlib()  # names the extra to install when it is missing
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 2 if sweep.show_bytes else 1
    fig, axes = plt.subplots(1, panels, figsize=(6.5 * panels, 4.2), squeeze=False)
    ax = axes[0][0]
    points = results["points"]
    series = list(dict.fromkeys(p["series"] for p in points))
    if sweep.plot == "cosine":
        curves = points[0]["cosine_by_fragment"]
        embedding = str(len(curves) - 1) if results["base"]["embedding_fragment"] == "own" else ""
        for fragment, curve in curves.items():
            steps, cosines = zip(*curve, strict=True)
            name = f"fragment {fragment}" + (" (embedding, head)" if fragment == embedding else "")
            ax.plot(steps, cosines, marker="o", ms=3, label=name)
        ax.set_ylabel("cosine similarity (replica 1 vs 2)")
        ax.legend(fontsize=8)
    elif sweep.plot in ("line", "logline"):
        for name in series:
            mine = [p for p in points if p["series"] == name]
            xs = [p["x"] for p in mine]
            ax.errorbar(
                xs,
                [p["mean"] for p in mine],
                yerr=_spread(mine),
                marker="o",
                capsize=3,
                label=name,
            )
        if sweep.plot == "logline":
            ax.set_xscale("log")
            ax.set_xticks(xs, [str(x) for x in xs])
        ax.legend(fontsize=8)
        ax.set_ylabel("eval loss")
    else:
        labels = list(dict.fromkeys(str(p["x"]) for p in points))
        width = 0.8 / len(series)
        for i, name in enumerate(series):
            mine = {str(p["x"]): p for p in points if p["series"] == name}
            xs = [j + i * width for j, label in enumerate(labels) if label in mine]
            chosen = [mine[label] for label in labels if label in mine]
            bars = ax.bar(
                xs, [p["mean"] for p in chosen], width, yerr=_spread(chosen), capsize=3, label=name
            )
            ax.bar_label(bars, fmt="%.3f", fontsize=6, padding=2)
        ax.set_xticks(
            [j + width * (len(series) - 1) / 2 for j in range(len(labels))],
            labels,
            rotation=25,
            ha="right",
            fontsize=8,
        )
        low = min(p["min"] for p in points)
        high = max(p["max"] for p in points)
        if high > 2 * low:  # a diverged run: a log axis keeps the others readable
            ax.set_yscale("log")
        else:
            pad = max(0.02, 0.15 * (high - low))
            ax.set_ylim(low - pad, high + pad)
        if len(series) > 1:
            ax.legend(fontsize=8)
        ax.set_ylabel("eval loss")
    ax.set_xlabel(sweep.xlabel)
    ax.set_title(sweep.title, fontsize=10)
    ax.grid(alpha=0.3)
    if sweep.show_bytes:
        bx = axes[0][1]
        labels = [str(p["x"]) for p in points]
        sent = [p["bytes_sent_per_replica"] / 1e6 for p in points]
        peak = [p["peak_bytes_per_step"] / 1e6 for p in points]
        positions = range(len(points))
        bx.bar([i - 0.2 for i in positions], sent, 0.4, label="MB sent per replica")
        bx.bar([i + 0.2 for i in positions], peak, 0.4, label="peak MB in one step")
        bx.set_yscale("log")
        bx.set_xticks(list(positions), labels, rotation=25, ha="right", fontsize=8)
        bx.set_title("communication", fontsize=10)
        bx.legend(fontsize=8)
        bx.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _spread(points: list[dict[str, Any]]) -> list[list[float]]:
    """Error bars from the mean down to the min and up to the max over seeds."""
    return [
        [p["mean"] - p["min"] for p in points],
        [p["max"] - p["mean"] for p in points],
    ]


def markdown(results: dict[str, Any]) -> str:
    """The sweep's table for ``RESULTS.md``."""
    points = results["points"]
    if "cosine_by_fragment" in points[0]:
        lines = [
            "| fragment | rounds | first round | mean | min | last round |",
            "| --- | ---: | ---: | ---: | ---: | ---: |",
        ]
        for fragment, curve in points[0]["cosine_by_fragment"].items():
            cos = [c for _, c in curve]
            lines.append(
                f"| {fragment} | {len(cos)} | {cos[0]:.3f} | {statistics.fmean(cos):.3f} | "
                f"{min(cos):.3f} | {cos[-1]:.3f} |"
            )
        return "\n".join(lines)
    reference = points[0]["mean"]
    lines = [
        "| series | x | metric | eval loss (mean) | min - max | vs first row | "
        "MB sent / replica | peak MB / step |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for p in points:
        change = 100 * (p["mean"] - reference) / reference
        lines.append(
            f"| {p['series']} | {p['x']} | {METRIC_NAMES.get(p['metric'], p['metric'])} "
            f"| {p['mean']:.4f} | {p['min']:.4f} - {p['max']:.4f} | {change:+.2f}% | "
            f"{p['bytes_sent_per_replica'] / 1e6:.3f} | {p['peak_bytes_per_step'] / 1e6:.3f} |"
        )
    return "\n".join(lines)


def run(
    names: list[str],
    seeds: list[int],
    out_dir: Path,
    fig_dir: Path,
    cache_path: Path,
    shrink: Callable[[LocalConfig], LocalConfig] | None = None,
) -> dict[str, dict[str, Any]]:
    """Run the named sweeps in order; write each one's JSON and PNG as soon as it ends."""
    corpus = load_corpus(None)
    cache = RunCache(cache_path)
    all_results = {}
    for name in names:
        sweep = SWEEPS[name]
        start = time.perf_counter()
        results = run_sweep(sweep, seeds, cache, corpus, shrink)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / f"abl_{name}.json").write_text(json.dumps(results, indent=1))
        plot_sweep(sweep, results, fig_dir / f"abl_{name}.png")
        logger.info("sweep %s done in %.0f s", name, time.perf_counter() - start)
        all_results[name] = results
    return all_results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sweeps", nargs="+", choices=[*SWEEP_ORDER, "all"], help="sweep names")
    parser.add_argument("--seeds", type=int, nargs="+", default=list(DEFAULT_SEEDS))
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--fig-dir", type=Path, default=FIGURES_DIR)
    parser.add_argument(
        "--cache", type=Path, default=None, help="runs cache [default: OUT_DIR/abl_runs.jsonl]"
    )
    parser.add_argument("--toy", action="store_true", help="4 steps, tiny batches (a smoke run)")
    parser.add_argument(
        "--markdown", action="store_true", help="only print the tables of existing JSON files"
    )
    parser.add_argument(
        "--replot", action="store_true", help="only redraw the PNGs from existing JSON files"
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    names = list(SWEEP_ORDER) if "all" in args.sweeps else args.sweeps
    if args.markdown or args.replot:
        for name in names:
            results = json.loads((args.out_dir / f"abl_{name}.json").read_text())
            if args.markdown:
                logger.info(
                    "%s (seeds %s)\n%s", results["title"], results["seeds"], markdown(results)
                )
            if args.replot:
                plot_sweep(SWEEPS[name], results, args.fig_dir / f"abl_{name}.png")
        return
    # One thread: OpenMP spinning on a shared 2-core machine made runs 10x slower.
    torch.set_num_threads(1)
    cache = args.cache or args.out_dir / "abl_runs.jsonl"
    run(names, args.seeds, args.out_dir, args.fig_dir, cache, toy if args.toy else None)


if __name__ == "__main__":
    main()
