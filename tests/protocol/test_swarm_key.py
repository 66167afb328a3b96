"""Closed swarms: the key file, its id, the AUTH exchange both ways, declaration proofs."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import os
import stat
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hivemind.p2p import PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo
from hivemind.utils.multiaddr import Multiaddr
from memory_p2p import MemoryNetwork, MemoryP2P, make_peer_id, stream_pair
from test_signed_records import _entry, _StubDHT

from diloco.errors import ConfigError
from diloco.protocol.core.reducer import RoundKey
from diloco.protocol.matchmaking.lobby import round_key
from diloco.protocol.records.declarations import read_declarations
from diloco.protocol.runtime import streams
from diloco.protocol.trust.envelopes import pack_payload
from diloco.protocol.trust.identity import Identity
from diloco.protocol.trust.swarm_key import (
    ClosedSwarm,
    ClosedTransport,
    NotMember,
    SwarmKey,
    check_swarm_key,
    load_swarm_key,
)
from diloco.protocol.wire.frames import Kind, Reject, RejectCode
from diloco.protocol.wire.run_id import make_run_id, run_digest

pytestmark = pytest.mark.clocked

RUN = make_run_id("closed", {"seed": 1})
DIGEST = run_digest(RUN)
KEY, OTHER_KEY = SwarmKey(b"k" * 32), SwarmKey(b"o" * 32)
HANDLER = f"/diloco/{RUN}/echo/1"


def _mac(secret: bytes, *fields: object) -> bytes:
    """The documented HMAC, built here from msgpack and hmac directly."""
    return hmac.new(secret, msgpack.packb(list(fields), use_bin_type=True), "sha256").digest()


# --- the key ---------------------------------------------------------------------------------


def test_key_id_is_the_documented_hash_and_names_one_key() -> None:
    expected = hashlib.sha256(b"diloco-swarm-key" + b"k" * 32).hexdigest()[:16]
    assert KEY.key_id == expected
    assert OTHER_KEY.key_id != KEY.key_id
    assert "k" * 8 not in repr(KEY)


@pytest.mark.parametrize("size", [0, 31, 4097])
def test_key_of_the_wrong_size_is_refused(size: int, tmp_path: Path) -> None:
    path = tmp_path / "key"
    path.write_bytes(b"x" * size)
    with pytest.raises(ConfigError, match=f"not {size}; make one with"):
        load_swarm_key(path)


def test_key_written_private_once_and_read_back(tmp_path: Path) -> None:
    path = tmp_path / "key"
    key = SwarmKey.generate()
    key.write(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert load_swarm_key(path) == key and len(path.read_bytes()) == 32
    with pytest.raises(ConfigError, match="cannot create swarm key file"):
        SwarmKey.generate().write(path)
    assert load_swarm_key(path) == key
    with pytest.raises(ConfigError, match="cannot read swarm key file"):
        load_swarm_key(tmp_path / "missing")


@pytest.mark.parametrize(
    ("key_id", "key", "match"),
    [
        (KEY.key_id, None, "is a closed swarm .* join it with --swarm-key"),
        (KEY.key_id, OTHER_KEY, f"your swarm key \\(id {OTHER_KEY.key_id}\\) is not the key"),
        (None, KEY, "is an open swarm; drop --swarm-key"),
    ],
)
def test_joiner_told_what_is_wrong_with_its_key(
    key_id: str | None, key: SwarmKey | None, match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        check_swarm_key(RUN, key_id, key)


def test_matching_key_or_open_swarm_accepted() -> None:
    check_swarm_key(RUN, KEY.key_id, KEY)
    check_swarm_key(RUN, None, None)


# --- proofs ------------------------------------------------------------------------------------


def test_stream_proofs_are_the_documented_hmacs_bound_to_everything() -> None:
    closed = ClosedSwarm(KEY, DIGEST)
    a, b = "peerA", "peerB"
    opener = closed.stream_proof("open", HANDLER, a, b)
    assert opener == _mac(KEY.secret, "diloco-auth/1", "open", DIGEST, HANDLER, a, b)
    answer = closed.stream_proof("answer", HANDLER, a, b)
    assert answer == _mac(KEY.secret, "diloco-auth/1", "answer", DIGEST, HANDLER, a, b)
    others = {
        answer,
        closed.stream_proof("open", HANDLER, b, a),
        closed.stream_proof("open", HANDLER + "x", a, b),
        ClosedSwarm(OTHER_KEY, DIGEST).stream_proof("open", HANDLER, a, b),
        ClosedSwarm(KEY, bytes(16)).stream_proof("open", HANDLER, a, b),
    }
    assert opener not in others and len(others) == 5
    assert closed.check(opener, opener) and not closed.check(opener, answer)
    assert not closed.check(opener, opener.hex()) and not closed.check(opener, None)


def test_declaration_proof_is_the_documented_hmac() -> None:
    key = round_key(RUN, RoundKey(0, 3))
    proof = ClosedSwarm(KEY, DIGEST).declaration_proof(key, "peerA")
    assert proof == _mac(KEY.secret, "diloco-declaration/1", DIGEST, key, "peerA")


# --- the AUTH exchange over in-memory streams ------------------------------------------------


class _Echo:
    """A handler that answers one ACK per stream and counts the streams it served."""

    def __init__(self) -> None:
        self.served: list[PeerID] = []

    async def __call__(
        self, info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        _, body = await streams.read_frame(reader, (Kind.REPORT,))
        self.served.append(info.peer_id)
        await streams.write_frame(writer, Kind.ACK, bytes(body))
        writer.close()


async def _pair(server_key: SwarmKey, client: Any, echo: _Echo) -> tuple[MemoryP2P, MemoryP2P, Any]:
    network = MemoryNetwork()
    server, raw_client = network.join(make_peer_id(1)), network.join(make_peer_id(2))
    await ClosedTransport(server, ClosedSwarm(server_key, DIGEST), 5.0).add_binary_stream_handler(
        HANDLER, echo
    )
    transport = raw_client if client is None else ClosedTransport(raw_client, client, 5.0)
    return server, raw_client, transport


async def _request(transport: Any, server: MemoryP2P) -> bytes:
    _, reader, writer = await transport.call_binary_stream_handler(server.peer_id, HANDLER)
    try:
        await streams.write_frame(writer, Kind.REPORT, b"hello")
        kind, body = await streams.read_frame(reader, (Kind.ACK,))
        return bytes(body) if kind == Kind.ACK else b"REJECT " + bytes(body)
    finally:
        writer.close()


def test_members_exchange_proofs_and_talk() -> None:
    async def main() -> None:
        echo = _Echo()
        server, client, transport = await _pair(KEY, ClosedSwarm(KEY, DIGEST), echo)
        assert await _request(transport, server) == b"hello"
        assert echo.served == [client.peer_id]

    asyncio.run(main())


def test_opener_with_another_key_refused_and_logged_on_both_sides(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def main() -> tuple[PeerID, PeerID, list[PeerID]]:
        echo = _Echo()
        server, client, transport = await _pair(KEY, ClosedSwarm(OTHER_KEY, DIGEST), echo)
        with pytest.raises(NotMember, match="not a member of this closed swarm"):
            await _request(transport, server)
        await asyncio.sleep(0.05)
        return server.peer_id, client.peer_id, echo.served

    with caplog.at_level(logging.WARNING, logger="diloco.protocol.trust.swarm_key"):
        server, client, served = asyncio.run(main())
    assert served == []
    assert f"refused ECHO from {client}: not a member of this closed swarm" in caplog.text
    assert f"{server} refused ECHO from us: not a member of this closed swarm" in caplog.text
    assert issubclass(NotMember, streams.TRANSPORT_ERRORS)


def test_opener_without_key_gets_reject_and_no_service(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> tuple[bytes, PeerID, list[PeerID]]:
        echo = _Echo()
        server, client, transport = await _pair(KEY, None, echo)
        answer = await _request(transport, server)
        await asyncio.sleep(0.05)
        return answer, client.peer_id, echo.served

    with caplog.at_level(logging.WARNING, logger="diloco.protocol.trust.swarm_key"):
        answer, client, served = asyncio.run(main())
    assert served == []
    assert answer.startswith(b"REJECT ")
    reject = Reject.parse(answer[len(b"REJECT ") :])
    assert (
        reject.code == RejectCode.NOT_MEMBER
        and reject.reason == "not a member of this closed swarm"
    )
    assert f"refused ECHO from {client}" in caplog.text


class _HandlerStub:
    """A transport that only keeps the handlers added to it."""

    peer_id = make_peer_id(1)

    def __init__(self) -> None:
        self.handlers: dict[str, Any] = {}

    async def add_binary_stream_handler(self, name: str, handler: Any) -> None:
        self.handlers[name] = handler


def test_refused_stream_closes_only_once_the_opener_closed() -> None:
    """p2pd may turn our close into a reset that drops the opener's unread bytes, the
    REJECT: a refused stream stays open until the opener has read it and closed (an
    outsider of a closed swarm once got an empty stream for its JOIN)."""

    async def main() -> None:
        stub, echo = _HandlerStub(), _Echo()
        closed = ClosedTransport(stub, ClosedSwarm(KEY, DIGEST), 30.0)  # type: ignore[arg-type]
        await closed.add_binary_stream_handler(HANDLER, echo)
        (reader, writer), (their_reader, their_writer) = await stream_pair()
        info = StreamInfo(make_peer_id(2), Multiaddr("/ip4/127.0.0.1/tcp/1"), HANDLER)
        handling = asyncio.create_task(stub.handlers[HANDLER](info, their_reader, their_writer))
        await streams.write_frame(writer, Kind.JOIN, b"no AUTH first")  # a node without the key
        kind, body = await streams.read_frame(reader, (Kind.AUTH,))
        assert kind == Kind.REJECT and Reject.parse(body).code == RejectCode.NOT_MEMBER
        for _ in range(20):  # the handler gets every chance to close early
            await asyncio.sleep(0)
        assert not handling.done()
        writer.close()
        await asyncio.wait_for(handling, 5.0)
        assert await reader.read() == b"" and echo.served == []

    asyncio.run(main())


def test_responder_without_key_found_out_before_the_request_is_sent(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A responder that takes any proof and answers with a made-up one (it has no key)."""

    async def main() -> tuple[PeerID, list[bytes]]:
        network = MemoryNetwork()
        impostor, client = network.join(make_peer_id(1)), network.join(make_peer_id(2))
        received: list[bytes] = []

        async def accept_anything(
            info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
        ) -> None:
            await streams.read_frame(reader, (Kind.AUTH,))
            await streams.write_frame(writer, Kind.AUTH, bytes(32))
            received.append(await reader.read())  # all the opener sends after AUTH

        await impostor.add_binary_stream_handler(HANDLER, accept_anything)
        transport = ClosedTransport(client, ClosedSwarm(KEY, DIGEST), 5.0)
        with pytest.raises(NotMember, match="is not a member of this closed swarm"):
            await _request(transport, impostor)
        await asyncio.sleep(0.05)
        return impostor.peer_id, received

    with caplog.at_level(logging.WARNING, logger="diloco.protocol.trust.swarm_key"):
        impostor, received = asyncio.run(main())
    assert received == [b""]  # the request never left the opener
    assert f"{impostor} is not a member of this closed swarm" in caplog.text


# --- declarations ------------------------------------------------------------------------------


def test_closed_swarm_view_drops_declarations_without_a_valid_proof() -> None:
    member, other_member, outsider, replayer, wrong_round = (Identity.generate() for _ in range(5))
    closed = ClosedSwarm(KEY, DIGEST)
    key = round_key(RUN, RoundKey(2, 5))

    def declared(identity: Identity, proof: bytes | None, weight: float = 1.0) -> Any:
        value: object = weight if proof is None else [weight, proof]
        return _entry(identity, key, pack_payload(value))

    dht = _StubDHT(
        {
            key: {
                member.peer_id: declared(member, closed.declaration_proof(key, member.peer_id)),
                other_member.peer_id: declared(
                    other_member, closed.declaration_proof(key, other_member.peer_id), 2.0
                ),
                outsider.peer_id: declared(outsider, None),
                replayer.peer_id: declared(replayer, closed.declaration_proof(key, member.peer_id)),
                wrong_round.peer_id: declared(
                    wrong_round,
                    closed.declaration_proof(round_key(RUN, RoundKey(2, 6)), wrong_round.peer_id),
                ),
            }
        }
    )
    closed_view = asyncio.run(read_declarations(dht, key, closed))  # type: ignore[arg-type]
    assert {p.to_base58(): w for p, w in closed_view.items()} == {
        member.peer_id: 1.0,
        other_member.peer_id: 2.0,
    }
    open_view = asyncio.run(read_declarations(dht, key))  # type: ignore[arg-type]
    assert len(open_view) == 5
