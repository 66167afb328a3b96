"""The dashboard's read-only peer: a DHT node that reads a run's records every few seconds.

It trains nothing and takes no part in rounds: it registers no stream handler and
publishes no record, so nodes neither count it as alive nor match it into a group. Its
DHT (``make_dht``: loopback unless told otherwise, no NAT port mapping, no AutoNAT)
validates every record it stores or reads like any node's.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

import torch
from hivemind import DHT

from diloco.errors import ConfigError
from diloco.node.config import RunConfig
from diloco.node.dashboard.view import SwarmView
from diloco.node.model.transformer import Transformer
from diloco.protocol.records.metrics import read_metrics
from diloco.protocol.records.nodes import read_records
from diloco.protocol.records.run_configs import find_run_configs
from diloco.protocol.runtime.network import NetworkOptions
from diloco.protocol.swarm import make_dht

logger = logging.getLogger(__name__)

POLL_TIMEOUT = 30.0
"""Seconds one poll of the DHT may take before it is abandoned (and retried)."""


class SwarmFollower:
    """Polls the swarm into ``view`` every ``poll_every`` seconds, in a thread of its own.

    Start it before any other thread: the DHT is a forked process.
    """

    def __init__(
        self,
        view: SwarmView,
        net: NetworkOptions,
        run_name: str | None = None,
        poll_every: float = 2.0,
    ) -> None:
        if not poll_every > 0:
            raise ConfigError(f"poll interval must be > 0 s, got {poll_every}")
        self.view, self.run_name, self.poll_every = view, run_name, poll_every
        self.dht: DHT = make_dht(net)
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._run, name="diloco-dashboard", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def close(self) -> None:
        """Stop polling and leave the swarm (the DHT process and its p2pd end)."""
        self.stop_event.set()
        self.thread.join(POLL_TIMEOUT + 5.0)
        self.dht.shutdown()

    def _run(self) -> None:
        asyncio.run(self._follow())

    async def _follow(self) -> None:
        while not self.stop_event.is_set():
            try:
                await asyncio.wait_for(self.poll_once(), POLL_TIMEOUT)
            except asyncio.TimeoutError:
                self.view.set_status(f"the DHT did not answer within {POLL_TIMEOUT:.0f} s")
            except Exception as exc:  # a bad poll must not end the dashboard; say it
                logger.exception("polling the swarm failed")
                self.view.set_status(f"polling the swarm failed: {exc!r:.200}")
            await asyncio.get_running_loop().run_in_executor(
                None, self.stop_event.wait, self.poll_every
            )

    async def poll_once(self) -> None:
        """Choose the run (first time), then read its node and metrics records."""
        if self.view.run_id is None and not await self._choose_run():
            return
        run_id = self.view.run_id
        assert run_id is not None
        records = await read_records(self.dht, run_id)
        metrics = await read_metrics(self.dht, run_id)
        self.view.update(records, metrics, time.time())
        self.view.set_status(f"following {len(records)} node(s)")

    async def _choose_run(self) -> bool:
        """The run named ``run_name``, else the only one, else the one with most nodes."""
        configs = await find_run_configs(self.dht)
        if self.run_name is not None:
            configs = {k: v for k, v in configs.items() if v.config.get("name") == self.run_name}
        if not configs:
            named = f" named {self.run_name!r}" if self.run_name else ""
            self.view.set_status(f"no run{named} found in the swarm yet; retrying")
            return False
        sizes = {run_id: len(await read_records(self.dht, run_id)) for run_id in configs}
        run_id = max(sorted(configs), key=lambda r: sizes[r])
        if len(configs) > 1:
            logger.warning("the swarm runs %d runs; following %s", len(configs), run_id)
        config = configs[run_id].config
        self.view.set_run(run_id, config, model_size(config))
        return True


def model_size(config: dict[str, Any]) -> int | None:
    """Parameters of the run's model (built on the meta device: no memory), or None for a
    configuration this software cannot read (e.g. from a newer version)."""
    try:
        model_config = RunConfig.from_dict(config).model_config()
    except ConfigError as exc:
        logger.warning("cannot read the run configuration: %s", exc)
        return None
    with torch.device("meta"):
        return Transformer(model_config).num_params()
