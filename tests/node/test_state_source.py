"""The node's swarm as healing's state source (``node/swarm/state_source.py``)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import pytest

from diloco.node.swarm import state_source
from diloco.node.swarm.state_source import SwarmStateSource
from diloco.protocol.records.nodes import NodeRecord, Vouch

RECORD = NodeRecord("peer", (), 7, (), 0.0, "0")


class RecordsAfterVouches:
    """A swarm whose records read ends only once a vouch read has begun: reads made one
    after the other never end (the wait times out)."""

    dht, run_id = None, "run"

    def __init__(self) -> None:
        self.vouching = asyncio.Event()

    async def read_records_on_loop(self) -> list[NodeRecord]:
        await asyncio.wait_for(self.vouching.wait(), 5.0)
        return [RECORD]

    def call(self, coroutine: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run(coroutine)


def test_read_swarm_reads_records_and_vouches_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    swarm = RecordsAfterVouches()

    async def read_vouches(dht: object, run_id: str, fragment: int) -> list[Vouch]:
        swarm.vouching.set()
        return [Vouch("peer", fragment, 1, "ab" * 32, ("peer",))]

    monkeypatch.setattr(state_source, "read_vouches", read_vouches)
    records, vouches = SwarmStateSource(swarm).read_swarm([0, 2])  # type: ignore[arg-type]
    assert records == [RECORD]
    assert [v.fragment for v in vouches] == [0, 2]
