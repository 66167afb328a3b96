"""``diloco-node dashboard``: follow a swarm and serve a live web page of it."""

from __future__ import annotations

import signal
import threading

import click

from diloco.errors import ConfigError
from diloco.protocol.runtime.network import LOOPBACK, NetworkOptions


@click.command()
@click.option(
    "--initial-peers",
    multiple=True,
    required=True,
    help="Multiaddr of a running node (repeatable, or several separated by spaces).",
)
@click.option("--port", default=8080, help="Port of the web page (0: any free port).")
@click.option(
    "--host",
    default="127.0.0.1",
    help="Address of the web page; 0.0.0.0 shows it to other machines.",
)
@click.option("--run-name", default=None, help="Which run, if the swarm holds several.")
@click.option(
    "--listen",
    multiple=True,
    default=(LOOPBACK,),
    help="Multiaddr of the dashboard's own DHT node (repeatable).",
)
@click.option("--poll-every", default=2.0, help="Seconds between two reads of the DHT.")
def dashboard(
    initial_peers: tuple[str, ...],
    port: int,
    host: str,
    run_name: str | None,
    listen: tuple[str, ...],
    poll_every: float,
) -> None:
    """Serve a live page of a swarm: peers, loss curves, rounds, fragment versions.

    A read-only peer: it trains nothing and joins no round. JSON at /api/state and
    /api/{run,peers,loss,rounds,fragments,totals}.

    e.g. `diloco-node dashboard --initial-peers /ip4/1.2.3.4/tcp/31337/p2p/12D3KooW...`
    """
    from diloco.node.dashboard.follower import SwarmFollower
    from diloco.node.dashboard.server import DashboardServer
    from diloco.node.dashboard.view import SwarmView

    peers = tuple(addr for value in initial_peers for addr in value.split())
    try:
        net = NetworkOptions(initial_peers=peers, host_maddrs=listen)
    except ConfigError as error:
        raise click.UsageError(str(error)) from error
    view = SwarmView()
    try:  # the DHT is a forked process: before the server's threads
        follower = SwarmFollower(view, net, run_name, poll_every)
    except ConfigError as error:
        raise click.UsageError(str(error)) from error
    except Exception as error:  # p2pd says why in its message; the user needs that line
        raise click.ClickException(f"cannot reach the swarm: {error}") from error
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            server = DashboardServer(view, host, port)
        except OSError as error:
            raise click.ClickException(f"cannot serve on {host}:{port}: {error}") from error
        follower.start()
        server.start()
        click.echo(f"dashboard at {server.url} (Ctrl-C stops it)")
        while not stop.wait(1.0):
            pass
        server.close()
    finally:
        follower.close()
        for s, handler in previous.items():
            signal.signal(s, handler)
