"""State transfer messages: round trips, and malformed requests and headers refused."""

from __future__ import annotations

import pytest

from diloco.errors import ProtocolError
from diloco.protocol.wire.state import StateEntry, StateHeader, StateRequest

DIGEST = bytes(range(16))


def test_state_messages_round_trip() -> None:
    request = StateRequest(DIGEST, (0, 5))
    assert StateRequest.parse(request.serialize()) == request
    header = StateHeader(DIGEST, 77, (StateEntry(0, 3, 10, bytes(32)),))
    assert StateHeader.parse(header.serialize()) == header
    with pytest.raises(ProtocolError, match="duplicate"):
        StateRequest(DIGEST, (1, 1)).serialize()


def test_state_header_length_mismatch_rejected() -> None:
    body = StateHeader(DIGEST, 5, (StateEntry(1, 2, 3, bytes(32)),)).serialize()
    with pytest.raises(ProtocolError, match="size"):
        StateHeader.parse(body[:-1])
