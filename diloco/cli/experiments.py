"""Commands for experiments on one machine: ``local``, ``simulate``, ``accounting``, ``bench``.

Bad options are ``click.UsageError`` (exit 2); failures while running are
``click.ClickException`` (exit 1).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, cast

import click

from diloco.bench.allreduce import BenchConfig
from diloco.cli.node_lines import duration
from diloco.cli.options import flag_options
from diloco.errors import ConfigError, DilocoError
from diloco.node.flags import COMPUTE_FLAGS, NODE_FLAGS, RUN_FLAGS, Flag, Flags
from diloco.node.training.local import LocalConfig
from diloco.sim.methods import SyncSettings

LOCAL_FLAGS = Flags(
    LocalConfig,
    (
        Flag(
            "--method",
            ("method",),
            "dp: average gradients every step; diloco: one fragment, tau 0; streaming.",
        ),
        Flag("--replicas", ("replicas",), "M: number of replicas trained in this process."),
        # The fields an experiment shares with a run and a node: their flags, written once.
        *RUN_FLAGS.named("--preset", "--steps"),
        *NODE_FLAGS.named("--batch-size"),
        *RUN_FLAGS.named("--seq-len", "--H", "--fragment-size", "--pattern"),
        *RUN_FLAGS.named("--embedding-fragment", "--alpha"),
        Flag(
            "--codec",
            ("codec",),
            "Outer-gradient codec: none, bf16, fp16, int8, e3m0; drop, topk (ablation "
            "baselines) [default: e3m0 for streaming, none for diloco].",
        ),
        *RUN_FLAGS.named("--rounding", "--return-codec"),
        Flag(
            "--keep",
            ("keep",),
            "Keep fraction q of --codec drop / topk, e.g. 0.133 [default: the e3m0 bit budget].",
        ),
        Flag(
            "--freeze-unsynced",
            ("freeze_unsynced",),
            "FedPart-style ablation: train only the fragment synchronised next.",
        ),
        *RUN_FLAGS.named("--outer-lr", "--outer-momentum"),
        Flag("--inner-opt", ("inner", "optimizer"), "Inner optimizer."),
        *RUN_FLAGS.named("--inner-lr", "--warmup"),
        Flag("--grad-clip", ("inner", "grad_clip"), "Gradient-norm clip (0: off)."),
        *NODE_FLAGS.named("--eval-every"),
        Flag("--eval-batches", ("eval_batches",), "Held-out batches per evaluation."),
        *NODE_FLAGS.named("--log-every"),
        Flag("--seed", ("seed",), "Seed of the initial weights and data streams."),
        *RUN_FLAGS.named("--clip-factor", "--max-round-tokens"),
        *NODE_FLAGS.named("--data"),
        *RUN_FLAGS.named("--vocab-size"),
        *(f for f in COMPUTE_FLAGS if f.name != "--tf32"),
    ),
)


_SYNC = (
    Flag("--H", ("sync_every",), "H: inner steps between two syncs of a fragment."),
    Flag("--fragment-size", ("fragment_size",), "Layers per streaming fragment."),
    Flag("--pattern", ("pattern",), "Which layers form a fragment."),
    Flag("--tau", ("tau",), "Overlap in steps for the *-overlap methods."),
    Flag("--replicas", ("num_replicas",), "M: replicas in each all-reduce."),
)
SYNC_FLAGS = Flags(SyncSettings, _SYNC)
ACCOUNTING_SYNC_FLAGS = Flags(SyncSettings, tuple(f for f in _SYNC if f.name != "--pattern"))
BENCH_FLAGS = Flags(
    BenchConfig,
    (
        Flag("--peers", ("peers",), "Peer processes (each its own DHT and p2pd)."),
        Flag("--rounds", ("rounds",), "All-reduce rounds."),
        Flag("--numel", ("numel",), "Float32 values per peer, e.g. 10000000."),
        Flag("--codec", ("codec",), "Codec: none, bf16, fp16, int8, e3m0."),
        Flag(
            "--compare-hivemind",
            ("compare_hivemind",),
            "Run hivemind's DecentralizedAverager (fp16) instead.",
        ),
        Flag(
            "--no-verify",
            ("unverified",),
            "Ours without signed chunks and checks of the reducers, to measure their cost.",
        ),
        Flag(
            "--bandwidth-mbit",
            ("bandwidth_mbit",),
            "Throttle each peer's link to this many Mbit/s (own network namespace; root only).",
        ),
        Flag(
            "--max-group-size",
            ("max_group_size",),
            "Most members of one all-reduce group; more peers run in stages on a grid.",
        ),
        Flag("--window", ("matchmaking_window",), "Matchmaking window in seconds."),
    ),
)


def _parse_taus(value: str) -> list[int]:
    try:
        return [int(v) for v in value.split(",")]
    except ValueError as error:
        raise click.BadParameter(
            f"expected an integer or a list like 1,1,3,5, got {value!r}"
        ) from error


@click.command()
@flag_options(LOCAL_FLAGS)
@click.option(
    "--tau",
    default=",".join(map(str, LocalConfig().taus)),
    help="Overlap tau in steps: one value, or one per replica (e.g. 1,1,3,5).",
)
@click.option(
    "--replica-speeds",
    default=None,
    help="Relative speed of each replica's device, e.g. 1,1,0.33: a slower one trains "
    "fewer sequences per step to keep the pace (the lower median), as --pace adaptive "
    "does in a swarm [default: all alike].",
)
@click.option(
    "--metrics-out",
    type=click.Path(dir_okay=False),
    default=None,
    help="Write JSON lines: progress records, then a summary.",
)
@click.option(
    "--export-hf",
    type=click.Path(file_okay=False),
    default=None,
    help="At the end, write the outer weights as a transformers folder.",
)
def local(
    tau: str,
    replica_speeds: str | None,
    metrics_out: str | None,
    export_hf: str | None,
    **values: Any,
) -> None:
    """Train M replicas in one process (experiments), e.g. `diloco-node local --replicas 4`.

    The defaults are settings where averaging clearly pays off on a 2-core CPU in minutes
    (benchmarks/RESULTS.md, "Methods at equal tokens").
    """
    from diloco.node.training.local import LocalTrainer

    taus = _parse_taus(tau)
    try:
        base: dict[str, Any] = {"taus": taus, "outer": {"fragment_sync_delay": taus[0]}}
        if replica_speeds is not None:
            base["replica_speeds"] = [float(v) for v in replica_speeds.split(",")]
        config = LOCAL_FLAGS.build(values, base)
        trainer = LocalTrainer(config)
    except (DilocoError, ValueError) as error:
        raise click.UsageError(str(error)) from error
    click.echo(
        f"{config.method}: {config.replicas} replicas of {config.preset} "
        f"({sum(p.numel() for p in trainer.replicas[0].model.parameters()):,} params), "
        f"{trainer.num_fragments} fragment(s), codec {config.codec_name}, "
        f"data: {trainer.corpus.description}"
    )
    metrics = Path(metrics_out) if metrics_out else None
    summary = trainer.train(metrics_out=metrics, on_progress=_echo_progress)
    click.echo(
        f"eval loss {summary['eval_loss']:.4f} (outer), {summary['eval_loss_replicas']:.4f} "
        f"(replicas' own); sent {summary['bytes_sent_per_replica'] / 1e6:.2f} MB per replica, "
        f"peak {summary['peak_bytes_per_step'] / 1e6:.3f} MB per step; "
        f"{summary['tokens']:,} tokens in {summary['wall_s']:.0f} s; "
        f"rounds pending at end: {summary['rounds_pending']}"
    )
    if export_hf:
        trainer.export_hf(export_hf)
        click.echo(f"transformers model written to {export_hf}")


def _echo_progress(record: dict[str, Any]) -> None:
    if record.get("event") != "step":
        return
    step, steps = record["step"], record["steps"]
    line = (
        f"step {step}/{steps} ({100 * step // max(1, steps)}%) · loss {record['loss']:.4f} · "
        f"{record['tokens_per_s']:,.0f} tok/s · ETA {duration(record['eta_s'])} · "
        f"sent {record['mb_sent_per_replica']:.2f} MB"
    )
    if "eval_loss" in record:
        line += f" · eval {record['eval_loss']:.4f}"
    click.echo(line)


def _parse_targets(value: str | None) -> tuple[float, ...] | None:
    if value is None:
        return None
    try:
        return tuple(float(v) for v in value.split(","))
    except ValueError as error:
        raise click.BadParameter(f"expected CU values like 0.5,0.9,0.99, got {value!r}") from error


@click.command()
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
@flag_options(SYNC_FLAGS)
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
@click.option(
    "--rtt-ms",
    type=float,
    default=None,
    help="With --from-metrics: also predict the run with this much more round-trip time "
    "(6 round trips a round).",
)
def simulate(
    model: str,
    layers: int | None,
    params: float | None,
    step_time: float | None,
    method: str,
    bandwidth: float | None,
    targets: str | None,
    json_path: str | None,
    plot_path: str | None,
    timeline_path: str | None,
    metrics_path: str | None,
    rtt_ms: float | None,
    **sync: Any,
) -> None:
    """Compute utilisation against bandwidth for DP and the DiLoCo variants (docs/design.md "The
    simulator").

    e.g. `diloco-node simulate --model 100B --targets 0.9,0.99`
    """
    from diloco.sim.commands import SimulateRequest, simulate_report
    from diloco.sim.methods import METHODS, Method

    if json_path is not None and targets is None:
        raise click.UsageError("--json writes the --targets table: give --targets")
    try:
        request = SimulateRequest(
            model=model,
            num_layers=layers,
            num_params=params,
            step_seconds=step_time,
            methods=METHODS if method == "all" else (cast(Method, method),),
            settings=SYNC_FLAGS.build(sync),
            bandwidth_gbps=bandwidth,
            targets=_parse_targets(targets),
            plot_path=plot_path,
            timeline_path=timeline_path,
            metrics_lines=Path(metrics_path).read_text().splitlines() if metrics_path else None,
            rtt_ms=rtt_ms,
        )
        report = simulate_report(request)
    except ValueError as error:
        raise click.UsageError(str(error)) from error
    click.echo(report.text)
    if json_path is not None and report.required is not None:
        Path(json_path).write_text(json.dumps(report.required, indent=2) + "\n")


@click.command()
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
@flag_options(ACCOUNTING_SYNC_FLAGS)
@click.option(
    "--codec", default="e3m0", help="Codec of the quantised variant: none, bf16, fp16, int8, e3m0."
)
@click.option(
    "--max-group-size",
    type=int,
    default=None,
    help="Staged rounds in groups of at most this many replicas, e.g. 16 [default: flat].",
)
def accounting(
    model: str,
    layers: int | None,
    params: float | None,
    step_time: float | None,
    tokens: float | None,
    batch_size: int,
    seq_len: int,
    codec: str,
    max_group_size: int | None,
    **sync: Any,
) -> None:
    """Bytes a whole run exchanges and the peak rate it needs, DP against DiLoCo variants.

    e.g. `diloco-node accounting --model 10B --replicas 4 --tokens 2e11`
    """
    from diloco.sim.commands import accounting_report

    try:
        settings = ACCOUNTING_SYNC_FLAGS.build(sync)
        text = accounting_report(
            model=model,
            num_layers=layers,
            num_params=params,
            step_seconds=step_time,
            num_tokens=tokens,
            batch_size=batch_size,
            seq_len=seq_len,
            num_replicas=settings.num_replicas,
            sync_every=settings.sync_every,
            fragment_size=settings.fragment_size,
            tau=settings.tau,
            codec=codec,
            max_group_size=max_group_size,
        )
    except ValueError as error:
        raise click.UsageError(str(error)) from error
    click.echo(text)


@click.group()
def bench() -> None:
    """Measure parts of the system on this machine."""


@bench.command("allreduce")
@flag_options(BENCH_FLAGS)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write results here.")
def bench_allreduce(json_path: str | None, **values: Any) -> None:
    """All-reduce of random vectors between real processes on this machine.

    e.g. `diloco-node bench allreduce --peers 4 --numel 10000000 --codec e3m0 --json r.json`
    """
    from diloco.bench.allreduce import run_allreduce_bench, summary

    try:
        config = BENCH_FLAGS.build(values, {"log_level": logging.getLogger().level})
        result = run_allreduce_bench(config)
    except ConfigError as error:
        raise click.UsageError(str(error)) from error
    except RuntimeError as error:
        raise click.ClickException(str(error)) from error
    click.echo(summary(result))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result.to_json(), f, indent=2)
