"""Seals of PART and AVERAGED parts and signed CHECK_RES: bound to their signer, what they
cover and their purpose."""

from __future__ import annotations

import dataclasses

import pytest

from diloco.errors import ProtocolError
from diloco.protocol.trust.identity import Identity
from diloco.protocol.trust.round_signatures import (
    sign_averaged,
    sign_check,
    sign_part,
    verify_averaged,
    verify_check,
    verify_part,
)
from diloco.protocol.wire.check import CheckEntry, CheckResponse
from diloco.protocol.wire.frames import RoundTag
from diloco.protocol.wire.part import PartHead

ME, OTHER = Identity.generate(), Identity.generate()
SEAL = PartHead(RoundTag(bytes(range(16)), 3, 9), b"g" * 16, 1, 2)
HASHES = [b"a" * 32, b"b" * 32]


def test_part_seal_binds_sender_part_and_every_chunk() -> None:
    signature = sign_part(ME, SEAL, HASHES)
    verify_part(ME.peer_id, SEAL, HASHES, signature)
    for peer, seal, hashes in [
        (OTHER.peer_id, SEAL, HASHES),
        (ME.peer_id, dataclasses.replace(SEAL, part=2), HASHES),
        (ME.peer_id, dataclasses.replace(SEAL, tag=RoundTag(bytes(range(16)), 3, 10)), HASHES),
        (ME.peer_id, SEAL, [b"a" * 32, b"c" * 32]),
        (ME.peer_id, SEAL, HASHES[:1]),
    ]:
        with pytest.raises(ProtocolError, match="bad signature"):
            verify_part(peer, seal, hashes, signature)


def test_averaged_seal_binds_the_digest_and_is_no_part_seal() -> None:
    signature = sign_averaged(ME, SEAL, b"d" * 32)
    verify_averaged(ME.peer_id, SEAL, b"d" * 32, signature)
    with pytest.raises(ProtocolError, match="bad signature"):
        verify_averaged(ME.peer_id, SEAL, b"e" * 32, signature)
    with pytest.raises(ProtocolError, match="bad signature"):
        verify_averaged(OTHER.peer_id, SEAL, b"d" * 32, signature)
    # the same bytes sealed as a sender's chunk hashes do not pass as an averaged part
    with pytest.raises(ProtocolError, match="bad signature"):
        verify_part(ME.peer_id, SEAL, [b"d" * 32], signature)


def test_check_signature_binds_the_answer() -> None:
    entry = CheckEntry(1, (0,), (1.0,))
    signed = sign_check(ME, CheckResponse(SEAL.tag, SEAL.group_id, (entry,), b"\0v", b""))
    verify_check(ME.peer_id, CheckResponse.parse(signed.serialize()))
    with pytest.raises(ProtocolError, match="bad signature"):
        verify_check(ME.peer_id, dataclasses.replace(signed, payload=b"\0w"))
    other = dataclasses.replace(entry, norms=(1.5,))
    with pytest.raises(ProtocolError, match="bad signature"):
        verify_check(ME.peer_id, dataclasses.replace(signed, entries=(other,)))
