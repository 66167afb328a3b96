"""``offload``: a round's small CPU work runs on the event loop, large work in the executor."""

from __future__ import annotations

import asyncio
import threading
from typing import ClassVar

import pytest
import torch
from faults import Injected
from inprocess import Round, deltas

from diloco.protocol.allreduce.member import AllReduceRunner
from diloco.protocol.allreduce.part_server import PartServer
from diloco.protocol.core.reducer import RoundResult
from diloco.protocol.runtime.offload import INLINE_VALUES, offload
from diloco.protocol.wire.part import Averaged

pytestmark = pytest.mark.clocked


def _thread() -> int:
    return threading.get_ident()


def test_small_work_runs_on_the_loop_thread_and_large_work_off_it() -> None:
    async def main() -> tuple[int, int, int]:
        small = await offload(INLINE_VALUES, _thread)
        large = await offload(INLINE_VALUES + 1, _thread)
        return threading.get_ident(), small, large

    loop_thread, small, large = asyncio.run(main())
    assert small == loop_thread
    assert large != loop_thread


def test_small_work_still_lets_other_tasks_run_before_it_returns() -> None:
    """A hop to the executor let the loop run other tasks; inline work keeps that point."""
    order: list[str] = []

    async def other() -> None:
        order.append("other")

    async def main() -> None:
        task = asyncio.create_task(other())
        await offload(10, order.append, "work")
        order.append("after")
        await task

    asyncio.run(main())
    assert order == ["work", "other", "after"]


def test_errors_of_inline_and_executor_work_reach_the_caller() -> None:
    def fail() -> None:
        raise ValueError("bad chunk")

    async def main(values: int) -> None:
        await offload(values, fail)

    for values in (0, INLINE_VALUES + 1):
        with pytest.raises(ValueError, match="bad chunk"):
            asyncio.run(main(values))


class _Seen:
    """Threads the codec work of a round ran on, by what it was."""

    threads: ClassVar[dict[str, set[int]]] = {}

    @classmethod
    def note(cls, what: str) -> None:
        cls.threads.setdefault(what, set()).add(threading.get_ident())


class _WatchedServer(PartServer):
    def average_chunk(self, c: int, own: torch.Tensor) -> tuple[Averaged, torch.Tensor, list[int]]:
        _Seen.note("average")
        return super().average_chunk(c, own)


class _WatchedRunner(AllReduceRunner):
    def _own_chunk(self, c: int) -> torch.Tensor:
        _Seen.note("own chunk")
        return super()._own_chunk(c)

    def _part_frame(self, j: int, c: int) -> tuple[bytes, bytes]:
        _Seen.note("part frame")
        return super()._part_frame(j, c)


def _codec_threads(numel: int) -> tuple[int, dict[str, set[int]]]:
    """The loop's thread and the threads of the codec work of a verified 2-member E3M0
    round of ``numel`` values (parts of half as many)."""
    _Seen.threads = {}
    inputs = deltas(numel, 2)

    async def main() -> int:
        member = Injected(runner=_WatchedRunner, server=_WatchedServer)
        round_ = Round(inputs, [1.0, 2.0], [member] * 2, "e3m0")
        await round_.start()
        for outcome in await round_.outcomes():
            assert isinstance(outcome, RoundResult), outcome
        return threading.get_ident()

    return asyncio.run(main()), _Seen.threads


def test_a_round_of_small_parts_encodes_and_averages_on_the_loop() -> None:
    loop_thread, threads = _codec_threads(2 * 4_096)
    assert set(threads) == {"own chunk", "part frame", "average"}
    assert all(seen == {loop_thread} for seen in threads.values()), threads


def test_a_round_of_large_parts_encodes_and_averages_in_the_executor() -> None:
    loop_thread, threads = _codec_threads(2 * (INLINE_VALUES + 256))
    assert set(threads) == {"own chunk", "part frame", "average"}
    assert all(loop_thread not in seen for seen in threads.values()), threads
