"""Metrics records: strict schema, bounded size, owned like every record kind."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any

import msgpack
import pytest
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils import MSGPackSerializer, ValueWithExpiration, get_dht_time

from diloco.errors import ProtocolError
from diloco.protocol.records.metrics import (
    MAX_LABEL_CHARS,
    MAX_METRICS_BYTES,
    MAX_POINTS,
    MAX_ROUNDS,
    METRICS_KEY_PATTERN,
    LossPoint,
    MetricsRecord,
    RoundEntry,
    metrics_key,
    read_metrics,
)
from diloco.protocol.records.nodes import FragmentVersion, NodeRecord, nodes_key, record_validator
from diloco.protocol.trust.envelopes import pack_payload, seal
from diloco.protocol.trust.identity import Identity
from diloco.protocol.wire.run_id import make_run_id

RUN = make_run_id("metrics", {"steps": 10})
ALICE, MALLORY = Identity.generate(), Identity.generate()


def _metrics(**change: Any) -> MetricsRecord:
    record = MetricsRecord(
        steps=120,
        tokens=120 * 128,
        cu=0.75,
        bytes_sent=4000,
        bytes_received=4100,
        failed_rounds=1,
        healed_fragments=2,
        losses=(LossPoint(25, 5.5), LossPoint(50, 4.25)),
        evals=(LossPoint(60, 4.5),),
        rounds=(
            RoundEntry(0, 1, 31, 2, 0.5, 2000, 2050, True),
            RoundEntry(1, 1, 41, 0, 0.0, 0, 0, False),
        ),
    )
    return dataclasses.replace(record, **change)


def _largest() -> MetricsRecord:
    """Every list full, every number at its widest msgpack form."""
    big, points = 2**63 - 1, tuple(LossPoint(2**40 + i, 1.0 / 3) for i in range(MAX_POINTS))
    rounds = tuple(RoundEntry(big, big, big, 4096, 1.0 / 3, big, big, True) for _ in range(64))
    label = "x" * MAX_LABEL_CHARS
    return MetricsRecord(
        big, big, 1.0 / 3, big, big, big, big, points, points, rounds, label, label, big, "stopped"
    )


def test_metrics_round_trip() -> None:
    record = _metrics()
    assert MetricsRecord.from_wire(record.to_wire()) == record
    assert MetricsRecord.from_payload(pack_payload(record.to_wire())) == record


def test_a_record_says_how_its_node_trains_and_how_it_ended() -> None:
    record = _metrics(device="cuda:0", precision="bf16", batch_size=16, end="finished")
    wire = record.to_wire()
    assert (wire["dev"], wire["prec"], wire["batch"], wire["end"]) == (
        "cuda:0",
        "bf16",
        16,
        "finished",
    )
    assert MetricsRecord.from_payload(pack_payload(wire)) == record


def test_an_older_nodes_record_without_labels_is_valid() -> None:
    wire = _metrics().to_wire()
    assert not {"dev", "prec", "batch", "end"} & set(wire)
    assert MetricsRecord.from_wire(wire).device is None


def test_metrics_wire_layout() -> None:
    wire = _metrics().to_wire()
    assert wire["rounds"][0] == [0, 1, 31, 2, 0.5, 2000, 2050, True]
    assert wire["loss"] == [[25, 5.5], [50, 4.25]]
    assert (wire["v"], wire["tok"], wire["heal"]) == (1, 15360, 2)


def test_largest_valid_record_fits_the_bound() -> None:
    payload = pack_payload(_largest().to_wire())
    assert len(payload) <= MAX_METRICS_BYTES
    assert MetricsRecord.from_payload(payload) == _largest()


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"cu": 1.5}, "cu"),
        ({"cu": 1}, "cu"),
        ({"steps": -1}, "steps"),
        ({"tokens": True}, "tokens"),
        ({"losses": (LossPoint(5, 1.0), LossPoint(5, 2.0))}, "step order"),
        ({"losses": (LossPoint(5, float("nan")),)}, "losses value"),
        ({"evals": (LossPoint(5, -1.0),)}, "evals value"),
        ({"losses": tuple(LossPoint(i, 1.0) for i in range(MAX_POINTS + 1))}, "losses"),
        ({"rounds": (RoundEntry(0, 1, 2, 0, 0.0, 5, 0, False),)}, "failed"),
        ({"rounds": (RoundEntry(0, 1, 2, 5000, 0.0, 5, 0, True),)}, "members"),
        ({"rounds": (RoundEntry(0, 1, 2, 2, float("inf"), 5, 0, True),)}, "seconds"),
        ({"rounds": (RoundEntry(0, 1, 2, 2, 1.0, 5, 0, 1),)}, "outcome"),  # type: ignore[arg-type]
        ({"rounds": (RoundEntry(0, 1, 2, 2, 1.0, 5, 0, True),) * (MAX_ROUNDS + 1)}, "rounds"),
        ({"device": "x" * (MAX_LABEL_CHARS + 1)}, "device"),
        ({"device": ""}, "device"),
        ({"precision": "bf16\n<b>"}, "precision"),
        ({"batch_size": 0}, "batch size"),
        ({"end": "crashed"}, "end"),
    ],
)
def test_metrics_invalid_field_rejected(change: dict[str, Any], match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        _metrics(**change).check()


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"extra": 1}, "keys"),
        ({"dev": 5}, "device"),
        ({"end": True}, "end"),
        ({"v": 2}, "schema"),
        ({"loss": [[1, 2.0, 3]]}, "loss entry"),
        ({"rounds": [[0, 1, 2]]}, "round entry"),
        ({"eval": {"1": 2.0}}, "list"),
        ({"rounds": [[0, 1, 2, 2, 1.0, 5, 0, True]] * 500}, "list"),
    ],
)
def test_metrics_malformed_wire_rejected(change: dict[str, object], match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        MetricsRecord.from_wire({**_metrics().to_wire(), **change})


def test_metrics_payload_oversize_rejected() -> None:
    with pytest.raises(ProtocolError, match="larger than"):
        MetricsRecord.from_payload(bytes(MAX_METRICS_BYTES + 1))


def _dht_record(key: str, by: Identity, payload: bytes) -> DHTRecord:
    expiration = get_dht_time() + 30.0
    return DHTRecord(
        DHTID.generate(source=key).to_bytes(),
        MSGPackSerializer.dumps(by.peer_id),
        MSGPackSerializer.dumps(seal(by, key, payload, expiration)),
        expiration,
    )


def test_validator_accepts_signed_metrics_and_refuses_other_kinds_under_its_key() -> None:
    key = metrics_key(RUN)
    assert METRICS_KEY_PATTERN.fullmatch(key) and not METRICS_KEY_PATTERN.fullmatch("x/metrics")
    validator = record_validator()
    assert validator.validate(_dht_record(key, ALICE, pack_payload(_metrics().to_wire())))
    node = NodeRecord(ALICE.peer_id, (), 3, (FragmentVersion(0, 1, "ab" * 32),), 1.0, "0.1")
    assert not validator.validate(_dht_record(key, ALICE, pack_payload(node.to_wire())))
    assert not validator.validate(
        _dht_record(nodes_key(RUN), ALICE, pack_payload(_metrics().to_wire()))
    )


class _StubDHT:
    def __init__(self, items: dict[str, tuple[object, float]]) -> None:
        self.items = items

    async def get(self, key: str, latest: bool = False, return_future: bool = False) -> Any:
        value = {
            sub: ValueWithExpiration(msgpack.unpackb(msgpack.packb(v)), e)
            for sub, (v, e) in self.items.items()
        }
        return ValueWithExpiration(value, get_dht_time() + 30)


def test_read_metrics_keeps_valid_signed_records_only(caplog: pytest.LogCaptureFixture) -> None:
    key, expiration = metrics_key(RUN), get_dht_time() + 30.0
    good = pack_payload(_metrics().to_wire())
    bad = pack_payload({**_metrics().to_wire(), "cu": 7.0})
    dht = _StubDHT(
        {
            ALICE.peer_id: (seal(ALICE, key, good, expiration), expiration),
            MALLORY.peer_id: (seal(MALLORY, key, bad, expiration), expiration),
            "12D3KooWForgedForgedForgedForgedForgedForgedForged": (
                seal(MALLORY, key, good, expiration),
                expiration,
            ),
        }
    )
    with caplog.at_level(logging.WARNING, logger="diloco"):
        found = asyncio.run(read_metrics(dht, RUN))  # type: ignore[arg-type]
    assert found == {ALICE.peer_id: _metrics()}
    assert MALLORY.peer_id in caplog.text
