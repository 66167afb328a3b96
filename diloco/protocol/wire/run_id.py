"""Run identity (docs/design.md "The round"): a human name plus the hash of the run configuration.

Every DHT key and stream handler is namespaced by the run id, so a node whose configuration
differs lands in another namespace and cannot mix its updates into this run by accident.
``run_digest`` is the 16-byte form carried in every wire message.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from typing import Any

from diloco.errors import ConfigError

RUN_NAME_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
RUN_ID_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,64}-[0-9a-f]{16}$")
DIGEST_BYTES = 16


def config_hash(config: Mapping[str, Any]) -> str:
    """Hex sha256 (16 characters) of ``config`` as canonical JSON (sorted keys, no spaces).

    Raises:
        ConfigError: if the configuration is not JSON-serialisable (sets, tensors...).
    """
    try:
        canonical = json.dumps(config, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"run configuration must be plain JSON data: {exc}") from exc
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def make_run_id(name: str, config: Mapping[str, Any]) -> str:
    """``"{name}-{config_hash}"``: two nodes share a run id iff name and configuration agree.

    Raises:
        ConfigError: for a name outside ``[A-Za-z0-9_-]{1,64}`` or a non-JSON configuration.
    """
    if not RUN_NAME_PATTERN.match(name):
        raise ConfigError(f"run name {name!r} must match {RUN_NAME_PATTERN.pattern}; rename it")
    return f"{name}-{config_hash(config)}"


def check_run_id(run_id: str) -> str:
    """Return ``run_id`` unchanged if it is well formed (``name-<16 hex>``).

    Raises:
        ConfigError: otherwise, naming the expected form.
    """
    if not RUN_ID_PATTERN.match(run_id):
        raise ConfigError(f"run id {run_id!r} is not of the form NAME-<16 hex digits>")
    return run_id


def run_name(run_id: str) -> str:
    """The human part of a run id."""
    return check_run_id(run_id).rsplit("-", 1)[0]


def run_digest(run_id: str) -> bytes:
    """The first 16 bytes of sha256(run id): the run tag of every wire message."""
    return hashlib.sha256(check_run_id(run_id).encode()).digest()[:DIGEST_BYTES]
