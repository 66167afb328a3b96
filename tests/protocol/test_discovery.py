"""Run configurations read from the swarm: strict parsing, depth and size bounds."""

from __future__ import annotations

import json
from typing import Any

import pytest

from diloco.errors import ConfigError, ProtocolError
from diloco.protocol.discovery import (
    MAX_CONFIG_BYTES,
    MAX_JSON_DEPTH,
    encode_config,
    parse_config,
    parse_config_payload,
)
from diloco.protocol.run_id import make_run_id
from diloco.protocol.signed_records import pack_payload

CONFIG = {"model": "tiny", "outer": {"lr": 0.7, "betas": [0.9, 0.95]}}
RUN = make_run_id("demo", CONFIG)
BOMB = "[" * 40_000


def _nested(depth: int) -> dict[str, Any]:
    """An object ``depth`` levels deep, the outermost included."""
    config: dict[str, Any] = {}
    for _ in range(depth - 1):
        config = {"a": config}
    return config


def test_config_round_trip() -> None:
    assert parse_config(RUN, encode_config(CONFIG)) == CONFIG
    assert parse_config_payload(pack_payload([RUN, encode_config(CONFIG)])) == (RUN, CONFIG)


def test_depth_bomb_is_a_config_error_not_a_crash() -> None:
    with pytest.raises(RecursionError):  # what json.loads alone does with it
        json.loads(BOMB)
    with pytest.raises(ConfigError, match=f"deeper than {MAX_JSON_DEPTH}"):
        parse_config(RUN, BOMB)
    with pytest.raises(ConfigError, match="deeper"):
        parse_config_payload(pack_payload([RUN, BOMB]))


def test_depth_limit_is_exact() -> None:
    deepest = _nested(MAX_JSON_DEPTH)
    assert parse_config(make_run_id("deep", deepest), encode_config(deepest)) == deepest
    deeper = _nested(MAX_JSON_DEPTH + 1)
    with pytest.raises(ConfigError, match="deeper"):
        parse_config(make_run_id("deep", deeper), encode_config(deeper))


@pytest.mark.parametrize(
    "text",
    ["[" * 40, '"\\\\' + "[" * 40, '\\"' + "[" * 40, "[]" * 40 + "{" * 40],
    ids=["brackets", "after an escaped backslash", "after an escaped quote", "mixed"],
)
def test_brackets_in_strings_do_not_count_and_others_do(text: str) -> None:
    inside = {"s": text}
    assert parse_config(make_run_id("s", inside), encode_config(inside)) == inside
    outside = json.dumps(json.loads("[" * 20 + "]" * 20))
    with pytest.raises(ConfigError, match="deeper"):
        parse_config(make_run_id("s", {}), outside)


@pytest.mark.parametrize(
    ("value", "match"),
    [
        (None, "JSON string"),
        (b"{}", "JSON string"),
        ("x" * (MAX_CONFIG_BYTES + 1), "64 KiB"),
        ("{", "not JSON"),
        ("[1]", "JSON object"),
        (encode_config({"model": "other"}), "does not hash"),
    ],
)
def test_malformed_config_rejected(value: object, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        parse_config(RUN, value)


@pytest.mark.parametrize(
    "payload",
    [pack_payload(encode_config(CONFIG)), pack_payload([RUN]), pack_payload([7, "{}"])],
    ids=["bare JSON", "run id only", "run id not a string"],
)
def test_config_payload_shape_rejected(payload: bytes) -> None:
    with pytest.raises(ProtocolError, match=r"\[run id, JSON\]"):
        parse_config_payload(payload)
