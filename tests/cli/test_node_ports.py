"""A ``--listen`` port that another process listens on is refused before a node starts.

The other listener is a real socket bound as p2pd binds (SO_REUSEADDR and SO_REUSEPORT),
so a second p2pd could share its port without an error of its own. ``_run_node`` is swapped
for a recorder: a refused command line is one that never reached it.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import pytest
from click.testing import CliRunner

from diloco.cli import main
from diloco.cli import node as cli_node
from diloco.protocol.trust.identity import Identity


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    calls: list[tuple[Any, ...]] = []
    monkeypatch.setattr(cli_node, "_run_node", lambda *args, **kwargs: calls.append(args))
    return calls


@pytest.fixture
def listening() -> Iterator[int]:
    """A port some process listens on, as a first node's p2pd does."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as first:
        first.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        first.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        first.bind(("127.0.0.1", 0))
        first.listen()
        yield first.getsockname()[1]


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0"])
def test_a_port_in_use_exits_2_before_the_node_starts(
    started: list[tuple[Any, ...]], listening: int, host: str
) -> None:
    addr = f"/ip4/{host}/tcp/{listening}"
    for command in (
        ["start"],
        ["join", "--initial-peers", f"/ip4/127.0.0.1/tcp/1/p2p/{Identity.generate().peer_id}"],
    ):
        result = CliRunner().invoke(main, [*command, "--listen", addr])
        assert result.exit_code == 2 and not started, result.output
        (line,) = [x for x in result.output.splitlines() if x.startswith("Error: ")]
        assert line == (
            f"Error: --listen {addr}: port {listening} is in use (another node?); choose "
            "another port, or tcp/0 for any free one"
        )


def test_a_free_port_and_port_0_start(started: list[tuple[Any, ...]]) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]
    for addr in (f"/ip4/127.0.0.1/tcp/{free}", "/ip4/127.0.0.1/tcp/0"):
        assert CliRunner().invoke(main, ["start", "--listen", addr]).exit_code == 0
    assert len(started) == 2
