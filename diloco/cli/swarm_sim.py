"""``diloco-node simulate-swarm``: the protocol simulator's table."""

from __future__ import annotations

from typing import cast

import click

from diloco.sim.accounting import CODEC_BITS
from diloco.sim.protocol_sim import RULES, LinkModel, Rule, SwarmSpec

_LINKS = LinkModel()
_SPEC = SwarmSpec(num_peers=2)


def _ints(value: str) -> list[int | None]:
    try:
        return [None if v == "flat" else int(v) for v in value.split(",")]
    except ValueError as error:
        raise click.BadParameter(f"expected sizes like 8,16,flat, got {value!r}") from error


def _floats(value: str) -> list[float]:
    try:
        return [float(v) for v in value.split(",")]
    except ValueError as error:
        raise click.BadParameter(f"expected seconds like inf,3600, got {value!r}") from error


@click.command("simulate-swarm")
@click.option("--peers", default="64,256,1024,4096", help="N: peers in the round, e.g. 64,4096.")
@click.option("--group-sizes", default="8,16,32,64,flat", help="max_group_size values, or flat.")
@click.option("--lifetime", default="inf", help="Mean seconds until a peer dies, e.g. inf,3600.")
@click.option("--rule", type=click.Choice([*RULES, "both"]), default="both", help="Lost parts.")
@click.option("--values", "num_values", default=_SPEC.num_values, help="Values of the fragment.")
@click.option("--codec", type=click.Choice(list(CODEC_BITS)), default="e3m0", help="Wire codec.")
@click.option("--up-mbps", default=_LINKS.up_mbps, help="Median uplink, Mbit/s.")
@click.option("--down-mbps", default=_LINKS.down_mbps, help="Median downlink, Mbit/s.")
@click.option("--sigma", default=_LINKS.sigma, help="Log-normal spread of link rates.")
@click.option("--stream-loss", default=_LINKS.stream_loss, help="P(stream lost), e.g. 1e-4.")
@click.option("--timeout-factor", default=_SPEC.timeout_factor, help="Stage budget / nominal.")
@click.option("--rounds", default=5, help="Rounds per row.")
@click.option("--seed", default=0, help="Random seed.")
def simulate_swarm(
    peers: str,
    group_sizes: str,
    lifetime: str,
    rule: str,
    num_values: int,
    codec: str,
    up_mbps: float,
    down_mbps: float,
    sigma: float,
    stream_loss: float,
    timeout_factor: float,
    rounds: int,
    seed: int,
) -> None:
    """Round success and duration of flat and staged rounds among simulated peers.

    e.g. `diloco-node simulate-swarm --peers 1024 --group-sizes 16,flat --lifetime inf,3600`
    """
    from diloco.sim.commands import swarm_report

    try:
        counts = [n for n in _ints(peers) if n is not None]
        base = SwarmSpec(
            num_peers=max(counts),
            num_values=num_values,
            bits=CODEC_BITS[codec],
            timeout_factor=timeout_factor,
            links=LinkModel(
                up_mbps=up_mbps, down_mbps=down_mbps, sigma=sigma, stream_loss=stream_loss
            ),
        )
        lines = swarm_report(
            peers=counts,
            group_sizes=_ints(group_sizes),
            lifetimes=_floats(lifetime),
            rules=RULES if rule == "both" else (cast(Rule, rule),),
            num_rounds=rounds,
            seed=seed,
            base=base,
        )
        for line in lines:
            click.echo(line)
    except ValueError as error:
        raise click.UsageError(str(error)) from error
