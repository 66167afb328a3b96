"""Signed, owned DHT records: the validator every DHT node runs, the readers' re-check, and
a hostile peer on a real 3-node DHT that forges, leaves unsigned and pins records."""

from __future__ import annotations

import asyncio
import dataclasses
import glob
import logging
import os
import pickle
import re
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hivemind import DHT
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils import MSGPackSerializer, ValueWithExpiration, get_dht_time
from test_identity_keys import SEED_KEY_FILE, SEED_PEER_ID

from diloco.errors import ProtocolError
from diloco.protocol.core.reducer import RoundKey
from diloco.protocol.matchmaking.lobby import round_key
from diloco.protocol.records.declarations import read_declarations
from diloco.protocol.records.nodes import (
    FragmentVersion,
    NodeRecord,
    nodes_key,
    publish_record,
    read_records,
    record_validator,
    vouch_key,
)
from diloco.protocol.records.run_configs import (
    RUN_CONFIGS_KEY,
    SignedRunConfig,
    encode_config,
    find_run_configs,
    publish_run_config,
)
from diloco.protocol.runtime.network import NetworkOptions
from diloco.protocol.runtime.processes import TiedDHT
from diloco.protocol.swarm import make_dht
from diloco.protocol.trust.envelopes import (
    MAX_PAYLOAD_BYTES,
    SignedRecordValidator,
    pack_payload,
    seal,
    signer,
)
from diloco.protocol.trust.identity import Identity, signing_input
from diloco.protocol.wire.run_id import make_run_id

ALICE, BOB, MALLORY = Identity.generate(), Identity.generate(), Identity.generate()
CONFIG = {"model": "tiny", "steps": 10, "creator": ALICE.peer_id}
RUN = make_run_id("owned", CONFIG)
SIGNED = SignedRunConfig.sign(ALICE, RUN, CONFIG)
H = "ab" * 32
ALICE_BOB = [ALICE.peer_id, BOB.peer_id]


def _node(identity: Identity, step: int = 10) -> NodeRecord:
    frags = (FragmentVersion(0, 1, H), FragmentVersion(1, 2, H))
    return NodeRecord(identity.peer_id, ("/ip4/127.0.0.1/tcp/1",), step, frags, 12.5, "0.1.0")


def _record(key: str, subkey: object, value: object, expiration: float) -> DHTRecord:
    """The record hivemind hands a validator for ``dht.store(key, value, subkey=subkey)``."""
    return DHTRecord(
        DHTID.generate(source=key).to_bytes(),
        MSGPackSerializer.dumps(subkey),
        MSGPackSerializer.dumps(value),
        expiration,
    )


def _sealed(
    key: str, payload: bytes, by: Identity = ALICE, ttl: float = 30.0
) -> tuple[DHTRecord, float]:
    expiration = get_dht_time() + ttl
    return _record(key, by.peer_id, seal(by, key, payload, expiration), expiration), expiration


def test_validator_accepts_envelope_built_by_the_documented_layout() -> None:
    key, payload = nodes_key(RUN), pack_payload(_node(ALICE).to_wire())
    expiration = get_dht_time() + 30.0
    message = msgpack.packb(["diloco-record/1", key, ALICE.peer_id, payload, expiration])
    envelope = [key, payload, ALICE.private_key.sign(message)]
    assert record_validator().validate(_record(key, ALICE.peer_id, envelope, expiration))


@pytest.mark.parametrize(
    ("key", "payload"),
    [
        (nodes_key(RUN), pack_payload(_node(ALICE).to_wire())),
        (round_key(RUN, RoundKey(3, 7)), pack_payload(2.5)),
        (round_key(RUN, RoundKey(3, 7)), pack_payload([2.5, bytes(32)])),
        (RUN_CONFIGS_KEY, SIGNED.to_payload()),
        (vouch_key(RUN, 2), pack_payload({"v": 1, "rounds": [[3, H, sorted(ALICE_BOB)]]})),
    ],
    ids=["node", "declaration", "closed swarm declaration", "run config", "vouch"],
)
def test_validator_accepts_every_kind_signed_by_its_author(key: str, payload: bytes) -> None:
    record, _ = _sealed(key, payload)
    assert record_validator().validate(record)


def _case_unsigned() -> DHTRecord:
    return _record(nodes_key(RUN), ALICE.peer_id, _node(ALICE).to_wire(), get_dht_time() + 30)


def _case_signed_by_other_key() -> DHTRecord:
    key, payload, expiration = nodes_key(RUN), pack_payload(_node(ALICE).to_wire()), time.time()
    message = msgpack.packb(["diloco-record/1", key, ALICE.peer_id, payload, expiration + 30])
    envelope = [key, payload, MALLORY.private_key.sign(message)]
    return _record(key, ALICE.peer_id, envelope, expiration + 30)


def _case_subkey_of_another_peer() -> DHTRecord:
    key, payload = nodes_key(RUN), pack_payload(_node(ALICE, step=10**9).to_wire())
    expiration = get_dht_time() + 30
    return _record(key, ALICE.peer_id, seal(MALLORY, key, payload, expiration), expiration)


def _case_tampered_payload() -> DHTRecord:
    record, expiration = _sealed(nodes_key(RUN), pack_payload(_node(ALICE).to_wire()))
    key, _, signature = msgpack.unpackb(record.value)
    forged = [key, pack_payload(_node(ALICE, step=10**9).to_wire()), signature]
    return _record(nodes_key(RUN), ALICE.peer_id, forged, expiration)


def _case_extended_expiration() -> DHTRecord:
    record, expiration = _sealed(nodes_key(RUN), pack_payload(_node(ALICE).to_wire()))
    return DHTRecord(record.key, record.subkey, record.value, expiration + 60)


def _case_replayed_under_another_key() -> DHTRecord:
    other = make_run_id("owned", {"other": 1})
    record, _ = _sealed(nodes_key(other), pack_payload(_node(ALICE).to_wire()))
    return dataclasses.replace(record, key=DHTID.generate(source=nodes_key(RUN)).to_bytes())


def _case_envelope_names_another_key() -> DHTRecord:
    key, payload = nodes_key(RUN), pack_payload(_node(ALICE).to_wire())
    expiration = get_dht_time() + 30
    envelope = seal(ALICE, key, payload, expiration)
    return _record(round_key(RUN, RoundKey(0, 1)), ALICE.peer_id, envelope, expiration)


def _case(key: str, payload: bytes, **kwargs: Any) -> Callable[[], DHTRecord]:
    return lambda: _sealed(key, payload, **kwargs)[0]


NODE = pack_payload(_node(ALICE).to_wire())
DEEP_MSGPACK = b"\x91" * 5000 + b"\xc0"  # 5,000 nested arrays
BOMB = "[" * 40_000  # json.loads recurses into it and raises RecursionError

REJECTED: dict[str, Callable[[], DHTRecord]] = {
    "unsigned": _case_unsigned,
    "signed by another key": _case_signed_by_other_key,
    "subkey of another peer": _case_subkey_of_another_peer,
    "tampered payload": _case_tampered_payload,
    "extended expiration": _case_extended_expiration,
    "replayed under another key": _case_replayed_under_another_key,
    "envelope names another key": _case_envelope_names_another_key,
    "node record under a round key": _case(round_key(RUN, RoundKey(0, 1)), NODE),
    "declaration under the nodes key": _case(nodes_key(RUN), pack_payload(1.0)),
    "key of no known form": _case("somebody-elses-key", NODE),
    "expiration beyond the bound": _case(nodes_key(RUN), NODE, ttl=10**6),
    "oversize payload": _case(RUN_CONFIGS_KEY, bytes(MAX_PAYLOAD_BYTES + 1)),
    "too deep msgpack": _case(nodes_key(RUN), DEEP_MSGPACK),
    "deep but decodable msgpack": _case(nodes_key(RUN), b"\x91" * 100 + b"\xc0"),
    "JSON depth bomb config": _case(RUN_CONFIGS_KEY, pack_payload([RUN, BOMB, bytes(64)])),
    "config not hashing to its run": _case(
        RUN_CONFIGS_KEY, pack_payload([RUN, encode_config({"x": 1}), bytes(64)])
    ),
    "config not signed by its creator": _case(
        RUN_CONFIGS_KEY,
        pack_payload(
            [
                RUN,
                encode_config(CONFIG),
                MALLORY.sign(signing_input("diloco-run-config/1", RUN, encode_config(CONFIG))),
            ]
        ),
        by=MALLORY,
    ),
    "unsigned config": _case(RUN_CONFIGS_KEY, pack_payload([RUN, encode_config(CONFIG)])),
    "declaration proof of 31 bytes": _case(
        round_key(RUN, RoundKey(0, 1)), pack_payload([1.0, bytes(31)])
    ),
    "node record with a string step": _case(
        nodes_key(RUN), pack_payload({**_node(ALICE).to_wire(), "step": "abc"})
    ),
    "declared weight NaN": _case(round_key(RUN, RoundKey(0, 1)), pack_payload(float("nan"))),
    "declared weight int": _case(round_key(RUN, RoundKey(0, 1)), pack_payload(2)),
    "vouch from outside its members": _case(
        vouch_key(RUN, 0),
        pack_payload({"v": 1, "rounds": [[3, H, sorted([BOB.peer_id, MALLORY.peer_id])]]}),
    ),
    "vouch for round 0": _case(
        vouch_key(RUN, 0), pack_payload({"v": 1, "rounds": [[0, H, sorted(ALICE_BOB)]]})
    ),
    "payload not bytes": lambda: _record(
        nodes_key(RUN), ALICE.peer_id, [nodes_key(RUN), "text", bytes(64)], get_dht_time() + 30
    ),
    "short signature": lambda: _record(
        nodes_key(RUN), ALICE.peer_id, [nodes_key(RUN), NODE, bytes(63)], get_dht_time() + 30
    ),
    "envelope of five fields": lambda: _record(
        nodes_key(RUN),
        ALICE.peer_id,
        [*seal(ALICE, nodes_key(RUN), NODE, get_dht_time() + 30), bytes(32), bytes(32)],
        get_dht_time() + 30,
    ),
    "proof not 32 bytes": lambda: _record(
        nodes_key(RUN),
        ALICE.peer_id,
        [*seal(ALICE, nodes_key(RUN), NODE, get_dht_time() + 30), 1],
        get_dht_time() + 30,
    ),
    "envelope as a tuple": lambda: _record(
        nodes_key(RUN), ALICE.peer_id, (nodes_key(RUN), NODE, bytes(64)), get_dht_time() + 30
    ),
    "no subkey": lambda: _record(
        nodes_key(RUN), None, seal(ALICE, nodes_key(RUN), NODE, 1e9), get_dht_time() + 30
    ),
    "RSA peer id subkey": lambda: _record(
        nodes_key(RUN),
        "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N",
        seal(ALICE, nodes_key(RUN), NODE, get_dht_time() + 30),
        get_dht_time() + 30,
    ),
    "NaN expiration": lambda: _record(
        nodes_key(RUN), ALICE.peer_id, seal(ALICE, nodes_key(RUN), NODE, 0.0), float("nan")
    ),
    "garbage value bytes": lambda: DHTRecord(
        DHTID.generate(source=nodes_key(RUN)).to_bytes(),
        MSGPackSerializer.dumps(ALICE.peer_id),
        b"\xc1\xff",
        get_dht_time() + 30,
    ),
}


REASONS = {
    "unsigned": "not a signed envelope",
    "signed by another key": "bad signature",
    "subkey of another peer": "bad signature",
    "tampered payload": "bad signature",
    "extended expiration": "bad signature",
    "replayed under another key": "not the record's",
    "envelope names another key": "not the record's",
    "node record under a round key": "larger than 96 bytes",
    "declaration under the nodes key": "record of type float",
    "key of no known form": "no record kind",
    "expiration beyond the bound": "too far ahead",
    "oversize payload": "not bytes of at most",
    "too deep msgpack": "StackError",
    "deep but decodable msgpack": "record of type list",
    "JSON depth bomb config": "nested deeper",
    "config not hashing to its run": "does not hash",
    "config not signed by its creator": f"bad signature by {ALICE.peer_id}",
    "unsigned config": "not [run id, JSON, signature]",
    "declaration proof of 31 bytes": "proof of 31 bytes",
    "node record with a string step": "global step",
    "declared weight NaN": "declared weight",
    "vouch from outside its members": "outside the round's members",
    "vouch for round 0": "vouched round 0",
    "declared weight int": "declared weight",
    "payload not bytes": "not bytes of at most",
    "short signature": "not 64 bytes",
    "envelope of five fields": "not a signed envelope",
    "proof not 32 bytes": "a proof that is not 32 bytes",
    "envelope as a tuple": "extension type",
    "no subkey": "is not a peer id",
    "RSA peer id subkey": "not an Ed25519 peer id",
    "NaN expiration": "expiration nan",
    "garbage value bytes": "invalid msgpack",
}
"""The refusal each case must meet (the validator logs it), not an incidental one."""


@pytest.mark.parametrize("case", list(REJECTED))
def test_validator_rejects(case: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="diloco.protocol.trust.envelopes"):
        assert record_validator().validate(REJECTED[case]()) is False
    assert REASONS[case] in caplog.text


def test_validator_survives_pickling() -> None:
    validator = pickle.loads(pickle.dumps(record_validator()))
    assert isinstance(validator, SignedRecordValidator)
    assert validator.validate(_sealed(nodes_key(RUN), NODE)[0])
    assert not validator.validate(_case_subkey_of_another_peer())


def test_validator_remembers_only_what_it_accepted_and_exactly_that() -> None:
    """A DHT node meets the same records in answer after answer: an accepted record is not
    checked again, while a refused one, one changed in any field or one checked against other
    schemas is."""
    checked: list[bytes] = []

    def schema(key: str, author: str, payload: bytes) -> None:
        checked.append(payload)
        if payload == pack_payload("bad"):
            raise ProtocolError("a bad payload")

    def refuse_all(key: str, author: str, payload: bytes) -> None:
        raise ProtocolError("refused")

    key = f"remembered/{os.urandom(8).hex()}"  # unseen by the other tests of this process
    counting = SignedRecordValidator([(re.compile(r"remembered/.+"), schema)])
    record, expiration = _sealed(key, pack_payload("good"))
    assert counting.validate(record) and counting.validate(record)
    assert checked == [pack_payload("good")]
    resealed = _record(
        key, ALICE.peer_id, seal(ALICE, key, pack_payload("good"), expiration + 1), expiration + 1
    )
    assert counting.validate(resealed)
    assert len(checked) == 2
    envelope_key, _, signature = msgpack.unpackb(record.value)
    tampered = [envelope_key, pack_payload("other"), signature]
    assert not counting.validate(_record(key, ALICE.peer_id, tampered, expiration))
    bad, _ = _sealed(key, pack_payload("bad"))
    assert not counting.validate(bad) and not counting.validate(bad)
    assert checked == [pack_payload("good")] * 2 + [pack_payload("bad")] * 2
    refusing = SignedRecordValidator([(re.compile(r"remembered/.+"), refuse_all)])
    assert not refusing.validate(record)


class _StubDHT:
    """What a hostile or validator-less DHT may return to ``dht.get``: anything."""

    def __init__(self, entries: dict[str, dict[object, tuple[object, float]]]) -> None:
        self.entries = entries

    async def get(self, key: str, latest: bool = False, return_future: bool = False) -> Any:
        items = self.entries.get(key)
        if not items:
            return None
        value = {
            sub: ValueWithExpiration(MSGPackSerializer.loads(MSGPackSerializer.dumps(v)), e)
            for sub, (v, e) in items.items()
        }
        return ValueWithExpiration(value, max(e for _, e in items.values()))


def _entry(identity: Identity, key: str, payload: bytes, ttl: float = 30.0) -> tuple[Any, float]:
    expiration = get_dht_time() + ttl
    return seal(identity, key, payload, expiration), expiration


def test_read_records_verifies_what_the_dht_returns(caplog: pytest.LogCaptureFixture) -> None:
    key = nodes_key(RUN)
    forged = pack_payload(_node(ALICE, step=10**9).to_wire())
    dht = _StubDHT(
        {
            key: {
                ALICE.peer_id: _entry(MALLORY, key, forged),
                BOB.peer_id: _entry(BOB, key, pack_payload(_node(BOB).to_wire())),
                MALLORY.peer_id: (_node(MALLORY).to_wire(), get_dht_time() + 30),
                "not-a-peer": _entry(MALLORY, key, NODE),
            }
        }
    )
    with caplog.at_level(logging.WARNING, logger="diloco"):
        records = asyncio.run(read_records(dht, RUN))  # type: ignore[arg-type]
    assert records == [_node(BOB)]
    assert ALICE.peer_id in caplog.text and MALLORY.peer_id in caplog.text


def test_readers_skip_far_expiration_and_wrong_kinds() -> None:
    nodes, rkey = nodes_key(RUN), round_key(RUN, RoundKey(1, 2))
    dht = _StubDHT(
        {
            nodes: {MALLORY.peer_id: _entry(MALLORY, nodes, NODE, ttl=10**6)},
            rkey: {
                ALICE.peer_id: _entry(ALICE, rkey, pack_payload(1.5)),
                MALLORY.peer_id: _entry(MALLORY, rkey, pack_payload(float("inf"))),
                BOB.peer_id: _entry(BOB, rkey, pack_payload(2.0), ttl=10**6),
            },
            RUN_CONFIGS_KEY: {
                BOB.peer_id: _entry(BOB, RUN_CONFIGS_KEY, SIGNED.to_payload()),
                MALLORY.peer_id: _entry(
                    MALLORY, RUN_CONFIGS_KEY, pack_payload([RUN, BOMB, bytes(64)])
                ),
            },
        }
    )
    assert asyncio.run(read_records(dht, RUN)) == []  # type: ignore[arg-type]
    declared = asyncio.run(read_declarations(dht, rkey))  # type: ignore[arg-type]
    assert {peer.to_base58(): w for peer, w in declared.items()} == {ALICE.peer_id: 1.5}
    assert asyncio.run(find_run_configs(dht)) == {RUN: SIGNED}  # type: ignore[arg-type]


def test_only_a_signing_dht_can_store() -> None:
    with pytest.raises(TypeError, match="SigningDHT"):
        signer(_StubDHT({}))  # type: ignore[arg-type]


# --- real processes: 2 honest DHT nodes and a hostile one on loopback ----------------------


async def _local_entries(key: str, _dht: Any, node: Any) -> dict[str, tuple[bytes, float]]:
    """What one DHT node holds under ``key`` in its own storage (runs in its process)."""
    item = node.protocol.storage.get(DHTID.generate(source=key))
    if item is None:
        return {}
    return {sub: (entry.value, entry.expiration_time) for sub, entry in item.value.items()}


def _stored(dht: DHT, key: str) -> dict[str, bytes]:
    """Subkey -> signed payload that ``dht`` holds under ``key`` (raw bytes for others)."""
    entries: dict[str, tuple[bytes, float]] = dht.run_coroutine(partial(_local_entries, key))
    found = {}
    for subkey, (value, _) in entries.items():
        envelope = MSGPackSerializer.loads(value)
        found[subkey] = envelope[1] if isinstance(envelope, list) else value
    return found


@pytest.mark.swarm
def test_hostile_peer_cannot_forge_hide_or_pin_records(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seed_file = tmp_path / "seed.key"
    seed_file.write_bytes(SEED_KEY_FILE)
    # A temporary folder of this test's own: the suite's other lanes start nodes meanwhile,
    # whose fresh identities pass through the machine's (one did, between the two globs).
    private_tmp = tmp_path / "tmp"
    private_tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(private_tmp))
    dhts: list[DHT] = []
    try:
        alice = make_dht(
            NetworkOptions(host_maddrs=("/ip4/127.0.0.2/tcp/0",), identity_path=str(seed_file))
        )
        dhts.append(alice)
        peers = [str(a) for a in alice.get_visible_maddrs()]
        bob = make_dht(
            NetworkOptions(initial_peers=tuple(peers), host_maddrs=("/ip4/127.0.0.3/tcp/0",))
        )
        dhts.append(bob)
        hostile = TiedDHT(  # hivemind's DHT, no validator; read whole (processes)
            initial_peers=peers,
            start=True,
            host_maddrs=["/ip4/127.0.0.4/tcp/0"],
            use_relay=False,
            use_auto_relay=False,
            nat_port_map=False,
            auto_nat=False,
        )
        dhts.append(hostile)
        # Every node runs p2pd with the key it signs with; a fresh one leaves no key file.
        assert alice.peer_id.to_base58() == SEED_PEER_ID == signer(alice).peer_id
        assert bob.peer_id.to_base58() == signer(bob).peer_id
        assert glob.glob(os.path.join(private_tmp, "diloco-id-*")) == []

        a_id, b_id, m_id = SEED_PEER_ID, signer(bob).peer_id, MALLORY.peer_id
        record_a, record_b = _node_of(a_id), _node_of(b_id)
        assert asyncio.run(publish_record(alice, RUN, record_a, 30.0))
        assert asyncio.run(publish_record(bob, RUN, record_b, 30.0))
        assert asyncio.run(publish_run_config(alice, SIGNED, 30.0))
        with pytest.raises(ValueError, match="cannot publish the record of"):
            asyncio.run(publish_record(alice, RUN, record_b, 30.0))

        # The attacker writes with hivemind's own DHT.store, bypassing our helpers.
        key, now = nodes_key(RUN), get_dht_time()
        claim = pack_payload(_node_of(a_id, step=10**9).to_wire())
        honest_envelope = hostile.get(key, latest=True).value[a_id].value
        attacks: list[tuple[str, str, object, float]] = [
            (key, a_id, seal(MALLORY, key, claim, now + 60), now + 60),  # forged
            (key, a_id, [key, claim, honest_envelope[2]], now + 90),  # tampered copy
            (key, m_id, _node_of(m_id).to_wire(), now + 60),  # unsigned
            (key, m_id, seal(MALLORY, key, NODE, now + 10**6), now + 10**6),  # pinned
            (RUN_CONFIGS_KEY, m_id, _seal_bomb(now + 60), now + 60),  # JSON depth bomb
        ]
        for akey, subkey, value, expiration in attacks:
            hostile.store(akey, value, expiration, subkey=subkey)
        # Its own record, signed by its own key, is what it may write: it reaches honest
        # nodes, which shows that the forgeries above reached them too.
        record_m = _node_of(m_id)
        own = seal(MALLORY, key, pack_payload(record_m.to_wire()), now + 30)
        hostile.store(key, own, now + 30, subkey=m_id)

        # The attack happened: the hostile node holds its forgeries itself.
        assert _stored(hostile, key)[a_id] == claim
        assert m_id in _stored(hostile, RUN_CONFIGS_KEY)
        honest = {
            a_id: pack_payload(record_a.to_wire()),
            b_id: pack_payload(record_b.to_wire()),
            m_id: pack_payload(record_m.to_wire()),
        }
        for dht in (alice, bob):
            # Honest nodes refused to store every forgery ...
            stored = _stored(dht, key)
            assert stored[m_id] == honest[m_id] and stored.items() <= honest.items()
            assert set(_stored(dht, RUN_CONFIGS_KEY)) == {a_id}
            # ... and their readers see the records unchanged, none of the forged.
            expected = sorted([record_a, record_b, record_m], key=lambda r: r.peer_id)
            assert asyncio.run(read_records(dht, RUN)) == expected
            assert asyncio.run(find_run_configs(dht)) == {RUN: SIGNED}
        # A reader whose DHT validates nothing can be shown forgeries, and its own check
        # drops them: it may miss records, never take a forged one.
        raw = TiedDHT(
            initial_peers=peers,
            start=True,
            client_mode=True,
            host_maddrs=["/ip4/127.0.0.5/tcp/0"],
            use_relay=False,
            use_auto_relay=False,
            nat_port_map=False,
            auto_nat=False,
        )
        dhts.append(raw)
        assert set(asyncio.run(read_records(raw, RUN))) <= {record_a, record_b, record_m}
        assert asyncio.run(find_run_configs(raw)) == {RUN: SIGNED}
    finally:
        for dht in dhts:
            dht.shutdown()


def _node_of(peer_id: str, step: int = 10) -> NodeRecord:
    frags = (FragmentVersion(0, 1, H),)
    return NodeRecord(peer_id, ("/ip4/127.0.0.1/tcp/1",), step, frags, 1.0, "0.1.0")


def _seal_bomb(expiration: float) -> list[Any]:
    return seal(MALLORY, RUN_CONFIGS_KEY, pack_payload([RUN, BOMB, bytes(64)]), expiration)
