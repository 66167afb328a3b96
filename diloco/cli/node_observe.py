"""A node's observers, opened by `start`/`join` from their flags: the Prometheus
endpoint (``--prometheus-port``) and the W&B / TensorBoard trackers."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click

from diloco.node.config import RunConfig

if TYPE_CHECKING:
    from diloco.node.observe.metrics_exporter import NodeMetrics
    from diloco.node.observe.trackers import Tracker
    from diloco.node.swarm.node import SwarmNode


def serve_prometheus(node: SwarmNode, host: str, port: int | None) -> NodeMetrics | None:
    """With ``--prometheus-port``: a metrics endpoint fed by the node's events."""
    if port is None:
        return None
    from diloco.node.observe.metrics_exporter import NodeMetrics

    exporter = NodeMetrics()
    try:
        bound = exporter.serve(port, host)
    except OSError as error:
        node.close()
        raise click.ClickException(f"cannot serve metrics on {host}:{port}: {error}") from error
    click.echo(f"Prometheus metrics at http://{host}:{bound}/metrics")
    return exporter


def trackers(node: SwarmNode, run: RunConfig, params: dict[str, Any]) -> list[Tracker]:
    """With ``--wandb-project`` / ``--tensorboard-dir``: the node's curves there."""
    from diloco.node.observe.trackers import TensorboardTracker, WandbTracker

    peer_id = node.swarm.peer_id.to_base58()
    made: list[Tracker] = []
    try:
        if params["wandb_project"]:
            config = run.to_dict() | {"batch_size": node.options.batch_size}
            made.append(WandbTracker(params["wandb_project"], node.run_id, peer_id, config))
        if params["tensorboard_dir"]:
            board = TensorboardTracker(params["tensorboard_dir"], peer_id)
            made.append(board)
            click.echo(f"TensorBoard curves in {board.log_dir}")
    except Exception as error:  # a missing package or W&B refusing: one line, no node left
        for tracker in made:
            tracker.close()
        node.close()
        raise click.ClickException(str(error)) from error
    return made
