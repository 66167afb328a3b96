"""Which run a node trains (docs/design.md "Threat model", a pinned run): never one picked from the
DHT by name.

``start_run`` makes the first node the run's creator: the configuration names the node's
peer id and the node signs it, so the run id (name + hash of the configuration) belongs to
this node's key. ``discover_run`` asks the peers a joiner was given, over RUN_INFO, which
run they train, verifies hash and creator signature, and follows that run (or the one
``--run-id`` pins). Local choices (data path, device, ports, files) are never part of the
run configuration, so nothing a joiner reads from the swarm names a path on its disk.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Sequence
from pathlib import Path

from hivemind import DHT

from diloco.errors import ConfigError
from diloco.node.config import RunConfig
from diloco.protocol.records.run_configs import SignedRunConfig, find_run_configs
from diloco.protocol.records.run_info import ask_peers, choose_run, peer_id_in
from diloco.protocol.runtime.network import NetworkOptions
from diloco.protocol.swarm import make_dht
from diloco.protocol.trust.envelopes import signer
from diloco.protocol.wire.run_id import make_run_id

logger = logging.getLogger(__name__)

DISCOVERY_ATTEMPTS = 3
"""Tries to reach the bootstrap peers before ``join`` gives up (p2pd's first dial can fail)."""
IDENTITY_FILE = "identity.key"
"""Where a node keeps its identity in its checkpoint dir (unless ``--identity`` says)."""


def kept_identity(net: NetworkOptions, checkpoint_dir: str | None) -> NetworkOptions:
    """``net`` with the identity a node keeps in ``checkpoint_dir`` (``IDENTITY_FILE``,
    created on the first start) when ``--identity`` names none; unchanged without a
    checkpoint dir (a new peer id each start).

    A node that resumes must come back as the peer it was: its peers count the vouches and
    steps of the peers they saw work, by peer id (docs/design.md "Healing and joining"), and
    the creator's run id belongs to its key.
    """
    if net.identity_path is not None or checkpoint_dir is None:
        return net
    Path(checkpoint_dir).mkdir(parents=True, exist_ok=True)
    return dataclasses.replace(net, identity_path=str(Path(checkpoint_dir) / IDENTITY_FILE))


def start_run(
    run: RunConfig, net: NetworkOptions, checkpoint_dir: str | None
) -> tuple[RunConfig, SignedRunConfig, DHT]:
    """Start the first node's DHT and make this node the run's creator: ``run`` with its
    ``creator``, signed by this node; returns them with the running DHT, which the node then
    keeps (shut it down if the node is not built).

    The creator must keep its identity for the run id to survive a restart: without
    ``--identity`` it lives in ``checkpoint_dir`` (``kept_identity``), and without a
    checkpoint dir each start creates a new run.

    Raises:
        ConfigError: a bad identity file, or a run configuration that names another creator.
    """
    dht = make_dht(kept_identity(net, checkpoint_dir))
    try:
        identity = signer(dht)
        if run.creator not in (None, identity.peer_id):
            raise ConfigError(
                f"the run configuration names creator {run.creator}, but this node is "
                f"{identity.peer_id}: only the creator starts its run (drop `creator`, or "
                "start with its --identity)"
            )
        run = dataclasses.replace(run, creator=identity.peer_id)
        signed = SignedRunConfig.sign(identity, make_run_id(run.name, run.to_dict()), run.to_dict())
    except BaseException:
        dht.shutdown()
        raise
    return run, signed, dht


def discover_run(
    net: NetworkOptions, run_id: str | None = None
) -> tuple[RunConfig, SignedRunConfig, DHT]:
    """Ask the initial peers which run they train (RUN_INFO, ``diloco.protocol.records.run_info``);
    returns that run with the running DHT, which the node then keeps (shut it down if the
    node is not built). Never a configuration from the DHT: one that merely shares the
    run's name is someone else's run.

    Raises:
        ConfigError: an address without a peer id, an unreachable swarm, peers that train
            different runs (without ``run_id``), ``run_id`` not trained by any of them, or a
            run configuration this version cannot train.
    """
    peers = [peer_id_in(addr) for addr in net.initial_peers]
    for attempt in range(DISCOVERY_ATTEMPTS):
        try:
            dht = make_dht(net)
            break
        except ConfigError:  # e.g. an identity file that is not an Ed25519 key
            raise
        except Exception as error:  # p2pd says why in its message; the user needs that line
            if attempt + 1 == DISCOVERY_ATTEMPTS:
                where = " ".join(net.initial_peers)
                raise ConfigError(f"cannot reach the swarm at {where}: {error}") from error
            logger.warning("cannot reach the swarm yet (%s); retrying", error)
            time.sleep(2.0)
    try:
        answers = asyncio.run(_ask_run_info(dht, peers))
        try:
            signed = choose_run(answers, run_id)
        except ConfigError as error:
            raise ConfigError(f"{error}{_same_name_hint(dht, run_id)}") from error
        try:
            run = RunConfig.from_dict(signed.config)
        except ConfigError as error:
            raise ConfigError(f"cannot train run {signed.run_id}: {error}") from error
    except BaseException:
        dht.shutdown()
        raise
    return run, signed, dht


async def _ask_run_info(dht: DHT, peers: Sequence[str]) -> dict[str, SignedRunConfig | str]:
    p2p = await dht.replicate_p2p()
    try:
        return await ask_peers(p2p, peers, DISCOVERY_ATTEMPTS)
    finally:
        await p2p.shutdown()


def _same_name_hint(dht: DHT, run_id: str | None) -> str:
    """For a pinned run no initial peer trains: the runs of that name the DHT lists."""
    if run_id is None:
        return ""
    try:
        listed = asyncio.run(asyncio.wait_for(find_run_configs(dht), 30.0))
    except (asyncio.TimeoutError, OSError) as error:
        logger.info("could not list the swarm's runs: %r", error)
        return ""
    name = run_id.rsplit("-", 1)[0]
    same = [f"{s.run_id} by {s.creator}" for s in listed.values() if s.config.get("name") == name]
    if not same:
        return f"; the swarm lists no run named {name}"
    return f"; the swarm lists these runs named {name}: {', '.join(sorted(same))}"
