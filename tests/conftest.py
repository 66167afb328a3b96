"""Suite-wide settings and the tier rule.

One torch thread per process: the suite runs several processes at once (swarm peers) on
two cores, and OpenMP worker threads spinning on oversubscribed cores slow every step many
times over.

The tier rule: a test that starts a p2pd daemon, a DHT (its own process), or a peer
process (``diloco-node``, its module, a peer script of the tests, or anything forked by
``diloco.bench.launcher``) must be marked ``swarm``, so ``pytest -m "not swarm"`` stays the
fast, in-process tier. Short helper processes (``python -c``, the netns tool) are not
peers. The guard below fails an unmarked test that does, naming what it started.

``scripts/test.sh`` runs the swarm tests by folder (its lanes: what trains a model, what
does not); a swarm test outside ``SWARM_FOLDERS`` would run in none of them, so collecting
one is an error.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hivemind import DHT
from hivemind.p2p import P2P

from diloco.bench.launcher import Child, Launcher

torch.set_num_threads(1)

PEER_PROGRAMS = ("diloco-node", "swarm_peers.py", "hostile_peer.py", "hostile_claims.py")
SWARM_FOLDERS = ("bench", "cli", "node", "protocol")
"""The folders of ``tests`` whose swarm tests ``scripts/test.sh`` runs."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    lanes = [Path(__file__).parent / folder for folder in SWARM_FOLDERS]
    strays = [
        item.nodeid
        for item in items
        if item.get_closest_marker("swarm") is not None
        and not any(item.path.is_relative_to(folder) for folder in lanes)
    ]
    if strays:
        raise pytest.UsageError(f"swarm tests outside {SWARM_FOLDERS} run in no lane: {strays}")


@pytest.fixture(autouse=True)
def _tier_guard(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    if request.node.get_closest_marker("swarm") is not None:
        yield
        return
    started: list[str] = []
    dht_init = DHT.__init__
    p2p_create = P2P.create.__func__  # type: ignore[attr-defined]
    popen_init = subprocess.Popen.__init__
    launcher_start = Launcher.start

    def dht(self: DHT, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("start", False):
            started.append("a DHT process")
        dht_init(self, *args, **kwargs)

    async def p2p(cls: type[P2P], *args: Any, **kwargs: Any) -> P2P:
        started.append("a p2pd daemon")
        return await p2p_create(cls, *args, **kwargs)

    def popen(self: subprocess.Popen[Any], args: Any, *rest: Any, **kwargs: Any) -> None:
        argv = [str(a) for a in (args if isinstance(args, (list, tuple)) else [args])]
        if any(a.endswith(PEER_PROGRAMS) or a in ("diloco", "diloco.cli") for a in argv):
            started.append(f"a process {' '.join(argv[:3])}")
        popen_init(self, args, *rest, **kwargs)

    def fork(self: Launcher, argv: list[str], *rest: Any, **kwargs: Any) -> Child:
        started.append(f"a forked process {' '.join(argv[:3])}")
        return launcher_start(self, argv, *rest, **kwargs)

    monkeypatch.setattr(DHT, "__init__", dht)
    monkeypatch.setattr(P2P, "create", classmethod(p2p))
    monkeypatch.setattr(subprocess.Popen, "__init__", popen)
    monkeypatch.setattr(Launcher, "start", fork)
    yield
    if started:
        pytest.fail(f"not marked swarm but starts {started[0]} (tier rule: tests/conftest.py)")
