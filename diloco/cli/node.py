"""Commands for volunteers: ``start`` a run, ``join`` one, ``status`` of a swarm, ``demo``,
``keygen`` (a closed swarm's key).

Bad flags or files are ``click.UsageError`` (exit 2), found before anything starts;
failures while running (an unreachable swarm, a refused configuration) are
``click.ClickException`` (exit 1). A node stopped by SIGINT or SIGTERM saves its
checkpoint, leaves the swarm and exits 128 + the signal's number (130, 143).
"""

from __future__ import annotations

import dataclasses
import signal
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import click

from diloco.cli.node_checks import check_checkpoints, check_peer_addresses, check_ports
from diloco.cli.node_lines import progress_line, startup_lines, summary_line
from diloco.cli.node_observe import serve_prometheus, trackers
from diloco.cli.options import JoinCommand, flag_options, typed_flags
from diloco.errors import CheckpointError, ConfigError, DilocoError
from diloco.node.config import NodeOptions, RoundOptions, RunConfig, resolve_vocab
from diloco.node.data.corpus import BYTES, corpus_info
from diloco.node.flags import (
    NETWORK_FLAGS,
    NODE_FLAGS,
    ROUND_FLAGS,
    RUN_FLAGS,
    join_mismatch,
    run_config,
)
from diloco.node.model.transformer import preset
from diloco.node.training.outer_config import check_tau
from diloco.protocol.runtime.network import NetworkOptions
from diloco.protocol.runtime.processes import quiet_helper_disconnects
from diloco.protocol.trust.admission import read_admitted
from diloco.protocol.trust.swarm_key import SwarmKey, load_swarm_key
from diloco.protocol.wire.run_id import check_run_id

if TYPE_CHECKING:
    from hivemind import DHT

    from diloco.node.observe.trackers import Tracker
    from diloco.protocol.records.run_configs import SignedRunConfig

F = TypeVar("F", bound=Callable[..., Any])

STOPPED_EXIT = 128
"""A node stopped by a signal, once saved and gone, exits with this plus the signal's number:
130 after Ctrl-C (SIGINT), 143 after SIGTERM."""


def _node_flags(f: F) -> F:
    """Every flag of ``start`` and ``join``: the run's, then the node's own."""
    f = click.option(
        "--export",
        "export_path",
        type=click.Path(dir_okay=False),
        default=None,
        help="At the end, write the outer weights as plain safetensors here.",
    )(f)
    f = click.option(
        "--export-hf",
        "export_hf",
        type=click.Path(file_okay=False),
        default=None,
        help="At the end, write the outer weights as a transformers folder (config.json, "
        "model.safetensors) that AutoModelForCausalLM loads.",
    )(f)
    f = click.option("--resume", is_flag=True, help="Continue from the newest checkpoint.")(f)
    f = click.option(
        "--prometheus-host",
        default="127.0.0.1",
        help="Address of the Prometheus endpoint; 0.0.0.0 for scrapers on other machines.",
    )(f)
    f = click.option(
        "--prometheus-port",
        type=int,
        default=None,
        help="Serve Prometheus metrics at http://HOST:PORT/metrics (0: any free port).",
    )(f)
    f = click.option(
        "--tensorboard-dir",
        type=click.Path(file_okay=False),
        default=None,
        help="Write TensorBoard curves under DIR/<short peer id> (needs the [tensorboard] extra).",
    )(f)
    f = click.option(
        "--wandb-project",
        default=None,
        help="Log curves to this Weights & Biases project, one W&B run per node grouped by "
        "run id (needs the [wandb] extra; WANDB_MODE=offline keeps them on this machine).",
    )(f)
    f = click.option(
        "--metrics-out",
        type=click.Path(dir_okay=False),
        default=None,
        help="Append JSON lines: steps, rounds, progress, summary.",
    )(f)
    f = flag_options(RUN_FLAGS, NODE_FLAGS, ROUND_FLAGS, NETWORK_FLAGS)(f)
    return click.option(
        "--config",
        "config_file",
        type=click.Path(exists=True, dir_okay=False),
        default=None,
        help="TOML file of the run configuration (typed flags override it).",
    )(f)


def _local_choices(params: dict[str, Any]) -> tuple[NodeOptions, RoundOptions, NetworkOptions]:
    return NODE_FLAGS.build(params), ROUND_FLAGS.build(params), NETWORK_FLAGS.build(params)


def _check_data(run: RunConfig, data: str | None, define: bool) -> RunConfig:
    """The run, checked against this node's corpus before anything starts; a run being
    defined (``define``: ``start``) takes its tokenizer identity from its corpus and,
    without ``--vocab-size``, a larger vocabulary from a prepared corpus's tokenizer.

    Raises:
        ConfigError: the corpus's ids do not fit the run's model, were made by another
            tokenizer than the run's, or it is not the dataset the run pins.
    """
    info = corpus_info(data)
    preset_vocab = preset(run.preset).vocab_size
    if define and run.vocab_size is None:
        resolved = resolve_vocab(preset_vocab, None, info.vocab_size)
        if resolved != preset_vocab:  # a run that keeps the preset's stays as it was named
            run = dataclasses.replace(run, vocab_size=resolved)
    if define and run.tokenizer == BYTES:  # the run's tokens are its creator's
        run = dataclasses.replace(run, tokenizer=info.tokenizer)
    what = f"--data {data}" if data else "the embedded corpus"
    run.check_corpus(info.vocab_size, info.fingerprint, what, tokenizer=info.tokenizer)
    return run


@click.command()
@click.option(
    "--admit",
    "admit_path",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="Admit only these peers: a file of peer ids, one per line (# comments), which the "
    "run's configuration holds (signed by this node, the creator, always admitted). Every "
    "node ignores the records and refuses the streams of other peers, even holders of a "
    "leaked --swarm-key. `diloco-node keygen --identity FILE` prints a node's peer id.",
)
@_node_flags
@click.pass_context
def start(ctx: click.Context, /, admit_path: str | None, **_: object) -> None:
    """Start the first node of a run and print the addresses others join with.

    e.g. `diloco-node start --name demo --steps 600 --checkpoint-dir ckpt`
    """
    try:
        given = typed_flags(ctx, RUN_FLAGS)
        options, rounds, net = _local_choices(ctx.params)
        run = run_config(ctx.params["config_file"], given, options.fixed_tau)
        if net.swarm_key_path is not None:
            key_id = load_swarm_key(net.swarm_key_path).key_id
            run = dataclasses.replace(run, swarm_key_id=key_id)
        if admit_path is not None:
            run = dataclasses.replace(run, admitted=read_admitted(admit_path))
        run = _check_data(run, options.data, define=True)
        check_ports(net)
        check_checkpoints(options.checkpoint_dir, ctx.params["resume"], run, "yours")
    except (ConfigError, CheckpointError) as error:
        raise click.UsageError(str(error)) from error
    _run_node(run, options, rounds, net, ctx.params, join=False)


@click.command(cls=JoinCommand)
@click.option(
    "--initial-peers",
    multiple=True,
    required=True,
    help="Multiaddr of a running node (repeatable, or several separated by spaces).",
)
@click.option(
    "--run-id",
    default=None,
    help="Join only this run (NAME-<16 hex>, as `start` and `status` print it); needed when "
    "the initial peers train different runs.",
)
@_node_flags
@click.pass_context
def join(
    ctx: click.Context, /, initial_peers: tuple[str, ...], run_id: str | None, **_: object
) -> None:
    """Join the run of the peers you name: its configuration (signed by the run's creator)
    and state come from them, never from a configuration that merely shares its name.

    e.g. `diloco-node join --initial-peers /ip4/1.2.3.4/tcp/31337/p2p/12D3KooW...`
    """
    from diloco.node.swarm.pinned_run import discover_run, kept_identity

    toml, given = ctx.params["config_file"], typed_flags(ctx, RUN_FLAGS)
    try:
        run_config(toml, given)  # typed run flags must make sense before the swarm is asked
        peers = tuple(addr for value in initial_peers for addr in value.split())
        check_peer_addresses(peers)
        options, rounds, net = _local_choices(ctx.params)
        net = dataclasses.replace(net, initial_peers=peers)
        if run_id is not None:
            check_run_id(run_id)
        check_ports(net)
        check_checkpoints(options.checkpoint_dir, ctx.params["resume"], None, "")
    except (ConfigError, CheckpointError) as error:
        raise click.UsageError(str(error)) from error
    net = kept_identity(net, options.checkpoint_dir)
    try:
        run, signed, dht = discover_run(net, run_id)
    except ConfigError as error:
        raise click.ClickException(str(error)) from error
    try:
        diffs = join_mismatch(run, toml, given)
        if options.fixed_tau is not None:
            check_tau(options.fixed_tau, run.outer.sync_every)
        _check_data(run, options.data, define=False)
        check_checkpoints(options.checkpoint_dir, ctx.params["resume"], run, "swarm's")
    except (ConfigError, CheckpointError) as error:
        dht.shutdown()
        raise click.UsageError(f"cannot join this swarm: {error}") from error
    if diffs:
        dht.shutdown()
        raise click.ClickException(
            "your run configuration differs from the swarm's:\n  "
            + "\n  ".join(diffs)
            + "\ndrop these options (a joiner needs no training flags) or join another swarm"
        )
    _run_node(run, options, rounds, net, ctx.params, join=True, joined=(signed, dht))


def _run_node(
    run: RunConfig,
    options: NodeOptions,
    rounds: RoundOptions,
    net: NetworkOptions,
    params: dict[str, Any],
    join: bool,
    joined: tuple[SignedRunConfig, DHT] | None = None,
) -> None:
    """Build the node (a joiner's ``joined`` run and DHT, or a new run whose creator this
    node is), train until the end or a signal, export; always leave the swarm."""
    from diloco.node.observe.trackers import check_available
    from diloco.node.swarm.node import SwarmNode
    from diloco.node.swarm.pinned_run import start_run

    try:
        check_available(params["wandb_project"], params["tensorboard_dir"])
    except ConfigError as error:
        if joined is not None:
            joined[1].shutdown()
        raise click.UsageError(str(error)) from error
    try:
        if joined is None:
            run, signed, dht = start_run(run, net, options.checkpoint_dir)
        else:
            signed, dht = joined
        node = SwarmNode(
            run,
            options,
            rounds,
            net,
            signed=signed,
            dht=dht,
            metrics_out=params["metrics_out"],
            resume=params["resume"],
            on_event=_echo_node_event,
        )
    except (DilocoError, ValueError) as error:
        raise click.ClickException(str(error)) from error
    exporter = serve_prometheus(node, params["prometheus_host"], params["prometheus_port"])
    watchers: list[Tracker] = [] if exporter is None else [exporter]
    watchers += trackers(node, run, params)

    def on_event(record: dict[str, Any]) -> None:
        _echo_node_event(record)
        for watcher in watchers:
            watcher.observe(record)

    node.on_event = on_event
    stopped_by: list[int] = []

    def on_signal(signum: int, frame: object) -> None:
        stopped_by.append(signum)
        if len(stopped_by) > 1:
            raise KeyboardInterrupt
        click.echo("stopping: finishing rounds in flight, saving, leaving the swarm...", err=True)
        node.stop_event.set()

    quiet_helper_disconnects()  # a stop by SIGTERM to the group prints no thread traceback
    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        click.echo(f"run {node.run_id}, peer {node.swarm.peer_id.to_base58()}")
        lines = startup_lines(
            device=str(node.trainer.device),
            precision=options.compute.precision,
            data=options.data,
            vocab_size=run.model_config().vocab_size,
            preset=run.preset,
            num_params=sum(p.numel() for p in node.trainer.model.parameters()),
        )
        for line in lines:
            click.echo(line)
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
        if params["export_path"]:
            node.trainer.export_outer(params["export_path"])
            click.echo(f"outer weights written to {params['export_path']}")
        if params["export_hf"]:
            node.trainer.export_hf(params["export_hf"])
            click.echo(f"transformers model written to {params['export_hf']}")
    except DilocoError as error:
        raise click.ClickException(str(error)) from error
    finally:
        node.close()
        for watcher in watchers:
            watcher.close()
        for s, handler in previous.items():
            signal.signal(s, handler)
    if stopped_by:
        # Saved and left; the exit status a shell gives a process that this signal ended.
        raise SystemExit(STOPPED_EXIT + stopped_by[0])


def _echo_node_event(record: dict[str, Any]) -> None:
    event = record.get("event")
    if event == "progress":
        click.echo(progress_line(record))
    elif event == "joined":
        click.echo(f"joined at step {record['step']}, fragment versions {record['versions']}")
    elif event == "healed":
        click.echo(f"healed fragments {record['fragments']} at step {record['step']}")
    elif event == "summary":
        click.echo(summary_line(record))


@click.command()
@click.option("--initial-peers", multiple=True, required=True, help="Multiaddr of a node.")
def status(initial_peers: tuple[str, ...]) -> None:
    """Show the swarm: runs (with their creators), peers, their steps, fragment versions and
    state hashes. Runs that share a name are different runs: tell them apart by run id."""
    from diloco.node.swarm.status import read_status

    peers = [addr for value in initial_peers for addr in value.split()]
    try:
        runs = read_status(peers)
    except Exception as error:  # an unreachable swarm is the user's answer, not a crash
        raise click.ClickException(f"could not read the swarm: {error}") from error
    if not runs:
        click.echo("no run found")
    for run_id, (signed, records) in runs.items():
        key_id = signed.config.get("swarm_key_id")
        closed = f", closed swarm (key id {key_id})" if key_id else ""
        if isinstance(admitted := signed.config.get("admitted"), list):
            closed += f", {len(admitted)} peer(s) admitted besides the creator"
        click.echo(f"run {run_id}: creator {signed.creator}{closed}, {len(records)} node(s)")
        for r in records:
            versions = " ".join(
                f"{f.fragment}:v{f.version}:{f.state_hash[:8]}" for f in r.fragments
            )
            click.echo(
                f"  {r.peer_id[-12:]}  step {r.global_step:>7}  "
                f"{r.throughput:,.0f} tok/s  v{r.software_version}  {versions}"
            )


@click.command()
@click.option(
    "--swarm-key",
    "path",
    type=click.Path(dir_okay=False),
    default=None,
    help="Write a new swarm key here (a file that does not exist yet).",
)
@click.option(
    "--identity",
    "identity_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="Print the peer id of this identity file (created if missing), for `start --admit`.",
)
def keygen(path: str | None, identity_path: str | None) -> None:
    """Write a new random key for a closed swarm (32 bytes, mode 0600), or print the peer id
    of a node's identity file.

    Start the run with `start --swarm-key FILE`, and give the file, privately, to every
    member: each joins with `join --swarm-key FILE`; nodes without it are refused. To admit
    only named members, each runs `keygen --identity FILE`, sends the peer id it prints to
    the creator, and joins with `--identity FILE`; the creator lists the ids in a file and
    starts with `--admit` that file.
    """
    if path is None and identity_path is None:
        raise click.UsageError("name --swarm-key FILE (a new key) or --identity FILE (a peer id)")
    if identity_path is not None:
        from diloco.protocol.trust.identity import load_or_create_identity

        try:
            click.echo(load_or_create_identity(identity_path).peer_id)
        except ConfigError as error:
            raise click.UsageError(str(error)) from error
    if path is not None:
        key = SwarmKey.generate()
        try:
            key.write(path)
        except ConfigError as error:
            raise click.UsageError(str(error)) from error
        click.echo(f"wrote a swarm key to {path} (key id {key.key_id}); share it only with members")


@click.command()
@click.option("--nodes", default=3, help="Nodes in the local swarm (separate processes).")
@click.option("--steps", default=RunConfig().steps, help="T: inner steps of the run.")
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
