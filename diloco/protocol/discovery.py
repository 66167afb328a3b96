"""Finding runs in a swarm: a joiner knows one address, not the run configuration.

Every node of a run republishes its run's configuration with expiration, as a signed
record (``signed_records``) under its own subkey::

    key "diloco-run-configs"    subkey = author's peer id
    payload = msgpack [run id, canonical JSON of the configuration]

so ``diloco-node join`` can read the configuration from the swarm (a joiner needs no
training flags) and ``diloco-node status`` can list the runs. Values come from untrusted
peers: a configuration is accepted only if it is JSON within ``MAX_CONFIG_BYTES``, nested
at most ``MAX_JSON_DEPTH`` deep (``json`` recurses: a 40,000-deep array would crash the
reader), and hashes to the run id it comes with.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping
from typing import Any

from hivemind import DHT
from hivemind.utils import get_dht_time

from diloco.errors import ConfigError, ProtocolError
from diloco.protocol.run_id import check_run_id, config_hash
from diloco.protocol.signed_records import pack_payload, read_signed, store_signed, unpack_payload

logger = logging.getLogger(__name__)

RUN_CONFIGS_KEY = "diloco-run-configs"
RUN_CONFIGS_KEY_PATTERN = re.compile(re.escape(RUN_CONFIGS_KEY))
MAX_CONFIG_BYTES = 64 * 1024
MAX_JSON_DEPTH = 16
_JSON_TOKEN = re.compile(r'["\\\[\]{}]')


def encode_config(config: Mapping[str, Any]) -> str:
    return json.dumps(config, sort_keys=True, separators=(",", ":"), allow_nan=False)


def parse_config(run_id: str, value: object) -> dict[str, Any]:
    """The configuration stored under ``run_id``, validated against the id's hash.

    Raises:
        ConfigError: for a malformed id, a non-string, oversize or too deeply nested
            value, bad JSON, or a configuration whose hash is not the run id's.
    """
    check_run_id(run_id)
    if not isinstance(value, str) or len(value) > MAX_CONFIG_BYTES:
        raise ConfigError("run configuration must be a JSON string of at most 64 KiB")
    check_json_depth(value, MAX_JSON_DEPTH)
    try:
        config = json.loads(value)
    except ValueError as error:
        raise ConfigError(f"run configuration is not JSON: {error}") from error
    if not isinstance(config, dict):
        raise ConfigError("run configuration must be a JSON object")
    if config_hash(config) != run_id.rsplit("-", 1)[1]:
        raise ConfigError(f"run configuration does not hash to run id {run_id}")
    return config


def check_json_depth(text: str, max_depth: int) -> None:
    """Refuse JSON text nested deeper than ``max_depth`` before ``json.loads`` recurses
    into it (brackets inside strings do not count).

    Raises:
        ConfigError: naming the limit.
    """
    depth, in_string, skip = 0, False, -1
    for token in _JSON_TOKEN.finditer(text):  # one pass: linear in the text
        char = token.group()
        if token.start() == skip:  # the character after a backslash in a string
            continue
        if in_string:
            if char == "\\":
                skip = token.start() + 1
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            if depth > max_depth:
                raise ConfigError(f"run configuration nested deeper than {max_depth} levels")
        elif char in "]}":
            depth -= 1


def parse_config_payload(payload: bytes) -> tuple[str, dict[str, Any]]:
    """The run id and configuration in a signed run-config payload.

    Raises:
        ProtocolError: the payload is not ``[run id, JSON text]``.
        ConfigError: from ``parse_config``.
    """
    value = unpack_payload(payload, MAX_CONFIG_BYTES + 1024)
    if not isinstance(value, list) or len(value) != 2 or not isinstance(value[0], str):
        raise ProtocolError("run configuration payload is not [run id, JSON]")
    run_id, text = value
    return run_id, parse_config(run_id, text)


def check_config_payload(key: str, author: str, payload: bytes) -> None:
    """The DHT validator's schema of run-config records (``records.record_validator``)."""
    parse_config_payload(payload)


async def publish_run_config(dht: DHT, run_id: str, config: Mapping[str, Any], ttl: float) -> bool:
    """Store this run's configuration, signed by this node, for ``ttl`` seconds."""
    payload = pack_payload([run_id, encode_config(config)])
    return await store_signed(dht, RUN_CONFIGS_KEY, payload, get_dht_time() + ttl)


async def find_run_configs(dht: DHT) -> dict[str, dict[str, Any]]:
    """Every valid run configuration the swarm holds, by run id; invalid ones are logged
    with the peer id of their author."""
    configs = {}
    for author, signed in (await read_signed(dht, RUN_CONFIGS_KEY)).items():
        try:
            run_id, config = parse_config_payload(signed.payload)
        except (ConfigError, ProtocolError) as error:
            logger.warning("ignoring run configuration from %s: %s", author, error)
            continue
        configs[run_id] = config
    return configs
