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
@click.option("--nodes", default=3, help="Nodes in the local swarm (separate processes).")
@click.option("--steps", default=600, help="Inner steps of the run.")
@click.option(
    "--folder",
    type=click.Path(file_okay=False),
    default=None,
    help="Where the nodes' metrics go [default: a new temporary folder].",
)
def demo(nodes: int, steps: int, folder: str | None) -> None:
    """A local swarm: one `start`, the others `join` its address; tiny model, embedded data.

    Each node is its own process with its own DHT and p2pd on loopback, training with
    Streaming DiLoCo (E3M0 outer gradients); ends with a summary of the run.
    """
    from diloco.node.demo import run_demo

    if nodes < 2:
        raise click.UsageError("a swarm needs at least 2 nodes")
    try:
        result = run_demo(nodes=nodes, steps=steps, echo=click.echo, folder=folder)
    except RuntimeError as error:
        raise click.ClickException(str(error)) from error
    if result["nodes_finished"] == 0:
        raise click.ClickException(f"no node finished; see the logs in {result['folder']}")
    sent = sum(result["bytes_sent"]) / len(result["bytes_sent"])
    dp = sum(result["dp_bytes_estimate"]) / len(result["dp_bytes_estimate"])
    losses = ", ".join(f"{x:.4f}" for x in result["eval_loss"])
    cus = ", ".join(f"{100 * x:.1f}%" for x in result["cu"])
    click.echo(
        f"\nsummary ({result['nodes_finished']}/{nodes} nodes finished, metrics in "
        f"{result['folder']}):"
    )
    click.echo(f"  eval loss of the outer weights: {losses}")
    click.echo(f"  compute utilisation: {cus}")
    click.echo(
        f"  sent per node: {sent / 1e6:.2f} MB; data-parallel would send about "
        f"{dp / 1e6:,.0f} MB ({dp / max(sent, 1):,.0f}x more)"
    )
    same = "yes" if result["identical_outer_states"] else "NO"
    click.echo(f"  all nodes hold bit-identical outer states: {same}")
    if not result["identical_outer_states"]:
        raise click.ClickException("the nodes' outer states differ")


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


# -- the node: start, join, status ------------------------------------------------------------

_RUN_FLAGS: dict[str, tuple[str, ...]] = {
    # option name -> path in RunConfig.to_dict()
    "name": ("name",),
    "preset": ("preset",),
    "seq_len": ("seq_len",),
    "steps": ("steps",),
    "sync_every": ("outer", "sync_every"),
    "fragment_size": ("fragment_size",),
    "pattern": ("pattern",),
    "embedding_fragment": ("embedding_fragment",),
    "codec": ("codec",),
    "rounding": ("rounding",),
    "outer_lr": ("outer", "outer_lr"),
    "outer_momentum": ("outer", "outer_momentum"),
    "alpha": ("outer", "fragment_update_alpha"),
    "inner_lr": ("inner", "lr"),
    "warmup": ("inner", "warmup_steps"),
    "seed": ("seed",),
    "data": ("data",),
}


def _run_options(f):  # type: ignore[no-untyped-def]
    """Flags of the run configuration (shared by every node of a run)."""
    options = [
        click.option(
            "--config",
            "config_file",
            type=click.Path(exists=True, dir_okay=False),
            help="TOML file of the run configuration (flags override it).",
        ),
        click.option("--name", default="diloco", help="Human name of the run."),
        click.option("--preset", default="tiny", help="Model preset (SPEC 7)."),
        click.option("--seq-len", default=128, help="Tokens per sequence."),
        click.option("--steps", default=600, help="T: inner steps of the whole run."),
        click.option(
            "--H", "sync_every", default=30, help="Inner steps between syncs of a fragment."
        ),
        click.option("--fragment-size", default=1, help="Blocks per fragment."),
        click.option("--pattern", type=click.Choice(["strided", "sequential"]), default="strided"),
        click.option("--embedding-fragment", type=click.Choice(["own", "first"]), default="own"),
        click.option("--codec", default="e3m0", help="Outer-gradient codec."),
        click.option("--rounding", type=click.Choice(["nearest", "stochastic"]), default="nearest"),
        click.option("--outer-lr", default=0.7, help="Outer Nesterov learning rate."),
        click.option("--outer-momentum", default=0.9, help="Outer Nesterov momentum."),
        click.option(
            "--alpha",
            type=float,
            default=None,
            help="Merge factor [default: 0.5 if tau > 0 else 0].",
        ),
        click.option("--inner-lr", default=1e-3, help="Peak AdamW learning rate."),
        click.option("--warmup", default=30, help="Learning-rate warm-up in steps."),
        click.option("--seed", default=0, help="Seed of the initial weights."),
        click.option(
            "--data",
            default=None,
            help="Corpus path on every node [default: the embedded Python sources].",
        ),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def _node_options(f):  # type: ignore[no-untyped-def]
    """Flags each volunteer chooses for their own node."""
    options = [
        click.option(
            "--tau",
            type=int,
            default=None,
            help="This node's overlap tau in steps [default: the run's, 1].",
        ),
        click.option("--batch-size", default=8, help="Sequences per inner step."),
        click.option("--device", default="cpu", help="torch device, e.g. cuda:0."),
        click.option(
            "--threads",
            default=0,
            help="torch CPU threads (0: torch's default; "
            "use 1 per node when several nodes share a machine).",
        ),
        click.option(
            "--checkpoint-dir",
            type=click.Path(file_okay=False),
            default=None,
            help="Save checkpoints here (every N steps and on Ctrl-C).",
        ),
        click.option(
            "--checkpoint-every", default=0, help="Checkpoint every N steps (0: only on exit)."
        ),
        click.option("--resume", is_flag=True, help="Continue from the newest checkpoint."),
        click.option(
            "--export",
            "export_path",
            type=click.Path(dir_okay=False),
            default=None,
            help="At the end, write the outer weights as plain safetensors here.",
        ),
        click.option(
            "--data-seed",
            type=int,
            default=None,
            help="Seed of this node's data stream [default: random].",
        ),
        click.option("--log-every", default=25, help="A progress line every N steps."),
        click.option(
            "--metrics-out",
            type=click.Path(dir_okay=False),
            default=None,
            help="Append JSON lines: steps, rounds, progress, summary.",
        ),
        click.option(
            "--listen",
            "host_maddrs",
            multiple=True,
            default=["/ip4/127.0.0.1/tcp/0"],
            help="Multiaddr to listen on (repeatable); /ip4/0.0.0.0/tcp/31337 "
            "accepts peers from other machines.",
        ),
        click.option(
            "--announce",
            "announce_maddrs",
            multiple=True,
            help="Public multiaddr to announce (repeatable).",
        ),
        click.option(
            "--identity",
            type=click.Path(dir_okay=False),
            default=None,
            help="Private key file for a stable peer id (created if missing).",
        ),
        click.option(
            "--use-relay",
            is_flag=True,
            help="Reach and be reached through relays (peers behind NAT).",
        ),
        click.option(
            "--nat-port-map",
            is_flag=True,
            help="Ask the router for a port mapping (UPnP); off by default.",
        ),
        click.option("--min-group-size", default=2, help="Fewest members for a round."),
        click.option(
            "--matchmaking-window",
            default=2.0,
            help="Seconds to wait for peers at a round's send step.",
        ),
        click.option("--round-timeout", default=10.0, help="Seconds to wait for parts."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def _run_config(ctx: click.Context, o: dict[str, object], only_given: bool = False):  # type: ignore[no-untyped-def]
    """RunConfig from ``--config`` then flags; with ``only_given``, the flags typed by the
    user as a dict of paths (for comparing with a swarm's configuration)."""
    from click.core import ParameterSource

    from diloco.node.trainer import RunConfig

    base = RunConfig.from_toml(str(o["config_file"])).to_dict() if o["config_file"] else None
    data = base if base is not None else RunConfig().to_dict()
    given = {}
    for name, path in _RUN_FLAGS.items():
        from_command_line = ctx.get_parameter_source(name) == ParameterSource.COMMANDLINE
        if base is not None and not from_command_line:
            continue
        if only_given and not from_command_line:
            continue
        target = data
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = o[name]
        given[path] = o[name]
    if o.get("tau") is not None and not only_given:
        data["outer"]["fragment_sync_delay"] = o["tau"]
    if only_given:
        return given, base
    return RunConfig.from_dict(data)


def _node_parts(o: dict[str, object]):  # type: ignore[no-untyped-def]
    import os

    from diloco.node.swarm_node import NetworkOptions
    from diloco.node.trainer import NodeOptions

    options = NodeOptions(
        batch_size=o["batch_size"],
        tau=o["tau"],
        device=o["device"],
        checkpoint_dir=o["checkpoint_dir"],
        checkpoint_every=o["checkpoint_every"],
        log_every=o["log_every"],
        threads=o["threads"],
        data_seed=o["data_seed"]
        if o["data_seed"] is not None
        else int.from_bytes(os.urandom(4), "little"),
    )  # type: ignore[arg-type]
    net = NetworkOptions(
        host_maddrs=list(o["host_maddrs"]),
        announce_maddrs=list(o["announce_maddrs"]),
        identity_path=o["identity"],
        use_relay=o["use_relay"],
        nat_port_map=o["nat_port_map"],
        min_group_size=o["min_group_size"],
        matchmaking_window=o["matchmaking_window"],
        round_timeout=o["round_timeout"],
    )  # type: ignore[arg-type]
    return options, net


def _echo_node_event(record: dict[str, object]) -> None:
    event = record.get("event")
    if event == "progress":
        click.echo(
            f"step {record['step']:>6}  loss {record['loss']:.4f}  "
            f"{record['tokens_per_s']:,.0f} tok/s  CU {100 * record['cu']:.1f}%  "  # type: ignore[operator]
            f"sent {record['mb_sent']:.2f} MB  recv {record['mb_received']:.2f} MB  "
            f"peers {record['peers_last_round']}"
        )
    elif event == "joined":
        click.echo(f"joined at step {record['step']}, fragment versions {record['versions']}")
    elif event == "healed":
        click.echo(f"healed fragments {record['fragments']} at step {record['step']}")
    elif event == "summary":
        click.echo(
            f"done at step {record['step']}: eval loss {record['eval_loss']:.4f} (outer), "
            f"CU {100 * record['cu']:.1f}%, sent {record['bytes_sent'] / 1e6:.2f} MB "  # type: ignore[operator]
            f"(data-parallel: {record['dp_bytes_estimate'] / 1e6:.0f} MB), "  # type: ignore[operator]
            f"{record['failed_rounds']} failed rounds"
        )


def _run_node(run, options, net, o: dict[str, object], join: bool, dht=None) -> None:  # type: ignore[no-untyped-def]
    import signal

    from diloco.errors import DilocoError
    from diloco.node.swarm_node import SwarmNode

    try:
        node = SwarmNode(
            run,
            options,
            net,
            metrics_out=o["metrics_out"],
            resume=o["resume"],
            on_event=_echo_node_event,
            dht=dht,
        )  # type: ignore[arg-type]
    except (DilocoError, ValueError) as error:
        raise click.ClickException(str(error)) from error
    interrupts = 0

    def on_signal(signum: int, frame: object) -> None:
        nonlocal interrupts
        interrupts += 1
        if interrupts > 1:
            raise KeyboardInterrupt
        click.echo("stopping: finishing rounds in flight, saving, leaving the swarm...", err=True)
        node.stop_event.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        click.echo(f"run {node.run_id}, peer {node.swarm.peer_id.to_base58()}")
        if node.resumed_from:
            click.echo(f"resumed from {node.resumed_from} at step {node.trainer.step}")
        elif join:
            node.join_swarm()
        click.echo(
            "share one of these addresses; others join with "
            "`diloco-node join --initial-peers ADDR`:"
        )
        for addr in node.maddrs:
            click.echo(addr)
        node.train()
        if o["export_path"]:
            node.trainer.export_outer(str(o["export_path"]))
            click.echo(f"outer weights written to {o['export_path']}")
    except DilocoError as error:
        raise click.ClickException(str(error)) from error
    finally:
        node.close()
        for s, handler in previous.items():
            signal.signal(s, handler)


@main.command()
@_run_options
@_node_options
@click.pass_context
def start(ctx: click.Context, **o: object) -> None:
    """Start the first node of a run and print the addresses others join with.

    e.g. `diloco-node start --name demo --steps 600 --checkpoint-dir ckpt`
    """
    from diloco.errors import ConfigError

    try:
        run = _run_config(ctx, o)
        options, net = _node_parts(o)
    except (ConfigError, ValueError) as error:
        raise click.UsageError(str(error)) from error
    _run_node(run, options, net, o, join=False)


@main.command()
@click.option(
    "--initial-peers",
    multiple=True,
    required=True,
    help="Multiaddr of a running node (repeatable, or several separated by spaces).",
)
@click.option("--run-name", default=None, help="Which run, if the swarm holds several.")
@_run_options
@_node_options
@click.pass_context
def join(
    ctx: click.Context, initial_peers: tuple[str, ...], run_name: str | None, **o: object
) -> None:
    """Join a running swarm: its run configuration and state come from the peers.

    e.g. `diloco-node join --initial-peers /ip4/1.2.3.4/tcp/31337/p2p/12D3KooW...`
    """
    from diloco.errors import ConfigError
    from diloco.node.swarm_node import config_mismatch, discover_run
    from diloco.node.trainer import RunConfig

    peers = [addr for value in initial_peers for addr in value.split()]
    try:
        options, net = _node_parts(o)
        net.initial_peers = peers
        given, base = _run_config(ctx, o, only_given=True)
    except (ConfigError, ValueError) as error:
        raise click.UsageError(str(error)) from error
    try:
        run, dht = discover_run(net, run_name)
    except ConfigError as error:
        raise click.ClickException(str(error)) from error
    theirs = run.to_dict()
    mine = base if base is not None else dict(theirs)
    mine = {**mine, "outer": dict(mine["outer"]), "inner": dict(mine["inner"])}
    for path, value in given.items():
        target = mine
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
    mine["outer"]["fragment_sync_delay"] = theirs["outer"]["fragment_sync_delay"]
    diffs = config_mismatch(RunConfig.from_dict(mine), run)
    if diffs:
        dht.shutdown()
        raise click.ClickException(
            "your run configuration differs from the swarm's:\n  "
            + "\n  ".join(diffs)
            + "\ndrop these options (a joiner needs no training flags) or join another swarm"
        )
    _run_node(run, options, net, o, join=True, dht=dht)


@main.command()
@click.option("--initial-peers", multiple=True, required=True, help="Multiaddr of a node.")
def status(initial_peers: tuple[str, ...]) -> None:
    """Show the swarm: runs, peers, their steps, fragment versions and state hashes."""
    from diloco.node.swarm_status import read_status

    peers = [addr for value in initial_peers for addr in value.split()]
    try:
        runs = read_status(peers)
    except Exception as error:  # an unreachable swarm is the user's answer, not a crash
        raise click.ClickException(f"could not read the swarm: {error}") from error
    if not runs:
        click.echo("no run found")
    for run_id, records in runs.items():
        click.echo(f"run {run_id}: {len(records)} node(s)")
        for r in records:
            versions = " ".join(
                f"{f.fragment}:v{f.version}:{f.state_hash[:8]}" for f in r.fragments
            )
            click.echo(
                f"  {r.peer_id[-12:]}  step {r.global_step:>7}  "
                f"{r.throughput:,.0f} tok/s  v{r.software_version}  {versions}"
            )
