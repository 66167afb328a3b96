"""What members sign in a round, and the checks of those signatures (layouts: ``wire``).

Each signed message is bound to its run, round, group, part and chunk by the bytes it
signs, and to its purpose by the domain of ``identity.signing_input``, so that no signature
can be replayed elsewhere. Payloads are signed through their sha256, so a reducer that keeps
a chunk as evidence keeps the payload and 64 bytes. Verification takes the signer's peer id
(base58), which inlines its Ed25519 key.
"""

from __future__ import annotations

import dataclasses
import hashlib

from diloco.protocol.check_wire import CheckResponse
from diloco.protocol.identity import Identity, signing_input, verify
from diloco.protocol.wire import Averaged, Buffer, PartHead

PART_DOMAIN = "diloco-part/1"
AVERAGED_DOMAIN = "diloco-averaged/1"
CHECK_DOMAIN = "diloco-check/1"


def _part_message(head: PartHead, payload: Buffer) -> bytes:
    return signing_input(PART_DOMAIN, head.serialize(), hashlib.sha256(payload).digest())


def sign_part(identity: Identity, head: PartHead, payload: Buffer) -> bytes:
    """The sender's signature of PART chunk ``head`` with ``payload``."""
    return identity.sign(_part_message(head, payload))


def verify_part(sender: str, head: PartHead, payload: Buffer, signature: bytes) -> None:
    """Raise ProtocolError unless ``sender`` signed this PART chunk."""
    verify(sender, _part_message(head, payload), signature)


def _averaged_message(msg: Averaged) -> bytes:
    return signing_input(AVERAGED_DOMAIN, msg.claims(), hashlib.sha256(msg.payload).digest())


def sign_averaged(identity: Identity, msg: Averaged) -> Averaged:
    """``msg`` with the reducer's signature (its own ``signature`` field is ignored)."""
    return dataclasses.replace(msg, signature=identity.sign(_averaged_message(msg)))


def verify_averaged(reducer: str, msg: Averaged) -> None:
    """Raise ProtocolError unless ``reducer`` signed this AVERAGED chunk."""
    verify(reducer, _averaged_message(msg), msg.signature)


def sign_check(identity: Identity, msg: CheckResponse) -> CheckResponse:
    """``msg`` with the answering member's signature."""
    signature = identity.sign(signing_input(CHECK_DOMAIN, msg.digest()))
    return dataclasses.replace(msg, signature=signature)


def verify_check(member: str, msg: CheckResponse) -> None:
    """Raise ProtocolError unless ``member`` signed this CHECK_RES."""
    verify(member, signing_input(CHECK_DOMAIN, msg.digest()), msg.signature)
