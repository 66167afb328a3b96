"""The dashboard's HTTP endpoints on a hand-filled view (no swarm)."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from diloco.node.dashboard.server import DashboardServer
from diloco.node.dashboard.view import SwarmView
from diloco.protocol.records.metrics import LossPoint, MetricsRecord
from diloco.protocol.records.nodes import FragmentVersion, NodeRecord

PEER = "12D3KooWAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"
HOSTILE = "</script><script>alert(1)</script>"


@pytest.fixture
def server() -> Iterator[DashboardServer]:
    view = SwarmView()
    view.set_run("r-0123456789abcdef", {"name": "r"}, None)
    record = NodeRecord(PEER, (), 7, (FragmentVersion(0, 1, "ab" * 32),), 12.0, HOSTILE)
    metrics = MetricsRecord(7, 448, 0.5, 10, 10, 0, 0, (LossPoint(5, 4.5),), (), ())
    view.update([record], {PEER: metrics}, time.time())
    server = DashboardServer(view, "127.0.0.1", 0)
    server.start()
    yield server
    server.close()


def _get(url: str) -> tuple[int, dict[str, str], str]:
    try:
        with urllib.request.urlopen(url) as response:
            return response.status, dict(response.headers), response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read().decode()


def test_api_endpoints_return_the_view(server: DashboardServer) -> None:
    status, headers, body = _get(server.url + "api/state")
    assert status == 200 and headers["Content-Type"] == "application/json"
    state = json.loads(body)
    assert set(state) == {"run", "peers", "loss", "rounds", "fragments", "totals"}
    (peer,) = state["peers"]
    assert (peer["peer_id"], peer["step"], peer["alive"], peer["loss"]) == (PEER, 7, True, 4.5)
    _, _, peers = _get(server.url + "api/peers")
    assert [p["tokens"] for p in json.loads(peers)] == [448]
    _, _, loss = _get(server.url + "api/loss")
    assert json.loads(loss)["train"] == [{"peer_id": PEER, "points": [[5, 4.5]]}]
    status, _, body = _get(server.url + "api/nothing")
    assert status == 404 and "no such endpoint" in body


def test_page_embeds_state_without_letting_peer_strings_end_the_script(
    server: DashboardServer,
) -> None:
    status, headers, page = _get(server.url)
    assert status == 200 and "default-src 'self'" in headers["Content-Security-Policy"]
    assert HOSTILE not in page and "<!--STATE-->" not in page
    start = page.index('id="initial-state">') + len('id="initial-state">')
    embedded = json.loads(page[start : page.index("</script>", start)])
    assert embedded["peers"][0]["software_version"] == HOSTILE
    status, headers, script = _get(server.url + "dashboard.js")
    assert status == 200 and headers["Content-Type"].startswith("text/javascript")
    assert "function render(" in script
    assert _get(server.url + "favicon.ico")[0] == 404
