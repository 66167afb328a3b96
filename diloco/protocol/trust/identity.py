"""A node's Ed25519 identity: one key for libp2p streams and for everything the node signs.

The key file is libp2p's private-key format, the one p2pd reads through hivemind's
``identity_path``: a protobuf ``crypto.pb.PrivateKey`` with ``key_type = Ed25519`` and
``data`` = 32-byte seed + 32-byte public key. An Ed25519 peer id is an *identity*
multihash that inlines the public key::

    peer id bytes = 00 24 | 08 01 12 20 | <32-byte public key>
                    ^ multihash identity, 36 bytes
                           ^ protobuf PublicKey: key_type = Ed25519, data of 32 bytes

so anyone who knows only the author's peer id (a DHT subkey, a stream's remote peer) can
check its signatures, and a signature made with this key is bound to the same peer id that
libp2p authenticates on every stream. RSA identities (hivemind's default) hash their key
into the peer id instead; they are refused here.

Signed data is always built by ``signing_input(domain, *fields)``: canonical msgpack of the
domain (what is signed: "diloco-record/1", ...) and the fields, so that a signature made
for one purpose can never be replayed as another. Pure: no networking.
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

import base58
import msgpack
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from hivemind.proto import crypto_pb2

from diloco.errors import ConfigError, ProtocolError
from diloco.protocol.trust.remembered import Remembered

logger = logging.getLogger(__name__)

PEER_ID_PREFIX = bytes([0x00, 0x24, 0x08, 0x01, 0x12, 0x20])
"""Identity multihash of 36 bytes, then protobuf PublicKey(key_type=Ed25519, 32-byte data)."""
PUBLIC_KEY_BYTES = 32
SIGNATURE_BYTES = 64
MAX_PEER_ID_CHARS = 64
MAX_KEY_FILE_BYTES = 16 * 1024
HOW_TO_MAKE_ONE = (
    "give a path that does not exist yet and diloco-node creates an Ed25519 identity there"
)

VERIFIED_CACHE = 8192
"""Signatures a process remembers as verified. The DHT hands the same records back again and
again (docs/design.md "Wire formats"): checking each anew was a third of the CPU of a DHT
process holding a few dozen records."""

_RAW = serialization.Encoding.Raw
_verified = Remembered(VERIFIED_CACHE)


@dataclass(frozen=True, slots=True)
class Identity:
    """An Ed25519 private key and the libp2p peer id (base58) it stands for."""

    private_key: Ed25519PrivateKey = field(repr=False)
    peer_id: str

    @classmethod
    def generate(cls) -> Identity:
        return cls.from_private_key(Ed25519PrivateKey.generate())

    @classmethod
    def from_private_key(cls, key: Ed25519PrivateKey) -> Identity:
        return cls(key, peer_id_of(key.public_key()))

    @classmethod
    def from_key_file(cls, data: bytes) -> Identity:
        """Parse a libp2p private-key file.

        Raises:
            ConfigError: for anything but an Ed25519 key, saying how to make one.
        """
        try:
            message = crypto_pb2.PrivateKey.FromString(data)
        except Exception as exc:  # protobuf's DecodeError and friends
            raise ConfigError(f"not a libp2p private-key file ({exc}); {HOW_TO_MAKE_ONE}") from exc
        if message.key_type != crypto_pb2.KeyType.Ed25519:
            kind = crypto_pb2.KeyType.Name(message.key_type)
            raise ConfigError(
                f"the identity is a {kind} key; peers sign their records with Ed25519 keys: "
                f"{HOW_TO_MAKE_ONE} (the peer id changes)"
            )
        # go-libp2p writes seed + public key (64 bytes); old versions repeat the public key.
        if len(message.data) not in (64, 96):
            raise ConfigError(f"Ed25519 identity of {len(message.data)} bytes; {HOW_TO_MAKE_ONE}")
        key = Ed25519PrivateKey.from_private_bytes(message.data[:32])
        if _raw_public(key.public_key()) != message.data[32:64]:
            raise ConfigError(f"Ed25519 identity with a mismatched public key; {HOW_TO_MAKE_ONE}")
        return cls.from_private_key(key)

    def to_key_file(self) -> bytes:
        """The libp2p private-key file (protobuf) that p2pd reads."""
        seed = self.private_key.private_bytes(
            _RAW, serialization.PrivateFormat.Raw, serialization.NoEncryption()
        )
        data = seed + _raw_public(self.private_key.public_key())
        message = crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.Ed25519, data=data)
        return bytes(message.SerializeToString())

    def sign(self, message: bytes) -> bytes:
        """64-byte Ed25519 signature of ``message`` (build it with ``signing_input``)."""
        return self.private_key.sign(message)

    def write(self, path: str | Path) -> None:
        """Write the key file at ``path``, readable by its owner only (mode 0600).

        Raises:
            ConfigError: the file exists or cannot be created.
        """
        write_private_file(path, self.to_key_file(), "identity file")


def load_identity(path: str | Path) -> Identity:
    """The identity in the key file at ``path``.

    Raises:
        ConfigError: unreadable, oversize, or not an Ed25519 libp2p key file.
    """
    try:
        with open(path, "rb") as file:
            mode = os.fstat(file.fileno()).st_mode
            data = file.read(MAX_KEY_FILE_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"cannot read identity file {path}: {exc.strerror}") from exc
    if len(data) > MAX_KEY_FILE_BYTES:
        raise ConfigError(f"identity file {path} is too large for a key; {HOW_TO_MAKE_ONE}")
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        logger.warning("identity file %s is readable by others; chmod 600 it", path)
    try:
        return Identity.from_key_file(data)
    except ConfigError as exc:
        raise ConfigError(f"identity file {path}: {exc}") from exc


def load_or_create_identity(path: str | Path) -> Identity:
    """The identity at ``path``, created there (Ed25519, mode 0600) if the file is missing."""
    if os.path.exists(path):
        return load_identity(path)
    identity = Identity.generate()
    identity.write(path)
    logger.info("created identity %s in %s", identity.peer_id, path)
    return identity


def peer_id_of(public_key: Ed25519PublicKey) -> str:
    """The libp2p peer id (base58) of an Ed25519 public key."""
    return base58.b58encode(PEER_ID_PREFIX + _raw_public(public_key)).decode()


def public_key_of(peer_id: str) -> Ed25519PublicKey:
    """The public key inlined in an Ed25519 peer id.

    Raises:
        ProtocolError: not a base58 Ed25519 peer id (e.g. an RSA one, whose key is hashed).
    """
    if not isinstance(peer_id, str) or not 0 < len(peer_id) <= MAX_PEER_ID_CHARS:
        raise ProtocolError(f"peer id {peer_id!r:.80} is not a short string")
    try:
        raw = base58.b58decode(peer_id)
    except ValueError as exc:
        raise ProtocolError(f"peer id {peer_id!r} is not base58") from exc
    if len(raw) != len(PEER_ID_PREFIX) + PUBLIC_KEY_BYTES or not raw.startswith(PEER_ID_PREFIX):
        raise ProtocolError(f"peer id {peer_id} is not an Ed25519 peer id")
    try:
        return Ed25519PublicKey.from_public_bytes(raw[len(PEER_ID_PREFIX) :])
    except ValueError as exc:
        raise ProtocolError(f"peer id {peer_id} holds no Ed25519 key") from exc


def verify(peer_id: str, message: bytes, signature: bytes) -> None:
    """Check that ``peer_id``'s key signed ``message``.

    Raises:
        ProtocolError: a malformed peer id or signature, or a signature that does not verify.
    """
    if not isinstance(signature, bytes) or len(signature) != SIGNATURE_BYTES:
        raise ProtocolError(f"signature of {peer_id} is not {SIGNATURE_BYTES} bytes")
    # Only successes are remembered, by exactly what was checked: the same key, message
    # (its hash) and signature verify again. A bad signature costs its checker every time.
    if not isinstance(peer_id, str):
        raise ProtocolError(f"peer id {peer_id!r:.80} is not a string")
    seen = (peer_id, hashlib.sha256(message).digest(), signature)
    if seen in _verified:
        return
    try:
        public_key_of(peer_id).verify(signature, message)
    except InvalidSignature as exc:
        raise ProtocolError(f"bad signature by {peer_id}") from exc
    _verified.add(seen)


def signing_input(domain: str, *fields: bytes | str | int | float) -> bytes:
    """The bytes to sign for ``fields`` in ``domain``: canonical msgpack of the list.

    msgpack gives every value one encoding (floats always as float64), so signer and
    verifier build the same bytes from the same values.
    """
    return bytes(msgpack.packb([domain, *fields], use_bin_type=True, use_single_float=False))


def _raw_public(public_key: Ed25519PublicKey) -> bytes:
    return public_key.public_bytes(_RAW, serialization.PublicFormat.Raw)


def write_private_file(path: str | Path, data: bytes, what: str) -> None:
    """Write ``data`` to a new file at ``path`` readable by its owner only (mode 0600).

    Raises:
        ConfigError: the file exists or cannot be created (``what`` names it).
    """
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as exc:
        raise ConfigError(f"cannot create {what} {path}: {exc.strerror}") from exc
    with os.fdopen(fd, "wb") as file:
        file.write(data)
