"""What members sign in a round, and the checks of those signatures (layouts: ``wire``).

A part is signed once, by a SEAL after its last chunk: a sender seals the sha256 of each
chunk it sent, a reducer the digest of its averaged part; a CHECK_RES is signed whole. The
bytes signed bind each signature to its run, round, group and part (the seal's head), and
the domain of ``identity.signing_input`` to its purpose, so no signature can be replayed
elsewhere. A reducer that keeps a chunk as evidence keeps its payload, the chunk hashes of
its sender and the seal. Verification takes the signer's peer id (base58), which inlines
its Ed25519 key.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from diloco.protocol.trust.identity import Identity, signing_input, verify
from diloco.protocol.wire.check import CheckResponse
from diloco.protocol.wire.part import PartHead

PART_DOMAIN = "diloco-part/1"
AVERAGED_DOMAIN = "diloco-averaged/1"
CHECK_DOMAIN = "diloco-check/1"


def sign_part(identity: Identity, seal: PartHead, hashes: Sequence[bytes]) -> bytes:
    """The sender's seal of its chunks of a part (``hashes``: sha256 of each payload)."""
    return identity.sign(signing_input(PART_DOMAIN, seal.serialize(), b"".join(hashes)))


def verify_part(sender: str, seal: PartHead, hashes: Sequence[bytes], signature: bytes) -> None:
    """Raise ProtocolError unless ``sender`` sealed chunks of these ``hashes``."""
    verify(sender, signing_input(PART_DOMAIN, seal.serialize(), b"".join(hashes)), signature)


def sign_averaged(identity: Identity, seal: PartHead, digest: bytes) -> bytes:
    """The reducer's seal of its averaged part (``digest``: ``reduction.part_digest``)."""
    return identity.sign(signing_input(AVERAGED_DOMAIN, seal.serialize(), digest))


def verify_averaged(reducer: str, seal: PartHead, digest: bytes, signature: bytes) -> None:
    """Raise ProtocolError unless ``reducer`` sealed the averaged part of ``digest``."""
    verify(reducer, signing_input(AVERAGED_DOMAIN, seal.serialize(), digest), signature)


def sign_check(identity: Identity, msg: CheckResponse) -> CheckResponse:
    """``msg`` with the answering member's signature."""
    signature = identity.sign(signing_input(CHECK_DOMAIN, msg.digest()))
    return dataclasses.replace(msg, signature=signature)


def verify_check(member: str, msg: CheckResponse) -> None:
    """Raise ProtocolError unless ``member`` signed this CHECK_RES."""
    verify(member, signing_input(CHECK_DOMAIN, msg.digest()), msg.signature)
