"""Admission: the creator's list of peer ids, read from a file; streams of peers not admitted
are refused before anything else (over in-memory streams), and none is opened to them."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest
from memory_p2p import MemoryNetwork, make_peer_id
from test_swarm_key import DIGEST, HANDLER, KEY, _Echo, _request

from diloco.errors import ConfigError
from diloco.protocol.runtime import streams
from diloco.protocol.trust.admission import (
    MAX_ADMITTED,
    AdmittedTransport,
    check_admitted,
    read_admitted,
)
from diloco.protocol.trust.identity import Identity
from diloco.protocol.trust.swarm_key import ClosedSwarm, ClosedTransport, NotMember

pytestmark = pytest.mark.clocked

A, B = sorted(Identity.generate().peer_id for _ in range(2))


def test_admission_file_with_comments_blank_lines_and_repeats(tmp_path: Path) -> None:
    path = tmp_path / "admit"
    path.write_text(f"# members of run x\n\n{B}  # bob\n   {A}\n{B}\n")
    assert read_admitted(path) == (A, B)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("# nobody\n", "names no peer id"),
        (f"{A}\nQmNotAPeerId\n", "line 2: 'QmNotAPeerId' is not a peer id"),
        (f"{A} {B}\n", "line 1: .* is not a peer id"),
    ],
    ids=["comments only", "bad second line", "two ids on a line"],  # A, B: fresh keys
)
def test_a_bad_admission_file_names_its_line(tmp_path: Path, text: str, match: str) -> None:
    path = tmp_path / "admit"
    path.write_text(text)
    with pytest.raises(ConfigError, match=match):
        read_admitted(path)


def test_too_many_or_a_missing_admission_file(tmp_path: Path) -> None:
    path = tmp_path / "admit"
    path.write_text("".join(Identity.generate().peer_id + "\n" for _ in range(MAX_ADMITTED + 1)))
    with pytest.raises(ConfigError, match=f"at most {MAX_ADMITTED} peer ids"):
        read_admitted(path)
    with pytest.raises(ConfigError, match="cannot read admission file"):
        read_admitted(tmp_path / "missing")


def test_a_node_not_admitted_is_told_its_peer_id() -> None:
    check_admitted("r-0123456789abcdef", None, A)
    check_admitted("r-0123456789abcdef", {A}, A)
    with pytest.raises(ConfigError, match=f"this node \\(peer {B}\\) is not admitted to run r-"):
        check_admitted("r-0123456789abcdef", {A}, B)


def test_a_peer_not_admitted_gets_a_reject_and_no_service_even_with_the_key(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def main() -> tuple[list[bytes], list[object], str]:
        network = MemoryNetwork()
        server = network.join(make_peer_id(1))
        member, stranger = network.join(make_peer_id(2)), network.join(make_peer_id(3))
        admitted = {server.peer_id.to_base58(), member.peer_id.to_base58()}
        closed = ClosedSwarm(KEY, DIGEST)
        echo = _Echo()
        guarded = ClosedTransport(AdmittedTransport(server, admitted), closed, 5.0)
        await guarded.add_binary_stream_handler(HANDLER, echo)
        answers = [await _request(ClosedTransport(member, closed, 5.0), server)]
        for _ in range(2):  # the stranger holds the key (a leaked one): refused anyway
            with pytest.raises(NotMember, match="refused ECHO: not admitted to this run"):
                await _request(ClosedTransport(stranger, closed, 5.0), server)
        # a node opens no stream to a peer that is not admitted (nothing reaches it)
        own = AdmittedTransport(server, admitted)
        with pytest.raises(NotMember, match="not admitted to this run"):
            await own.call_binary_stream_handler(stranger.peer_id, HANDLER)
        return answers, list(echo.served), stranger.peer_id.to_base58()

    with caplog.at_level(logging.WARNING, logger="diloco.protocol.trust.admission"):
        answers, served, stranger = asyncio.run(main())
    assert answers == [b"hello"] and len(served) == 1
    line = f"refused ECHO from {stranger}: not admitted to this run"
    assert caplog.text.count(line) == 1, caplog.text
    assert issubclass(NotMember, streams.TRANSPORT_ERRORS)


def test_an_open_swarm_with_admission_refuses_strangers_too() -> None:
    async def main() -> tuple[bytes, list[object]]:
        network = MemoryNetwork()
        server, stranger = network.join(make_peer_id(1)), network.join(make_peer_id(3))
        echo = _Echo()
        transport = AdmittedTransport(server, {server.peer_id.to_base58()})
        await transport.add_binary_stream_handler(HANDLER, echo)
        return await _request(stranger, server), list(echo.served)

    answer, served = asyncio.run(main())
    assert answer.startswith(b"REJECT ") and b"not admitted to this run" in answer
    assert served == []
