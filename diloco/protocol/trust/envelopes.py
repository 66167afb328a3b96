"""Owned DHT records (docs/design.md "Threat model"): signed by their author, stored under
the author's peer id, checked by every DHT node that stores or returns them and by readers.

Every value a node stores is an envelope, a msgpack list::

    [key: str, payload: bytes, signature: 64 bytes]
    stored under DHT key = key, subkey = author's Ed25519 peer id (base58),
    signature = Ed25519 by the subkey's key over
        signing_input("diloco-record/1", key, subkey, payload, float(expiration))

In a closed swarm the envelope has a fourth element, the author's proof that it holds the
swarm key (``swarm_key.ClosedSwarm.record_proof``: HMAC over the run, the key, the author
and the payload's hash)::

    [key: str, payload: bytes, signature: 64 bytes, proof: 32 bytes]

A node restricted to a run's members (``SigningDHT.restrict`` with an
``admission.Membership``) adds its proof to every record it stores and drops, in
``read_signed``, every record whose author is not admitted or whose proof is missing or
wrong: so every record kind (node records, vouches, metrics, declarations, run-config
offers) of an outsider reaches no member, without a check in each reader. Open swarms
store and read the three-element envelope as before. The signature does not cover the
proof: a relay can strip it (the record is then dropped, as a relay could drop it anyway),
but nobody without the key can add one.

``payload`` is the kind's own msgpack (node record, run config...). The key travels in
clear because hivemind hands validators only its hash: with it, ``SignedRecordValidator``
knows the record's kind from the key's form (``schemas``) and checks the payload's schema,
so a node record stored under a round key is refused like any malformed one.

Why not hivemind's ``RSASignatureValidator`` + ``SchemaValidator`` (as its progress tracker
uses): the RSA validator is keyed by a second, process-wide RSA key embedded in the subkey,
unrelated to the libp2p peer id; a record's author could then differ from the peer that
libp2p authenticates on streams, and every subkey carries a ~400-byte RSA key. Here the
subkey *is* the peer id, whose Ed25519 key is inlined (``identity``): one identity for
streams and records, 64-byte signatures. ``SchemaValidator`` needs pydantic models per
key; our schemas are the strict ``from_wire`` parsers the readers use anyway.

Signing happens in the application's process (``store_signed``), not in the DHT process
through ``sign_value``: the key stays with the node, the validator holds no secret and
stays small and picklable, and ``sign_value``/``strip_value`` are the identity.
hivemind calls ``validate`` when a peer asks us to store a record, on our own stores and
on every record a peer returns to us (one invalid subkey drops that peer's whole answer
for the key). Readers (``read_signed``) verify again: a DHT node that runs without this
validator, or a hostile one, may return anything.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import msgpack
from hivemind import DHT
from hivemind.dht.node import DHTNode
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import get_dht_time

from diloco.errors import ConfigError, ProtocolError
from diloco.protocol.runtime.processes import TiedDHT
from diloco.protocol.trust.admission import Membership
from diloco.protocol.trust.identity import Identity, load_or_create_identity, signing_input, verify
from diloco.protocol.trust.remembered import Remembered
from diloco.protocol.trust.swarm_key import PROOF_BYTES

logger = logging.getLogger(__name__)

DOMAIN = "diloco-record/1"
MAX_RECORD_TTL = 300.0
"""Seconds a record may live beyond now: a far expiration would pin it after its author left."""
MAX_CLOCK_SKEW = 60.0
"""Seconds another peer's clock may run ahead of ours."""
MAX_KEY_CHARS = 256
MAX_PAYLOAD_BYTES = 72 * 1024
"""Largest payload of any kind (a run configuration: 64 KiB of JSON and its run id)."""
MAX_RECORD_BYTES = MAX_PAYLOAD_BYTES + 1024

Schema = Callable[[str, str, bytes], object]
"""Checks a payload of one kind: ``(key, author peer id, payload)``; raises ProtocolError or
ConfigError when it is malformed."""


@dataclass(frozen=True, slots=True)
class SignedValue:
    """A verified record: its author's payload and its expiration (DHT time)."""

    payload: bytes
    expiration: float
    proof: bytes | None = None
    """The author's proof of holding a closed swarm's key, if its envelope carries one."""


class SigningDHT(TiedDHT):
    """A ``hivemind.DHT`` whose p2pd runs with this node's Ed25519 ``identity``, which
    ``store_signed`` signs with in this process; it ends with this process (``TiedDHT``).

    With ``identity_path`` None the node gets a fresh identity (a new peer id each start),
    written to a private temporary directory (mode 0700) that is removed once p2pd has read
    the key. Other keyword arguments are ``hivemind.DHT``'s; it always starts at once.

    Raises:
        ConfigError: the identity file is not an Ed25519 key, or p2pd reports another peer
            id than the key's.
    """

    identity: Identity
    reused_identity: bool
    """Whether the identity file existed before this start: a previous process of this node
    may have run under this peer id, and its round declarations may still be live
    (``Ahead.earlier_process_in``)."""
    membership: Membership | None = None
    """Whose records count and what this node's records carry (``restrict``); None: all."""

    def __init__(self, *, identity_path: str | None, **kwargs: Any) -> None:
        private_dir = tempfile.mkdtemp(prefix="diloco-id-") if identity_path is None else None
        reused = identity_path is not None and os.path.exists(identity_path)
        try:
            if private_dir is None:
                path, identity = str(identity_path), load_or_create_identity(str(identity_path))
            else:
                path, identity = os.path.join(private_dir, "identity.key"), Identity.generate()
                identity.write(path)
            # hivemind's identity-in-use check would start a second p2pd (NAT probing on)
            # and reads only RSA keys: off.
            fixed = {"start": True, "check_if_identity_free": False}
            super().__init__(identity_path=path, **(kwargs | fixed))
        finally:
            if private_dir is not None:  # p2pd has read it, or failed to start
                shutil.rmtree(private_dir, ignore_errors=True)
        self.identity, self.reused_identity = identity, reused
        if self.peer_id.to_base58() != identity.peer_id:
            self.shutdown()
            raise ConfigError(f"p2pd runs as {self.peer_id}, not as the key's {identity.peer_id}")

    def restrict(self, membership: Membership) -> None:
        """From now on store records with this node's proof of membership and read only
        the records ``membership`` accepts (a joiner learns its run after its DHT started)."""
        self.membership = membership


ACCEPTED_CACHE = 8192
"""Records a process remembers as accepted by its validator. A DHT node checks every record
of every answer to its lookups, and a lookup of the latest records asks every peer, which
return the same records again and again: a check (about 0.13 ms, the signature's own
verification already remembered) ran some 20,000 times per DHT process in the attacks'
swarm test, 14% of the CPU of all its processes, p2pd's included."""

_accepted = Remembered(ACCEPTED_CACHE)


class SignedRecordValidator(RecordValidatorBase):  # type: ignore[misc]
    """Accepts a record iff it is a well-formed envelope signed by its subkey's key, expires
    within ``MAX_RECORD_TTL + MAX_CLOCK_SKEW`` seconds, and its key has a form listed in
    ``schemas`` whose check passes the payload. Everything else is refused, unsigned values
    and values without a subkey included: every record of ours is owned.
    """

    def __init__(self, schemas: Sequence[tuple[re.Pattern[str], Schema]]) -> None:
        self.schemas = tuple(schemas)
        self._token = object()
        """Names these schemas in the accepted records' cache (hashing the patterns
        themselves costs more than the rest of a hit)."""

    def validate(self, record: DHTRecord) -> bool:
        # Only acceptances are remembered, by exactly what was checked (the record's key,
        # author, value and expiration, with these schemas): nothing the check reads
        # changes afterwards, but for the clock, and a record not too far ahead stays so.
        seen = (
            self._token,
            record.key,
            record.subkey,
            hashlib.sha256(record.value).digest(),
            record.expiration_time,
        )
        if seen in _accepted:
            return True
        if not self._check(record):
            return False
        _accepted.add(seen)
        return True

    def _check(self, record: DHTRecord) -> bool:
        try:
            author = _unpack(record.subkey, MAX_KEY_CHARS)
            envelope = _unpack(record.value, MAX_RECORD_BYTES)
            key = envelope[0] if isinstance(envelope, list) and envelope else None
            if not isinstance(key, str) or len(key) > MAX_KEY_CHARS:
                raise ProtocolError("value is not a signed envelope")
            if DHTID.generate(source=key).to_bytes() != record.key:
                raise ProtocolError(f"envelope names key {key!r}, not the record's")
            signed = open_envelope(key, author, envelope, record.expiration_time)
            self.check_payload(key, str(author), signed.payload)
        except (ProtocolError, ConfigError) as exc:
            logger.debug("refusing a DHT record: %s", exc)
            return False
        return True

    def check_payload(self, key: str, author: str, payload: bytes) -> None:
        """Run the schema of ``key``'s form on ``payload``.

        Raises:
            ProtocolError: no schema for such a key, or the schema's own error.
        """
        for pattern, schema in self.schemas:
            if pattern.fullmatch(key):
                schema(key, author, payload)
                return
        raise ProtocolError(f"no record kind for key {key!r}")

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return isinstance(other, SignedRecordValidator) and other.schemas == self.schemas


def seal(
    identity: Identity, key: str, payload: bytes, expiration: float, proof: bytes | None = None
) -> list[Any]:
    """The envelope of ``payload`` under ``key``, signed by ``identity``, with a closed
    swarm's ``proof`` when given (see module doc)."""
    message = signing_input(DOMAIN, key, identity.peer_id, payload, float(expiration))
    envelope: list[Any] = [key, payload, identity.sign(message)]
    return envelope if proof is None else [*envelope, proof]


def open_envelope(key: str, author: object, envelope: object, expiration: object) -> SignedValue:
    """The verified payload of an envelope read under ``key`` and subkey ``author``.

    Raises:
        ProtocolError: not an envelope of this key, an expiration that is not finite or too
            far ahead, an oversize payload, or a signature that is not ``author``'s.
    """
    if not isinstance(author, str):
        raise ProtocolError(f"subkey {author!r:.80} is not a peer id")
    if not isinstance(envelope, list) or len(envelope) not in (3, 4):
        raise ProtocolError(f"value under {author}'s subkey is not a signed envelope")
    stated_key, payload, signature, *rest = envelope
    proof = rest[0] if rest else None
    if proof is not None and (not isinstance(proof, bytes) or len(proof) != PROOF_BYTES):
        raise ProtocolError(f"record of {author} has a proof that is not {PROOF_BYTES} bytes")
    if stated_key != key:
        raise ProtocolError(f"record of {author} is signed for another key")
    if not isinstance(payload, bytes) or len(payload) > MAX_PAYLOAD_BYTES:
        raise ProtocolError(f"payload of {author} is not bytes of at most {MAX_PAYLOAD_BYTES}")
    if not isinstance(expiration, float) or not math.isfinite(expiration):
        raise ProtocolError(f"record of {author} has expiration {expiration!r}")
    if expiration > get_dht_time() + MAX_RECORD_TTL + MAX_CLOCK_SKEW:
        raise ProtocolError(f"record of {author} expires too far ahead")
    verify(author, signing_input(DOMAIN, key, author, payload, expiration), signature)
    return SignedValue(payload, expiration, proof)


async def store_signed(dht: DHT, key: str, payload: bytes, expiration: float) -> bool:
    """Sign ``payload`` for ``key`` with the node's identity and store it under its own
    subkey until ``expiration`` (DHT time, at most ``MAX_RECORD_TTL`` ahead), with its
    proof of membership in a closed swarm.

    Raises:
        TypeError: ``dht`` is not a ``SigningDHT``.
        ValueError: an expiration beyond ``MAX_RECORD_TTL``, which the DHT would refuse.
    """
    identity = signer(dht)
    if expiration > get_dht_time() + MAX_RECORD_TTL:
        raise ValueError(f"records live at most {MAX_RECORD_TTL} s")
    membership = membership_of(dht)
    proof = None if membership is None else membership.proof(key, identity.peer_id, payload)
    envelope = seal(identity, key, payload, expiration, proof)
    stored = await dht.store(
        key, envelope, float(expiration), subkey=identity.peer_id, return_future=True
    )
    return bool(stored)


async def read_signed(dht: DHT, key: str) -> dict[str, SignedValue]:
    """Every unexpired record under ``key`` whose signature and form check out, by author
    peer id; the others are logged with the peer id they claim and skipped. A restricted
    node (``SigningDHT.restrict``) also skips what its ``Membership`` does not accept."""
    found = await dht.get(key, latest=True, return_future=True)
    return _verified(dht, key, found)


async def read_signed_many(dht: DHT, keys: Sequence[str]) -> dict[str, dict[str, SignedValue]]:
    """``read_signed`` of each of ``keys`` (distinct), in one call to the DHT process and one
    lookup, whose requests to a DHT node carry several keys: half the CPU, all processes
    counted, of one ``get`` per key at once (a heal's check reads the node records and
    every fragment's vouches: docs/design.md "Healing and joining")."""
    if len(set(keys)) != len(keys):
        raise ValueError(f"keys read twice: {sorted(keys)}")
    if len(keys) == 1:
        return {keys[0]: await read_signed(dht, keys[0])}
    found = await dht.run_coroutine(partial(_latest_of, tuple(keys)), return_future=True)
    return {key: _verified(dht, key, found.get(key)) for key in keys}


async def _latest_of(keys: tuple[str, ...], dht: DHT, node: DHTNode) -> dict[str, Any]:
    """In the DHT process: what ``DHT.get(key, latest=True)`` returns, for each key."""
    return dict(await node.get_many(keys, sufficient_expiration_time=math.inf))


def _verified(dht: DHT, key: str, found: Any) -> dict[str, SignedValue]:
    """The records of ``found`` (what a DHT returned for ``key``) that ``read_signed`` keeps."""
    if found is None or not isinstance(found.value, Mapping):
        return {}
    membership = membership_of(dht)
    verified = {}
    for author, item in found.value.items():
        value, expiration = getattr(item, "value", None), getattr(item, "expiration_time", None)
        try:
            signed = open_envelope(key, author, value, expiration)
        except ProtocolError as exc:
            logger.warning("ignoring record under %s claimed by %r: %s", key, author, exc)
            continue
        if membership is None or membership.accepts(key, author, signed.payload, signed.proof):
            verified[author] = signed
    return verified


def membership_of(dht: DHT) -> Membership | None:
    """The ``Membership`` that ``dht`` was restricted to (None: an open, unrestricted one)."""
    membership = getattr(dht, "membership", None)
    return membership if isinstance(membership, Membership) else None


def signer(dht: DHT) -> Identity:
    """The identity ``dht`` signs records with.

    Raises:
        TypeError: ``dht`` is not a ``SigningDHT`` (it has no key to sign with).
    """
    if not isinstance(dht, SigningDHT):
        raise TypeError("records are stored through a SigningDHT (make_dht starts one)")
    return dht.identity


def pack_payload(value: object) -> bytes:
    """msgpack of a payload value (lists, dicts with str keys, str, int, float, bytes)."""
    return bytes(msgpack.packb(value, use_bin_type=True, use_single_float=False))


def unpack_payload(payload: bytes, max_bytes: int) -> object:
    """Decode an untrusted payload of at most ``max_bytes``.

    Bounded: lengths by ``max_bytes``, nesting by msgpack's own stack (1024 levels; deeper
    input raises), no extension types. Kind schemas then check the exact shape.

    Raises:
        ProtocolError: oversize, truncated, trailing bytes, or invalid msgpack.
    """
    return _unpack(payload, max_bytes)


def _unpack(data: bytes, max_bytes: int) -> object:
    if not isinstance(data, bytes) or len(data) > max_bytes:
        raise ProtocolError(f"msgpack value larger than {max_bytes} bytes")
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=True, ext_hook=_no_ext)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise ProtocolError(f"invalid msgpack value: {exc!r:.200}") from exc


def _no_ext(code: int, data: bytes) -> object:
    raise ValueError(f"msgpack extension type {code}")
