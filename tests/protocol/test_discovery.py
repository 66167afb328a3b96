"""Run configurations read from the swarm: strict parsing, depth and size bounds, and the
creator's signature."""

from __future__ import annotations

import json
from typing import Any

import pytest

from diloco.errors import ConfigError, ProtocolError
from diloco.protocol.records.run_configs import (
    MAX_CONFIG_BYTES,
    MAX_JSON_DEPTH,
    SignedRunConfig,
    encode_config,
    parse_config,
)
from diloco.protocol.trust.envelopes import pack_payload
from diloco.protocol.trust.identity import Identity, signing_input
from diloco.protocol.wire.run_id import make_run_id

CREATOR, MALLORY = Identity.generate(), Identity.generate()
CONFIG = {"model": "tiny", "outer": {"lr": 0.7, "betas": [0.9, 0.95]}, "creator": CREATOR.peer_id}
RUN = make_run_id("demo", CONFIG)
BOMB = "[" * 40_000


def _nested(depth: int) -> dict[str, Any]:
    """An object ``depth`` levels deep, the outermost included."""
    config: dict[str, Any] = {}
    for _ in range(depth - 1):
        config = {"a": config}
    return config


def _signed_by(identity: Identity, run_id: str, text: str) -> bytes:
    """A signed-config payload built by the documented layout, by ``identity``."""
    signature = identity.sign(signing_input("diloco-run-config/1", run_id, text))
    return pack_payload([run_id, text, signature])


def test_config_round_trip() -> None:
    assert parse_config(RUN, encode_config(CONFIG)) == CONFIG
    payload = _signed_by(CREATOR, RUN, encode_config(CONFIG))
    signed = SignedRunConfig.from_payload(payload)
    assert (signed.run_id, signed.config, signed.creator) == (RUN, CONFIG, CREATOR.peer_id)
    assert SignedRunConfig.sign(CREATOR, RUN, CONFIG).to_payload() == payload


def test_config_signed_by_another_than_its_creator_is_refused() -> None:
    with pytest.raises(ProtocolError, match=f"bad signature by {CREATOR.peer_id}"):
        SignedRunConfig.from_payload(_signed_by(MALLORY, RUN, encode_config(CONFIG)))
    with pytest.raises(ConfigError, match="only the run's creator"):
        SignedRunConfig.sign(MALLORY, RUN, CONFIG)


def test_config_naming_no_creator_is_refused() -> None:
    for config in ({"model": "tiny"}, {"model": "tiny", "creator": 7}):
        run_id = make_run_id("demo", config)
        with pytest.raises(ProtocolError, match="names no creator"):
            SignedRunConfig.from_payload(_signed_by(MALLORY, run_id, encode_config(config)))


def test_creator_signature_does_not_carry_over_to_another_config() -> None:
    other = {**CONFIG, "seed": 1}
    signature = SignedRunConfig.sign(CREATOR, RUN, CONFIG).signature
    replayed = pack_payload([make_run_id("demo", other), encode_config(other), signature])
    with pytest.raises(ProtocolError, match="bad signature"):
        SignedRunConfig.from_payload(replayed)
    with pytest.raises(ConfigError, match="does not hash"):
        SignedRunConfig.from_payload(pack_payload([RUN, encode_config(other), signature]))


def test_depth_bomb_is_a_config_error_not_a_crash() -> None:
    with pytest.raises(RecursionError):  # what json.loads alone does with it
        json.loads(BOMB)
    with pytest.raises(ConfigError, match=f"deeper than {MAX_JSON_DEPTH}"):
        parse_config(RUN, BOMB)
    with pytest.raises(ConfigError, match="deeper"):
        SignedRunConfig.from_payload(pack_payload([RUN, BOMB, bytes(64)]))


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
    [
        pack_payload(encode_config(CONFIG)),
        pack_payload([RUN, encode_config(CONFIG)]),
        pack_payload([7, "{}", bytes(64)]),
        pack_payload([RUN, encode_config(CONFIG), "signature"]),
    ],
    ids=["bare JSON", "unsigned", "run id not a string", "signature not bytes"],
)
def test_config_payload_shape_rejected(payload: bytes) -> None:
    with pytest.raises(ProtocolError, match=r"\[run id, JSON, signature\]"):
        SignedRunConfig.from_payload(payload)
