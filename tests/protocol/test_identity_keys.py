"""Ed25519 identities (``protocol/trust/identity.py``): libp2p key files, peer id <-> public key,
signatures. (Named apart from ``tests/node/test_identity.py``: test basenames must differ.)"""

from __future__ import annotations

import os
import signal
import stat
import struct
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from hivemind.proto import crypto_pb2

from diloco.errors import ConfigError, ProtocolError
from diloco.protocol.trust import identity
from diloco.protocol.trust.identity import (
    Identity,
    load_identity,
    load_or_create_identity,
    public_key_of,
    signing_input,
    verify,
)
from diloco.protocol.trust.remembered import Remembered

SEED = bytes(range(32))
SEED_PEER_ID = "12D3KooWA4Xop1JaT3MHxwYMkCepYsv4iPVopMXwCz5iHYdBfeSB"
"""The peer id p2pd (hivemind 1.1.12's) reported for the key file of ``SEED``."""
SEED_KEY_FILE = bytes.fromhex(
    "08011240000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f"
    "03a107bff3ce10be1d70dd18e74bc09967e4d6309ba50d5f1ddc8664125531b8"
)
"""protobuf PrivateKey(key_type=Ed25519, data=seed + public key) of ``SEED``: p2pd read it."""
RSA_PEER_ID = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
RAW = serialization.Encoding.Raw


def _ed25519_file(data: bytes) -> bytes:
    return bytes(crypto_pb2.PrivateKey(key_type=crypto_pb2.Ed25519, data=data).SerializeToString())


def _seed_identity() -> Identity:
    return Identity.from_private_key(Ed25519PrivateKey.from_private_bytes(SEED))


def test_identity_peer_id_is_the_one_p2pd_reports() -> None:
    assert _seed_identity().peer_id == SEED_PEER_ID


def test_identity_key_file_is_libp2p_format() -> None:
    assert _seed_identity().to_key_file() == SEED_KEY_FILE
    assert Identity.from_key_file(SEED_KEY_FILE).peer_id == SEED_PEER_ID


def test_public_key_of_peer_id_is_the_key() -> None:
    expected = Ed25519PrivateKey.from_private_bytes(SEED).public_key()
    found = public_key_of(SEED_PEER_ID)
    assert found.public_bytes(RAW, serialization.PublicFormat.Raw) == expected.public_bytes(
        RAW, serialization.PublicFormat.Raw
    )


@pytest.mark.parametrize(
    "peer_id",
    [RSA_PEER_ID, "not base58 0OIl", "", SEED_PEER_ID[:-1], SEED_PEER_ID + "1", "1" * 65, 7],
)
def test_public_key_of_non_ed25519_peer_id_rejected(peer_id: object) -> None:
    with pytest.raises(ProtocolError):
        public_key_of(peer_id)  # type: ignore[arg-type]


def test_signature_verifies_only_for_its_key_and_message() -> None:
    me, other = _seed_identity(), Identity.generate()
    message = signing_input("test/1", b"payload", 3)
    signature = me.sign(message)
    verify(me.peer_id, message, signature)
    with pytest.raises(ProtocolError, match="bad signature"):
        verify(other.peer_id, message, signature)
    with pytest.raises(ProtocolError, match="bad signature"):
        verify(me.peer_id, signing_input("test/1", b"payload", 4), signature)
    with pytest.raises(ProtocolError, match="bytes"):
        verify(me.peer_id, message, signature[:-1])
    with pytest.raises(ProtocolError, match="bad signature"):
        verify(me.peer_id, message, bytes(64))


def test_a_verified_signature_is_remembered_a_bad_one_never(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    checked: list[str] = []

    def counting(peer_id: str) -> Ed25519PublicKey:
        checked.append(peer_id)
        return public_key_of(peer_id)

    monkeypatch.setattr(identity, "public_key_of", counting)
    monkeypatch.setattr(identity, "_verified", Remembered(2))  # none from earlier tests
    me = Identity.generate()
    messages = [signing_input("test/1", b"cached", i) for i in range(3)]
    signatures = [me.sign(m) for m in messages]
    verify(me.peer_id, messages[0], signatures[0])
    verify(me.peer_id, messages[0], signatures[0])
    assert len(checked) == 1  # the second check was remembered
    for _ in range(2):  # a bad signature is checked each time it comes
        with pytest.raises(ProtocolError, match="bad signature"):
            verify(me.peer_id, messages[0], signatures[1])
    assert len(checked) == 3
    verify(me.peer_id, messages[1], signatures[1])
    verify(me.peer_id, messages[2], signatures[2])  # the cache holds 2: the first goes
    verify(me.peer_id, messages[0], signatures[0])
    assert len(checked) == 6


def test_a_process_forked_while_the_cache_was_locked_verifies() -> None:
    me = Identity.generate()
    message = signing_input("test/1", b"forked")
    signature = me.sign(message)
    with identity._verified._lock:  # as another thread of a node may hold it when it forks
        child = os.fork()
        if child == 0:  # pragma: no cover (the child)
            signal.signal(signal.SIGALRM, signal.SIG_DFL)  # not pytest-timeout's handler
            signal.alarm(20)  # a lock copied held would block it for good
            verify(me.peer_id, message, signature)
            os._exit(0)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_signing_input_is_canonical_msgpack() -> None:
    expected = (
        b"\x95"  # array of 5
        + b"\xa1d"  # "d"
        + b"\xc4\x01\x01"  # bin 8 of 1 byte
        + b"\xa1s"  # "s"
        + b"\x01"  # positive fixint
        + b"\xcb"
        + struct.pack(">d", 0.5)  # float 64, always
    )
    assert signing_input("d", b"\x01", "s", 1, 0.5) == expected


def test_load_or_create_writes_private_file_and_reloads_it(tmp_path: Path) -> None:
    path = tmp_path / "node.key"
    created = load_or_create_identity(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert load_or_create_identity(path).peer_id == created.peer_id
    assert load_identity(path).peer_id == created.peer_id


def test_write_refuses_existing_file(tmp_path: Path) -> None:
    path = tmp_path / "node.key"
    path.write_bytes(b"x")
    with pytest.raises(ConfigError, match="cannot create"):
        Identity.generate().write(path)
    assert path.read_bytes() == b"x"


def test_rsa_identity_refused_with_how_to(tmp_path: Path) -> None:
    key = rsa.generate_private_key(public_exponent=65537, key_size=1024)
    der = key.private_bytes(
        serialization.Encoding.DER,
        serialization.PrivateFormat.TraditionalOpenSSL,
        serialization.NoEncryption(),
    )
    path = tmp_path / "rsa.key"
    path.write_bytes(crypto_pb2.PrivateKey(key_type=crypto_pb2.RSA, data=der).SerializeToString())
    with pytest.raises(ConfigError, match=r"RSA key.*Ed25519.*does not exist yet"):
        load_or_create_identity(path)


@pytest.mark.parametrize(
    "data",
    [
        b"\xff\xfe garbage",
        crypto_pb2.PrivateKey(key_type=crypto_pb2.Ed25519, data=SEED).SerializeToString(),
        crypto_pb2.PrivateKey(
            key_type=crypto_pb2.Ed25519, data=SEED + bytes(32)
        ).SerializeToString(),
    ],
    ids=["garbage", "seed only", "wrong public key"],
)
def test_malformed_identity_file_refused(tmp_path: Path, data: bytes) -> None:
    path = tmp_path / "bad.key"
    path.write_bytes(data)
    with pytest.raises(ConfigError, match=r"bad\.key"):
        load_identity(path)


def test_missing_identity_directory_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot create"):
        load_or_create_identity(tmp_path / "missing" / "node.key")
