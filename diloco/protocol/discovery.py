"""Finding runs in a swarm: a joiner knows one address, not the run configuration.

Every node of a run republishes its run's configuration (plain JSON) with expiration::

    key "diloco-run-configs"    subkey = run id    value = canonical JSON of the configuration

so ``diloco-node join`` can read the configuration from the swarm (a joiner needs no
training flags) and ``diloco-node status`` can list the runs. Values come from untrusted
peers: a configuration is accepted only if it is valid JSON within ``MAX_CONFIG_BYTES`` and
hashes to the run id it is stored under.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

from hivemind import DHT
from hivemind.utils import get_dht_time

from diloco.errors import ConfigError
from diloco.protocol.run_id import check_run_id, config_hash

logger = logging.getLogger(__name__)

RUN_CONFIGS_KEY = "diloco-run-configs"
MAX_CONFIG_BYTES = 64 * 1024


def encode_config(config: Mapping[str, Any]) -> str:
    return json.dumps(config, sort_keys=True, separators=(",", ":"), allow_nan=False)


def parse_config(run_id: str, value: object) -> dict[str, Any]:
    """The configuration stored under ``run_id``, validated against the id's hash.

    Raises:
        ConfigError: for a malformed id, a non-string or oversize value, bad JSON, or a
            configuration whose hash is not the run id's.
    """
    check_run_id(run_id)
    if not isinstance(value, str) or len(value) > MAX_CONFIG_BYTES:
        raise ConfigError("run configuration must be a JSON string of at most 64 KiB")
    try:
        config = json.loads(value)
    except ValueError as error:
        raise ConfigError(f"run configuration is not JSON: {error}") from error
    if not isinstance(config, dict):
        raise ConfigError("run configuration must be a JSON object")
    if config_hash(config) != run_id.rsplit("-", 1)[1]:
        raise ConfigError(f"run configuration does not hash to run id {run_id}")
    return config


async def publish_run_config(dht: DHT, run_id: str, config: Mapping[str, Any], ttl: float) -> bool:
    """Store this run's configuration for ``ttl`` seconds under the well-known key."""
    stored = await dht.store(
        RUN_CONFIGS_KEY,
        encode_config(config),
        get_dht_time() + ttl,
        subkey=run_id,
        return_future=True,
    )
    return bool(stored)


async def find_run_configs(dht: DHT) -> dict[str, dict[str, Any]]:
    """Every valid run configuration the swarm holds, by run id; invalid ones are logged."""
    found = await dht.get(RUN_CONFIGS_KEY, latest=True, return_future=True)
    if found is None or not isinstance(found.value, Mapping):
        return {}
    configs = {}
    for run_id, item in found.value.items():
        try:
            configs[str(run_id)] = parse_config(str(run_id), getattr(item, "value", None))
        except ConfigError as error:
            logger.warning("ignoring run configuration under %r: %s", run_id, error)
    return configs
