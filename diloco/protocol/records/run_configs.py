"""Finding runs in a swarm: the run's creator signs its configuration, peers pass it on.

A run's configuration names its ``creator`` (the peer id of the node that started it) and
is signed by the creator's key (docs/design.md "Threat model" "the run configuration only by the
run's creator")::

    SignedRunConfig = msgpack [run id, canonical JSON of the configuration, signature]
    signature = Ed25519 by config["creator"] over
        signing_input("diloco-run-config/1", run id, JSON)

The run id is ``name-hash(configuration)`` and the configuration holds the creator, so a
configuration that merely shares a run's name has another run id, and only the creator can
sign one that names it. The signature carries no expiration: every member of the run passes
the creator's signed configuration on unchanged, to joiners over RUN_INFO (``run_info``) and
in the DHT, where each republishes it with expiration under its own subkey (an owned
record of ``signed_records``)::

    key "diloco-run-configs"    subkey = the publishing member's peer id
    payload = SignedRunConfig

so ``diloco-node status`` lists a run for as long as any of its nodes lives. A joiner never
picks a run from these records: it follows the run of the peer whose address it was given.
Values come from untrusted peers: a configuration is accepted only if it is JSON within
``MAX_CONFIG_BYTES``, nested at most ``MAX_JSON_DEPTH`` deep (``json`` recurses: a
40,000-deep array would crash the reader), hashes to the run id it comes with, and carries
its creator's valid signature.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hivemind import DHT
from hivemind.utils import get_dht_time

from diloco.errors import ConfigError, ProtocolError
from diloco.protocol.trust.envelopes import pack_payload, read_signed, store_signed, unpack_payload
from diloco.protocol.trust.identity import Identity, signing_input, verify
from diloco.protocol.wire.run_id import check_run_id, config_hash

logger = logging.getLogger(__name__)

RUN_CONFIGS_KEY = "diloco-run-configs"
RUN_CONFIGS_KEY_PATTERN = re.compile(re.escape(RUN_CONFIGS_KEY))
MAX_CONFIG_BYTES = 64 * 1024
MAX_JSON_DEPTH = 16
MAX_SIGNED_CONFIG_BYTES = MAX_CONFIG_BYTES + 1024
"""Largest SignedRunConfig: the configuration, its run id and the signature."""
DOMAIN = "diloco-run-config/1"
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


@dataclass(frozen=True, slots=True)
class SignedRunConfig:
    """A run's configuration as its creator signed it (see the module docstring)."""

    run_id: str
    text: str
    """The configuration as canonical JSON: the bytes that were hashed and signed."""
    signature: bytes
    config: dict[str, Any] = field(compare=False)

    @property
    def creator(self) -> str:
        """Peer id of the node that started the run (base58)."""
        return str(self.config["creator"])

    @classmethod
    def sign(cls, identity: Identity, run_id: str, config: Mapping[str, Any]) -> SignedRunConfig:
        """The configuration of run ``run_id`` signed by its creator, ``identity``.

        Raises:
            ConfigError: ``config`` names another creator, or does not hash to ``run_id``.
        """
        if config.get("creator") != identity.peer_id:
            raise ConfigError(
                f"only the run's creator signs its configuration, not {identity.peer_id}"
            )
        text = encode_config(config)
        parsed = parse_config(run_id, text)
        return cls(run_id, text, identity.sign(signing_input(DOMAIN, run_id, text)), parsed)

    def to_payload(self) -> bytes:
        return pack_payload([self.run_id, self.text, self.signature])

    @classmethod
    def from_payload(cls, payload: bytes) -> SignedRunConfig:
        """Parse and verify a signed configuration from a peer.

        Raises:
            ProtocolError: not ``[run id, JSON, signature]``, no creator, or a signature
                that is not the creator's.
            ConfigError: from ``parse_config`` (size, depth, JSON, hash).
        """
        value = unpack_payload(payload, MAX_SIGNED_CONFIG_BYTES)
        if (
            not isinstance(value, list)
            or len(value) != 3
            or not isinstance(value[0], str)
            or not isinstance(value[2], bytes)
        ):
            raise ProtocolError("run configuration is not [run id, JSON, signature]")
        run_id, text, signature = value
        config = parse_config(run_id, text)
        creator = config.get("creator")
        if not isinstance(creator, str):
            raise ProtocolError(f"run configuration of {run_id} names no creator")
        verify(creator, signing_input(DOMAIN, run_id, text), signature)
        return cls(run_id, text, signature, config)


def check_config_payload(key: str, author: str, payload: bytes) -> None:
    """The DHT validator's schema of run-config records (``records.record_validator``)."""
    SignedRunConfig.from_payload(payload)


async def publish_run_config(dht: DHT, signed: SignedRunConfig, ttl: float) -> bool:
    """Store the run's signed configuration under this node's subkey for ``ttl`` seconds."""
    return await store_signed(dht, RUN_CONFIGS_KEY, signed.to_payload(), get_dht_time() + ttl)


async def find_run_configs(dht: DHT) -> dict[str, SignedRunConfig]:
    """Every valid signed run configuration the swarm holds, by run id; invalid ones are
    logged with the peer id of the member that published them."""
    configs = {}
    for author, signed in (await read_signed(dht, RUN_CONFIGS_KEY)).items():
        try:
            found = SignedRunConfig.from_payload(signed.payload)
        except (ConfigError, ProtocolError) as error:
            logger.warning("ignoring run configuration from %s: %s", author, error)
            continue
        configs[found.run_id] = found
    return configs
