"""Run identity: equal configurations share an id, any change makes another."""

from __future__ import annotations

import pytest

from diloco.errors import ConfigError
from diloco.protocol.wire.run_id import check_run_id, make_run_id, run_digest, run_name


def test_run_id_independent_of_key_order() -> None:
    assert make_run_id("demo", {"a": 1, "b": [2, 3]}) == make_run_id("demo", {"b": [2, 3], "a": 1})


def test_run_id_changes_with_config_and_digest_follows() -> None:
    one, two = make_run_id("demo", {"H": 100}), make_run_id("demo", {"H": 101})
    assert one != two and run_digest(one) != run_digest(two)
    assert len(run_digest(one)) == 16 and run_name(one) == "demo"


@pytest.mark.parametrize("name", ["", "has space", "a/b", "x" * 65])
def test_run_id_bad_name_rejected(name: str) -> None:
    with pytest.raises(ConfigError, match="run name"):
        make_run_id(name, {})


def test_run_id_non_json_config_rejected() -> None:
    with pytest.raises(ConfigError, match="JSON"):
        make_run_id("demo", {"x": {1, 2}})
    with pytest.raises(ConfigError, match="JSON"):
        make_run_id("demo", {"x": float("nan")})


def test_check_run_id_malformed_rejected() -> None:
    with pytest.raises(ConfigError, match="NAME"):
        check_run_id("demo-XYZ")
