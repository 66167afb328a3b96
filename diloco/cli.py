"""``diloco-node``: thin click commands; each parses, builds a config and calls one entry point.

Our errors map to ``click.ClickException`` (exit 1) for runtime failures and
``click.UsageError`` (exit 2) for bad configuration.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Literal, cast

import click

from diloco import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.version_option(__version__, prog_name="diloco-node")
@click.option("-v", "--verbose", count=True, help="More log output (-v info, -vv debug).")
def main(verbose: int) -> None:
    """Pretrain one language model together over the internet with Streaming DiLoCo."""
    level = {0: logging.WARNING, 1: logging.INFO}.get(verbose, logging.DEBUG)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _parse_taus(value: str) -> list[int]:
    try:
        return [int(v) for v in value.split(",")]
    except ValueError as error:
        raise click.BadParameter(
            f"expected an integer or a list like 1,1,3,5, got {value!r}"
        ) from error


@main.command()
@click.option(
    "--method",
    type=click.Choice(["dp", "diloco", "streaming"]),
    default="streaming",
    help="dp: average gradients every step; diloco: one fragment, tau 0; streaming.",
)
@click.option("--replicas", default=2, help="M: number of replicas trained in this process.")
@click.option("--preset", default="tiny", help="Model preset: tiny, small, 35M, ... (SPEC 7).")
@click.option("--steps", default=600, help="T: inner steps per replica.")
@click.option("--batch-size", default=8, help="Sequences per replica per step.")
@click.option("--seq-len", default=64, help="Tokens per sequence.")
@click.option("--H", "sync_every", default=30, help="Inner steps between two syncs of a fragment.")
@click.option("--fragment-size", default=1, help="Transformer blocks per fragment.")
@click.option(
    "--pattern",
    type=click.Choice(["strided", "sequential"]),
    default="strided",
    help="Which blocks form a fragment.",
)
@click.option(
    "--embedding-fragment",
    type=click.Choice(["own", "first"]),
    default="own",
    help="Embedding, final norm and head: a fragment of their own, or in fragment 0.",
)
@click.option(
    "--tau", default="1", help="Overlap tau in steps: one value, or one per replica (e.g. 1,1,3,5)."
)
@click.option(
    "--alpha",
    type=float,
    default=None,
    help="Merge factor: share of local weights kept [default: 0.5 if tau > 0 else 0].",
)
@click.option(
    "--codec",
    default=None,
    help="Outer-gradient codec: none, bf16, fp16, int8, e3m0; drop, topk (ablation baselines) "
    "[default: e3m0 for streaming, none for diloco].",
)
@click.option(
    "--rounding",
    type=click.Choice(["nearest", "stochastic"]),
    default="nearest",
    help="E3M0 rounding.",
)
@click.option(
    "--keep",
    type=float,
    default=None,
    help="Keep fraction q of --codec drop / topk, e.g. 0.133 [default: the e3m0 bit budget].",
)
@click.option(
    "--freeze-unsynced",
    is_flag=True,
    help="FedPart-style ablation: train only the fragment synchronised next.",
)
@click.option("--outer-lr", default=0.7, help="Outer Nesterov learning rate.")
@click.option("--outer-momentum", default=0.9, help="Outer Nesterov momentum mu.")
@click.option(
    "--inner-opt", type=click.Choice(["adamw", "sgd"]), default="adamw", help="Inner optimizer."
)
@click.option("--inner-lr", default=1e-3, help="Peak inner learning rate.")
@click.option("--warmup", default=30, help="Inner learning-rate warm-up, in steps.")
@click.option("--grad-clip", default=1.0, help="Gradient-norm clip (0: off).")
@click.option("--eval-every", default=0, help="Evaluate every N steps (0: only at the end).")
@click.option("--eval-batches", default=8, help="Held-out batches per evaluation.")
@click.option("--log-every", default=25, help="A progress line every N steps.")
@click.option("--seed", default=0, help="Seed of the initial weights and data streams.")
@click.option(
    "--data",
    type=click.Path(exists=True),
    default=None,
    help="Corpus: text file, folder, or nanoGPT .bin tokens [default: Python's "
    "standard library sources].",
)
@click.option(
    "--metrics-out",
    type=click.Path(dir_okay=False),
    default=None,
    help="Write JSON lines: progress records, then a summary.",
)
def local(**options: object) -> None:
    """Train M replicas in one process (experiments), e.g. `diloco-node local --replicas 4`.

    The defaults are settings where averaging clearly pays off on a 2-core CPU in minutes
    (benchmarks/RESULTS.md, "Methods at equal tokens"); the library's own defaults follow
    the paper (inner lr 4e-4, outer lr 0.4).
    """
    from diloco.errors import DilocoError
    from diloco.node.inner import InnerConfig
    from diloco.node.local import LocalConfig, LocalTrainer
    from diloco.node.outer import OuterConfig

    o = options
    try:
        config = LocalConfig(
            method=o["method"],
            replicas=o["replicas"],
            preset=o["preset"],
            steps=o["steps"],
            batch_size=o["batch_size"],
            seq_len=o["seq_len"],
            fragment_size=o["fragment_size"],
            pattern=o["pattern"],
            embedding_fragment=o["embedding_fragment"],
            taus=_parse_taus(str(o["tau"])),
            codec=o["codec"],
            rounding=o["rounding"],
            keep=o["keep"],
            freeze_unsynced=o["freeze_unsynced"],
            outer=OuterConfig(
                sync_every=o["sync_every"],
                outer_lr=o["outer_lr"],
                outer_momentum=o["outer_momentum"],
                fragment_update_alpha=o["alpha"],
                fragment_sync_delay=_parse_taus(str(o["tau"]))[0],
            ),
            inner=InnerConfig(
                optimizer=o["inner_opt"],
                lr=o["inner_lr"],
                warmup_steps=o["warmup"],
                grad_clip=o["grad_clip"],
            ),
            eval_every=o["eval_every"],
            eval_batches=o["eval_batches"],
            log_every=o["log_every"],
            seed=o["seed"],
            data=o["data"],
        )  # type: ignore[arg-type]
        trainer = LocalTrainer(config)
    except (DilocoError, ValueError) as error:
        raise click.UsageError(str(error)) from error
    click.echo(
        f"{config.method}: {config.replicas} replicas of {config.preset} "
        f"({sum(p.numel() for p in trainer.replicas[0].model.parameters()):,} params), "
        f"{trainer.num_fragments} fragment(s), codec {config.codec_name}, "
        f"data: {trainer.corpus.description}"
    )
    metrics = Path(str(o["metrics_out"])) if o["metrics_out"] else None
    summary = trainer.train(metrics_out=metrics, on_progress=_echo_progress)
    click.echo(
        f"eval loss {summary['eval_loss']:.4f} (outer), {summary['eval_loss_replicas']:.4f} "
        f"(replicas' own); sent {summary['bytes_sent_per_replica'] / 1e6:.2f} MB per replica, "
        f"peak {summary['peak_bytes_per_step'] / 1e6:.3f} MB per step; "
        f"{summary['tokens']:,} tokens in {summary['wall_s']:.0f} s"
    )


def _echo_progress(record: dict[str, object]) -> None:
    if record.get("event") != "step":
        return
    line = (
        f"step {record['step']:>6}  loss {record['loss']:.4f}  "
        f"{record['tokens_per_s']:,.0f} tok/s  sent {record['mb_sent_per_replica']:.2f} MB"
    )
    if "eval_loss" in record:
        line += f"  eval {record['eval_loss']:.4f}"
    click.echo(line)


@main.command()
@click.option("--steps", default=600, help="Inner steps per replica.")
@click.pass_context
def demo(ctx: click.Context, steps: int) -> None:
    """A few-minute CPU demo: Streaming DiLoCo, E3M0, 2 replicas, embedded corpus.

    The replicas run in this process; the swarm demo (separate processes on loopback) comes
    with the node.
    """
    ctx.invoke(local, steps=steps)


def _parse_targets(value: str | None) -> tuple[float, ...] | None:
    if value is None:
        return None
    try:
        return tuple(float(v) for v in value.split(","))
    except ValueError as error:
        raise click.BadParameter(f"expected CU values like 0.5,0.9,0.99, got {value!r}") from error


@main.command()
@click.option(
    "--model",
    type=click.Choice(["1B", "10B", "100B", "custom"]),
    default="1B",
    help="The paper's presets (24/48/108 layers, 0.1/0.8/4.9 s per step), or custom.",
)
@click.option("--layers", type=int, default=None, help="L: layers (custom, or a preset override).")
@click.option("--params", type=float, default=None, help="N: parameters, e.g. 7e9.")
@click.option("--step-time", type=float, default=None, help="Compute seconds per inner step.")
@click.option(
    "--method",
    type=click.Choice(
        ["dp", "diloco", "streaming", "streaming-overlap", "streaming-overlap-fp4", "all"]
    ),
    default="all",
    help="Synchronisation method to simulate.",
)
@click.option("--H", "sync_every", default=100, help="Inner steps between two syncs of a fragment.")
@click.option("--fragment-size", default=3, help="Layers per streaming fragment.")
@click.option(
    "--pattern",
    type=click.Choice(["strided", "sequential"]),
    default="strided",
    help="Which layers form a fragment.",
)
@click.option("--tau", default=1, help="Overlap in steps for the *-overlap methods.")
@click.option("--replicas", default=2, help="M: replicas in each all-reduce.")
@click.option("--bandwidth", type=float, default=None, help="CU at this Gbit/s, e.g. 10.")
@click.option(
    "--targets",
    default=None,
    help="CU targets, e.g. 0.5,0.8,0.9,0.95,0.99: lowest Gbit/s reaching each "
    "[default: that list when --bandwidth is not given].",
)
@click.option(
    "--json",
    "json_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="Write the required-bandwidth table as JSON.",
)
@click.option(
    "--plot",
    "plot_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="PNG of CU against bandwidth (log x), one curve per method.",
)
@click.option(
    "--timeline",
    "timeline_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="PNG Gantt chart of a few steps at --bandwidth.",
)
@click.option(
    "--from-metrics",
    "metrics_path",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="A node's JSON-lines metrics: predict its CU at other bandwidths.",
)
def simulate(
    model: str,
    layers: int | None,
    params: float | None,
    step_time: float | None,
    method: str,
    sync_every: int,
    fragment_size: int,
    pattern: Literal["strided", "sequential"],
    tau: int,
    replicas: int,
    bandwidth: float | None,
    targets: str | None,
    json_path: str | None,
    plot_path: str | None,
    timeline_path: str | None,
    metrics_path: str | None,
) -> None:
    """Compute utilisation against bandwidth for DP and the DiLoCo variants (SPEC 6).

    e.g. `diloco-node simulate --model 100B --targets 0.9,0.99`
    """
    import json

    from diloco.sim.commands import SimulateRequest, simulate_report
    from diloco.sim.methods import METHODS, Method, SyncSettings

    if json_path is not None and targets is None:
        raise click.UsageError("--json writes the --targets table: give --targets")
    try:
        request = SimulateRequest(
            model=model,
            num_layers=layers,
            num_params=params,
            step_seconds=step_time,
            methods=METHODS if method == "all" else (cast(Method, method),),
            settings=SyncSettings(
                sync_every=sync_every,
                fragment_size=fragment_size,
                pattern=pattern,
                tau=tau,
                num_replicas=replicas,
            ),
            bandwidth_gbps=bandwidth,
            targets=_parse_targets(targets),
            plot_path=plot_path,
            timeline_path=timeline_path,
            metrics_lines=Path(metrics_path).read_text().splitlines() if metrics_path else None,
        )
        report = simulate_report(request)
    except ValueError as error:
        raise click.UsageError(str(error)) from error
    click.echo(report.text)
    if json_path is not None and report.required is not None:
        Path(json_path).write_text(json.dumps(report.required, indent=2) + "\n")


@main.command()
@click.option(
    "--model",
    type=click.Choice(["1B", "10B", "100B", "custom"]),
    default="1B",
    help="The paper's presets, or custom with --layers, --params, --step-time.",
)
@click.option("--layers", type=int, default=None, help="L: layers.")
@click.option("--params", type=float, default=None, help="N: parameters, e.g. 7e9.")
@click.option("--step-time", type=float, default=None, help="Compute seconds per inner step.")
@click.option(
    "--tokens",
    type=float,
    default=None,
    help="D: training tokens, all replicas [default: 20 x params].",
)
@click.option("--batch-size", default=256, help="Sequences per replica per step.")
@click.option("--seq-len", default=1024, help="Tokens per sequence.")
@click.option("--replicas", default=2, help="M: replicas in each all-reduce.")
@click.option("--H", "sync_every", default=100, help="Inner steps between two syncs of a fragment.")
@click.option("--fragment-size", default=3, help="Layers per streaming fragment.")
@click.option("--tau", default=1, help="Overlap in steps for the *-overlap methods.")
@click.option(
    "--codec", default="e3m0", help="Codec of the quantised variant: none, bf16, fp16, int8, e3m0."
)
def accounting(
    model: str,
    layers: int | None,
    params: float | None,
    step_time: float | None,
    tokens: float | None,
    batch_size: int,
    seq_len: int,
    replicas: int,
    sync_every: int,
    fragment_size: int,
    tau: int,
    codec: str,
) -> None:
    """Bytes a whole run exchanges and the peak rate it needs, DP against DiLoCo variants.

    e.g. `diloco-node accounting --model 10B --replicas 4 --tokens 2e11`
    """
    from diloco.sim.commands import accounting_report

    try:
        text = accounting_report(
            model=model,
            num_layers=layers,
            num_params=params,
            step_seconds=step_time,
            num_tokens=tokens,
            batch_size=batch_size,
            seq_len=seq_len,
            num_replicas=replicas,
            sync_every=sync_every,
            fragment_size=fragment_size,
            tau=tau,
            codec=codec,
        )
    except ValueError as error:
        raise click.UsageError(str(error)) from error
    click.echo(text)


@main.group()
def bench() -> None:
    """Measure parts of the system on this machine."""


@bench.command("allreduce")
@click.option("--peers", default=4, help="Peer processes (each its own DHT and p2pd).")
@click.option("--rounds", default=3, help="All-reduce rounds.")
@click.option("--numel", default=10_000_000, help="Float32 values per peer, e.g. 10000000.")
@click.option("--codec", default="e3m0", help="Codec: none, bf16, fp16, int8, e3m0.")
@click.option(
    "--compare-hivemind", is_flag=True, help="Run hivemind's DecentralizedAverager (fp16) instead."
)
@click.option(
    "--bandwidth-mbit",
    type=float,
    default=None,
    help="Throttle each peer's link to this many Mbit/s (own network namespace; root only).",
)
@click.option("--window", default=2.0, help="Matchmaking window in seconds.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write results here.")
def bench_allreduce(
    peers: int,
    rounds: int,
    numel: int,
    codec: str,
    compare_hivemind: bool,
    bandwidth_mbit: float | None,
    window: float,
    json_path: str | None,
) -> None:
    """All-reduce of random vectors between real processes on this machine.

    e.g. `diloco-node bench allreduce --peers 4 --numel 10000000 --codec e3m0 --json r.json`
    """
    import json

    from diloco.errors import ConfigError
    from diloco.protocol.bench import BenchConfig, run_allreduce_bench, summary

    try:
        config = BenchConfig(
            peers=peers,
            rounds=rounds,
            numel=numel,
            codec=codec,
            compare_hivemind=compare_hivemind,
            bandwidth_mbit=bandwidth_mbit,
            matchmaking_window=window,
            log_level=logging.getLogger().level,
        )
        result = run_allreduce_bench(config)
    except ConfigError as error:
        raise click.UsageError(str(error)) from error
    except RuntimeError as error:
        raise click.ClickException(str(error)) from error
    click.echo(summary(result))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result.to_json(), f, indent=2)
