"""The page of a finished run in headless Chromium (the DOM after the page's script ran),
from a hand-filled view: both nodes left at the last step, saying so, with their final
evaluations. (A live swarm's page, and its state after Ctrl-C: test_dashboard_swarm.py.)"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from diloco.node.dashboard.server import DashboardServer
from diloco.node.dashboard.view import SwarmView
from diloco.protocol.records.metrics import LossPoint, MetricsRecord
from diloco.protocol.records.nodes import NodeRecord

A = "12D3KooWDiMT3w2hov8UGYrTKrSPwDyq6P1HizfPSo82oWmnDv8T"
B = "12D3KooWQYhTNQdmr3ArTeUHRYzFg94BKyTkoWBDWez9kSCVe2Xo"


def _finished_view() -> SwarmView:
    view = SwarmView()
    view.set_run("seen-0123456789abcdef", {"name": "seen", "steps": 40}, None)
    base = MetricsRecord(40, 40 * 128, 0.9, 0, 0, 0, 0, (LossPoint(20, 5.0),), (), ())
    for now, step in ((1000.0, 20), (1010.0, 30)):  # training: the clock of the time axis
        records = [
            NodeRecord(p, (f"/ip4/127.0.0.2/tcp/1/p2p/{p}",), step, (), 9.0, "0") for p in (A, B)
        ]
        view.update(records, {A: base, B: base}, now)
    finals = {
        p: dataclasses.replace(
            base, evals=(LossPoint(40, loss),), device="cpu", precision="fp32", batch_size=4
        )
        for p, loss in ((A, 4.5), (B, 4.25))
    }
    finals = {p: dataclasses.replace(m, end="finished") for p, m in finals.items()}
    records = [NodeRecord(p, (), 40, (), 9.0, "0") for p in (A, B)]
    view.update(records, finals, 1020.0)
    return view


def test_a_finished_run_shows_its_end_and_final_loss_in_the_browser(tmp_path: Path) -> None:
    chromium = shutil.which("chromium")
    if chromium is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is missing in CI: .ci/run should have installed it")
        pytest.skip("chromium is not installed (.ci/run installs it)")
    server = DashboardServer(_finished_view(), "127.0.0.1", 0)
    server.start()
    try:
        result = subprocess.run(
            [
                *(chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run"),
                *("--disable-background-networking", "--disable-component-update"),
                *("--virtual-time-budget=2000", f"--user-data-dir={tmp_path / 'profile'}"),
                *("--dump-dom", server.url),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        server.close()
    dom = result.stdout
    assert result.returncode == 0 and "</html>" in dom, result.stderr[-2000:]
    assert '<span id="run-state" class="state finished">finished</span>' in dom
    progress = "step 40 / 40 (100%) · final held-out loss 4.3750 at step 40"
    assert f'<span id="progress">{progress}</span>' in dom
    assert '<div class="value">0 / 2 seen</div>' in dom  # nobody counted alive any more
    assert '<p id="join" hidden="">' in dom
    peers = dom[dom.index('<table id="peers">') : dom.index("</table>")]
    for peer, loss in ((A, "4.5000"), (B, "4.2500")):
        row = peers[peers.index(f'data-peer="{peer}"') :]
        row = row[: row.index("</tr>")]
        assert f">{peer[-8:]}<" in row and f">{peer}<" not in row
        for text in ("finished", "cpu · fp32 · 4", loss):
            assert f">{text}</td>" in row, (text, row)
    assert 'class="time-tick"' in dom
