"""Closed swarms at the envelope layer: every record carries its author's proof of the key,
readers of a restricted DHT drop records without a valid one (and those of peers not
admitted), open swarms store and read the three-field envelope as before."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
from typing import Any

import msgpack
import pytest
from hivemind.utils import get_dht_time
from test_signed_records import _record, _StubDHT

from diloco.protocol.records.declarations import read_round_view
from diloco.protocol.records.metrics import MetricsRecord, metrics_key, read_metrics
from diloco.protocol.records.nodes import (
    FragmentVersion,
    NodeRecord,
    Vouch,
    nodes_key,
    read_records,
    read_vouches,
    record_validator,
    vouch_key,
    vouch_payload,
)
from diloco.protocol.trust.admission import Membership
from diloco.protocol.trust.envelopes import pack_payload, seal
from diloco.protocol.trust.identity import Identity
from diloco.protocol.trust.swarm_key import ClosedSwarm, SwarmKey
from diloco.protocol.wire.run_id import make_run_id, run_digest

RUN = make_run_id("closed", {"seed": 1})
DIGEST = run_digest(RUN)
KEY, OTHER_KEY = SwarmKey(b"k" * 32), SwarmKey(b"o" * 32)
CLOSED = ClosedSwarm(KEY, DIGEST)
ALICE, BOB, CAROL, DAVE, ERIN = (Identity.generate() for _ in range(5))
H = "ab" * 32


def _node(identity: Identity, step: int) -> bytes:
    record = NodeRecord(identity.peer_id, (), step, (FragmentVersion(0, 1, H),), 1.0, "0.1.0")
    return pack_payload(record.to_wire())


def _entry(identity: Identity, key: str, payload: bytes, proof: bytes | None) -> tuple[Any, float]:
    expiration = get_dht_time() + 30
    return seal(identity, key, payload, expiration, proof), expiration


class _RestrictedStub(_StubDHT):
    """What a DHT returns, read by a node restricted to ``membership``."""

    def __init__(self, entries: dict[str, Any], membership: Membership | None) -> None:
        super().__init__(entries)
        self.membership = membership


def test_record_proof_is_the_documented_hmac_known_answer() -> None:
    author = "12D3KooWPAGmuFE8Eyh6yiZj5FAPGVxkY66JmqnkT1mtjrr92zHm"
    key = f"{RUN}/nodes"
    assert RUN == "closed-fbe47f6d82b435a8"
    # computed once with hashlib/hmac/msgpack alone (no project code), and again below
    known = "e63ff9503a3823098291c6145844a0710d983c923fb1e93401063b00e10132ef"
    fields = ["diloco-record-proof/1", DIGEST, key, author, hashlib.sha256(b"payload").digest()]
    expected = hmac.new(b"k" * 32, msgpack.packb(fields, use_bin_type=True), "sha256").digest()
    assert expected.hex() == known
    assert CLOSED.record_proof(key, author, b"payload").hex() == known


def test_closed_reader_keeps_valid_proofs_only_and_logs_each_author_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    key = nodes_key(RUN)
    payloads = {p: _node(p, 10) for p in (ALICE, BOB, CAROL, DAVE, ERIN)}
    alice_proof = CLOSED.record_proof(key, ALICE.peer_id, payloads[ALICE])
    entries = {
        key: {
            ALICE.peer_id: _entry(ALICE, key, payloads[ALICE], alice_proof),
            BOB.peer_id: _entry(BOB, key, payloads[BOB], None),  # no proof
            CAROL.peer_id: _entry(  # another key's proof
                CAROL,
                key,
                payloads[CAROL],
                ClosedSwarm(OTHER_KEY, DIGEST).record_proof(key, CAROL.peer_id, payloads[CAROL]),
            ),
            DAVE.peer_id: _entry(DAVE, key, payloads[DAVE], alice_proof),  # another author's
            ERIN.peer_id: _entry(  # a proof of another payload of its own
                ERIN, key, payloads[ERIN], CLOSED.record_proof(key, ERIN.peer_id, _node(ERIN, 1))
            ),
        }
    }
    dht = _RestrictedStub(entries, Membership(CLOSED, None))
    with caplog.at_level(logging.WARNING, logger="diloco.protocol.trust.admission"):
        for _ in range(3):
            records = asyncio.run(read_records(dht, RUN))  # type: ignore[arg-type]
            assert [r.peer_id for r in records] == [ALICE.peer_id]
    for outsider in (BOB, CAROL, DAVE, ERIN):
        line = f"ignoring the records of {outsider.peer_id}: not a member of this closed swarm"
        assert caplog.text.count(line) == 1, caplog.text
    assert ALICE.peer_id not in caplog.text
    # an open reader of the same DHT takes every correctly signed record, proof or not
    open_reader = _RestrictedStub(entries, None)
    assert len(asyncio.run(read_records(open_reader, RUN))) == 5  # type: ignore[arg-type]


def test_every_record_kind_is_filtered_by_the_envelope() -> None:
    """Vouches, metrics and declarations of an outsider are dropped like node records."""
    vkey, mkey, rkey = vouch_key(RUN, 0), metrics_key(RUN), f"{RUN}/frag0/round3"
    vouch = vouch_payload([Vouch(BOB.peer_id, 0, 3, H, (BOB.peer_id,))])
    metrics = pack_payload(MetricsRecord(1, 1, 0.5, 0, 0, 0, 0, (), (), ()).to_wire())
    declaration = pack_payload([1.0, CLOSED.declaration_proof(rkey, BOB.peer_id)])

    def both(key: str, payload: bytes) -> dict[str, tuple[Any, float]]:
        return {
            ALICE.peer_id: _entry(ALICE, key, payload, None),  # an outsider
            BOB.peer_id: _entry(BOB, key, payload, CLOSED.record_proof(key, BOB.peer_id, payload)),
        }

    vouch_a = vouch_payload([Vouch(ALICE.peer_id, 0, 3, H, (ALICE.peer_id,))])
    entries = {vkey: both(vkey, vouch) | {ALICE.peer_id: _entry(ALICE, vkey, vouch_a, None)}}
    entries |= {mkey: both(mkey, metrics), rkey: both(rkey, declaration)}
    dht: Any = _RestrictedStub(entries, Membership(CLOSED, None))
    assert [v.author for v in asyncio.run(read_vouches(dht, RUN, [0]))] == [BOB.peer_id]
    assert list(asyncio.run(read_metrics(dht, RUN))) == [BOB.peer_id]
    view = asyncio.run(read_round_view(dht, rkey))
    assert [p.to_base58() for p in view] == [BOB.peer_id]


def test_admission_drops_a_key_holder_not_admitted(caplog: pytest.LogCaptureFixture) -> None:
    key = nodes_key(RUN)
    entries = {
        key: {
            p.peer_id: _entry(p, key, _node(p, 5), CLOSED.record_proof(key, p.peer_id, _node(p, 5)))
            for p in (ALICE, BOB)
        }
    }
    for closed in (CLOSED, None):  # with or without a swarm key
        dht: Any = _RestrictedStub(entries, Membership(closed, {ALICE.peer_id}))
        with caplog.at_level(logging.WARNING, logger="diloco.protocol.trust.admission"):
            assert [r.peer_id for r in asyncio.run(read_records(dht, RUN))] == [ALICE.peer_id]
        assert f"ignoring the records of {BOB.peer_id}: not admitted to this run" in caplog.text


def test_open_envelopes_keep_three_fields_and_validators_take_a_proof() -> None:
    key, payload = nodes_key(RUN), _node(ALICE, 3)
    expiration = get_dht_time() + 30
    plain = seal(ALICE, key, payload, expiration)
    proven = seal(ALICE, key, payload, expiration, CLOSED.record_proof(key, ALICE.peer_id, payload))
    assert len(plain) == 3 and proven[:3] == plain and len(proven) == 4
    validator = record_validator()
    assert validator.validate(_record(key, ALICE.peer_id, plain, expiration))
    assert validator.validate(_record(key, ALICE.peer_id, proven, expiration))
