"""``diloco-node``: thin click commands; each parses, builds a config and calls one entry point.

By audience: ``node`` (``start``, ``join``, ``status``, ``keygen``, ``demo``: volunteers),
``dashboard`` (a live page of a swarm), ``data`` (``prepare-data``: volunteers' corpora) and
``experiments`` (``local``, ``simulate``, ``accounting``, ``bench``: one machine) and
``swarm_sim`` (``simulate-swarm``: the protocol at thousands of simulated peers). Our
errors map to ``click.UsageError`` (exit 2) for bad configuration and
``click.ClickException`` (exit 1) for failures while running.
"""

from __future__ import annotations

import logging

import click

from diloco import __version__
from diloco.cli.dashboard import dashboard
from diloco.cli.data import prepare_data
from diloco.cli.experiments import accounting, bench, local, simulate
from diloco.cli.node import demo, join, keygen, start, status
from diloco.cli.swarm_sim import simulate_swarm


@click.group(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.version_option(__version__, prog_name="diloco-node")
@click.option("-v", "--verbose", count=True, help="More log output (-v info, -vv debug).")
def main(verbose: int) -> None:
    """Pretrain one language model together over the internet with Streaming DiLoCo."""
    level = {0: logging.WARNING, 1: logging.INFO}.get(verbose, logging.DEBUG)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Waiting for peers, a first group, failed rounds by cause: sparse lines a person needs.
    logging.getLogger("diloco.node.swarm.round_failures").setLevel(min(level, logging.INFO))


for _command in (
    start,
    join,
    status,
    keygen,
    dashboard,
    demo,
    prepare_data,
    local,
    simulate,
    simulate_swarm,
    accounting,
    bench,
):
    main.add_command(_command)
