"""Signatures of PART, AVERAGED and CHECK_RES: bound to their signer, content and purpose."""

from __future__ import annotations

import dataclasses

import pytest

from diloco.errors import ProtocolError
from diloco.protocol.check_wire import CheckEntry, CheckResponse
from diloco.protocol.identity import Identity
from diloco.protocol.signatures import (
    sign_averaged,
    sign_check,
    sign_part,
    verify_averaged,
    verify_check,
    verify_part,
)
from diloco.protocol.wire import Averaged, PartHead, RoundTag

ME, OTHER = Identity.generate(), Identity.generate()
HEAD = PartHead(RoundTag(bytes(range(16)), 3, 9), b"g" * 16, 1, 4)


def test_part_signature_binds_sender_head_and_payload() -> None:
    signature = sign_part(ME, HEAD, b"\x04payload")
    verify_part(ME.peer_id, HEAD, b"\x04payload", signature)
    for peer, head, payload in [
        (OTHER.peer_id, HEAD, b"\x04payload"),
        (ME.peer_id, dataclasses.replace(HEAD, chunk=5), b"\x04payload"),
        (ME.peer_id, dataclasses.replace(HEAD, part=2), b"\x04payload"),
        (ME.peer_id, HEAD, b"\x04payloaD"),
    ]:
        with pytest.raises(ProtocolError, match="bad signature"):
            verify_part(peer, head, payload, signature)


def _averaged() -> Averaged:
    return Averaged(HEAD, (True, True), (1.0, 2.0), (0.5,), bytes(64), b"\x04mean")


def test_averaged_signature_binds_claims_and_payload() -> None:
    signed = sign_averaged(ME, _averaged())
    verify_averaged(ME.peer_id, signed)
    for forged in [
        dataclasses.replace(signed, norms=(1.0, 2.5)),
        dataclasses.replace(signed, block_norms=(0.6,)),
        dataclasses.replace(signed, mask=(False, True), norms=(0.0, 2.0)),
        dataclasses.replace(signed, payload=b"\x04meaN"),
    ]:
        with pytest.raises(ProtocolError, match="bad signature"):
            verify_averaged(ME.peer_id, forged)
    with pytest.raises(ProtocolError, match="bad signature"):
        verify_averaged(OTHER.peer_id, signed)


def test_a_part_signature_is_no_averaged_signature() -> None:
    msg = _averaged()
    stolen = dataclasses.replace(msg, signature=sign_part(ME, HEAD, msg.payload))
    with pytest.raises(ProtocolError, match="bad signature"):
        verify_averaged(ME.peer_id, stolen)


def test_check_signature_binds_the_answer() -> None:
    entry = CheckEntry(1, (0,), (1.0,), b"\0\0\x80?")
    signed = sign_check(ME, CheckResponse(HEAD.tag, HEAD.group_id, (entry,), b""))
    verify_check(ME.peer_id, CheckResponse.parse(signed.serialize()))
    other = dataclasses.replace(entry, values=b"\0\0\0@")
    with pytest.raises(ProtocolError, match="bad signature"):
        verify_check(ME.peer_id, dataclasses.replace(signed, entries=(other,)))
