"""``AllReduceRunner`` under faults, M members in one process over in-memory streams.

The runners, routers and stream handlers are the production ones; only the transport is
``memory_p2p`` (socketpairs instead of p2pd). Expected values come from
``InProcessReducer``, which shares no stream code with the runner.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import numpy as np
import pytest
import torch
from faults import (
    GARBAGE,
    CutPartStreams,
    Fault,
    Injected,
    LyingReporter,
    Member,
    corrupt_sender,
)
from inprocess import (
    KEY,
    TIMEOUTS,
    Outcome,
    Round,
    delta_of,
    deltas,
    expected,
    member_id,
    names,
    run_round,
)

from diloco.codecs import get_codec
from diloco.errors import RoundFailed
from diloco.protocol.allreduce.member import AllReduceRunner
from diloco.protocol.allreduce.part_server import PartServer
from diloco.protocol.core.aggregation import CLIP_FACTOR, robust_mean
from diloco.protocol.core.partition import butterfly_parts
from diloco.protocol.core.reducer import Contribution, InProcessReducer
from diloco.protocol.core.round import CHUNK_VALUES, chunk_spans
from diloco.protocol.trust.bans import BAN_OFFENCES, BanList

pytestmark = pytest.mark.clocked


def _without(
    inputs: Sequence[torch.Tensor], weights: Sequence[float], left_out: int
) -> torch.Tensor:
    """What every member must get when ``left_out`` is counted only in its own part.

    Codec ``none``: each part is the combine step over the members it counts, chunk by
    chunk (clipping compares norms within a chunk of the group's parts).
    """
    result = torch.empty(inputs[0].numel())
    for j, (lo, hi) in enumerate(butterfly_parts(inputs[0].numel(), len(inputs))):
        counted = [i for i in range(len(inputs)) if i != left_out or j == left_out]
        for a, b in chunk_spans(lo, hi):
            chunk = [inputs[i][a:b] for i in counted]
            result[a:b] = robust_mean(chunk, [weights[i] for i in counted], CLIP_FACTOR).mean
    return result


@pytest.mark.parametrize(
    ("codec", "numel"),
    [("none", 1_000), ("e3m0", 50_000), ("none/e3m0", 10_000), ("e3m0", 4 * CHUNK_VALUES + 999)],
)
def test_honest_round_every_member_gets_the_in_process_bytes(codec: str, numel: int) -> None:
    weights = [1.0, 2.0, 3.0, 4.5]
    inputs = deltas(numel, 4)
    outcomes, _ = run_round(inputs, weights, [AllReduceRunner] * 4, codec)
    want = expected(inputs, weights, codec)
    for outcome in outcomes:
        assert torch.equal(delta_of(outcome), want)
    assert all(o.members == names(4) for o in outcomes)  # type: ignore[union-attr]
    # each member's announced weight, as every member saw it (what a node witnessed)
    assert all(o.weights == dict(zip(names(4), weights, strict=True)) for o in outcomes)  # type: ignore[union-attr]


@pytest.mark.parametrize("codec", ["none", "e3m0"])
def test_client_reduces_nothing_and_every_member_gets_the_in_process_bytes(codec: str) -> None:
    """Member 1 is a client (nobody can open a PART stream to it: its handler is gone), yet
    its contribution counts and every member, itself included, gets the mean of all."""
    weights = [1.0, 2.0, 3.0]
    inputs = deltas(3 * CHUNK_VALUES // 2 + 999, 3)

    async def main() -> list[Outcome]:
        round_ = Round(inputs, weights, [AllReduceRunner] * 3, codec, clients=(False, True, False))
        await round_.start()
        client = round_.network.peers[round_.ids[1]]
        del client.handlers[round_.routers[1].transport.part]
        return await round_.outcomes()

    outcomes = asyncio.run(main())
    want = expected(inputs, weights, codec, clients=(False, True, False))
    for outcome in outcomes:
        assert torch.equal(delta_of(outcome), want)
        assert outcome.members == names(3)  # type: ignore[union-attr]


@pytest.mark.parametrize("fault", GARBAGE, ids=lambda f: f.value)
def test_bad_sender_excluded_others_complete(fault: Fault) -> None:
    weights = [1.0, 1.0, 2.0, 1.0]
    inputs = deltas(4_096, 4)
    bad = 1
    types: list[type[AllReduceRunner]] = [AllReduceRunner] * 4
    types[bad] = corrupt_sender(fault)
    outcomes, _ = run_round(inputs, weights, types)
    want = _without(inputs, weights, bad)
    good = [i for i in range(4) if i != bad]
    for i in good:
        assert torch.equal(delta_of(outcomes[i]), want)
        assert outcomes[i].members == names(4, left_out=bad)  # type: ignore[union-attr]
        counted = [w for j, w in enumerate(weights) if j != bad]
        assert outcomes[i].weights == dict(zip(names(4, left_out=bad), counted, strict=True))  # type: ignore[union-attr]
    assert isinstance(outcomes[bad], RoundFailed)


class _LateSender(AllReduceRunner):
    """Sends its contributions only once every other reducer closed its gather."""

    async def _exchange(self, j: int) -> None:
        others = [r for r in self.round.runners if r is not self]  # type: ignore[attr-defined]
        while not all(r.server.reducer.gather_closed for r in others):
            await asyncio.sleep(0.01)
        await super()._exchange(j)


def test_late_sender_not_counted_but_gets_the_same_average() -> None:
    weights = [1.0, 2.0, 1.0, 1.0]
    inputs = deltas(3_000, 4)
    late = 2
    types: list[type[AllReduceRunner]] = [AllReduceRunner] * 4
    types[late] = _LateSender
    outcomes, _ = run_round(inputs, weights, types)
    want = _without(inputs, weights, late)
    for outcome in outcomes:
        assert torch.equal(delta_of(outcome), want)
        assert outcome.members == names(4, left_out=late)  # type: ignore[union-attr]


def test_cut_part_streams_duplicate_chunks_skipped_round_completes() -> None:
    numel = 4 * 3 * CHUNK_VALUES  # three chunks per part: the cut comes after chunk 0
    inputs = deltas(numel, 4)
    types: list[type[AllReduceRunner]] = [AllReduceRunner] * 4
    types[2] = CutPartStreams
    outcomes, _ = run_round(inputs, [1.0] * 4, types, "e3m0")
    want = expected(inputs, [1.0] * 4, "e3m0")
    assert all(torch.equal(delta_of(o), want) for o in outcomes)


def run_rounds(
    rounds: int,
    inputs: Sequence[torch.Tensor],
    weights: Sequence[float],
    runner_types: Sequence[type[AllReduceRunner]],
    bans: Sequence[BanList],
) -> list[list[Outcome]]:
    """``rounds`` rounds of one group in a row, each member keeping its ``BanList``."""
    return [run_round(inputs, weights, runner_types, bans=bans)[0] for _ in range(rounds)]


def test_disagreeing_report_does_not_fail_the_round_for_the_majority(
    caplog: pytest.LogCaptureFixture,
) -> None:
    types: list[type[AllReduceRunner]] = [AllReduceRunner] * 4
    types[3] = LyingReporter
    inputs = deltas(2_000, 4)
    bans = [BanList() for _ in range(4)]
    with caplog.at_level(logging.WARNING, logger="diloco.protocol"):
        (outcomes,) = run_rounds(1, inputs, [1.0] * 4, types, bans)
    want = expected(inputs, [1.0] * 4)
    assert all(torch.equal(delta_of(o), want) for o in outcomes)
    liar = member_id(3)
    assert caplog.text.count(f"member 3 ({liar}) reported another result") == 3
    assert [b.banned(liar) for b in bans] == [False] * 4


def test_repeated_disagreeing_reports_ban_the_liar_then_it_is_not_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    types: list[type[AllReduceRunner]] = [AllReduceRunner] * 4
    types[3] = LyingReporter
    inputs, weights = deltas(2_000, 4), [1.0, 2.0, 1.0, 1.0]
    bans = [BanList() for _ in range(4)]
    liar = member_id(3)
    with caplog.at_level(logging.WARNING, logger="diloco.protocol"):
        before = run_rounds(BAN_OFFENCES, inputs, weights, types, bans)
    assert all(torch.equal(delta_of(o), expected(inputs, weights)) for r in before for o in r)
    assert [b.banned(liar) for b in bans] == [True, True, True, False]
    assert caplog.text.count(f"banning {liar} for") == 3
    # banned: its PART and REPORT streams are refused, so it counts only in its own part
    (after,) = run_rounds(1, inputs, weights, types, bans)
    want = _without(inputs, weights, 3)
    for outcome in after[:3]:
        assert torch.equal(delta_of(outcome), want)
        assert outcome.members == names(4, left_out=3)  # type: ignore[union-attr]


def _hand_mean(
    inputs: Sequence[torch.Tensor], weights: Sequence[float], cap: float, clip: float
) -> torch.Tensor:
    """The capped, clipped mean spelled out in FP64, part by part (one chunk each)."""
    numel = inputs[0].numel()
    capped = [min(w, cap) for w in weights]
    median = sorted(capped)[(len(capped) - 1) // 2]
    capped = [min(w, median) for w in capped]  # the median weight cap
    result = torch.empty(numel, dtype=torch.float64)
    for lo, hi in butterfly_parts(numel, len(inputs)):
        xs = [d[lo:hi].double() for d in inputs]
        norms = [float(x.norm()) for x in xs]
        ref = sorted(norms)[(len(norms) - 1) // 2]
        scales = [min(1.0, clip * ref / n) for n in norms]
        total = sum(capped)
        result[lo:hi] = sum(w * s * x for w, s, x in zip(capped, scales, xs, strict=True)) / total
    return result


@pytest.mark.parametrize(
    ("weight", "scale"), [(1e30, 1.0), (1.0, 50.0), (1e30, -50.0)], ids=["weight", "norm", "both"]
)
def test_inflated_member_gets_at_most_its_capped_clipped_share(weight: float, scale: float) -> None:
    cap, clip, numel = 2.0, 2.0, 4_096  # one chunk per part
    honest = deltas(numel, 4)[:3]
    hostile = honest[0] * scale + deltas(numel, 5)[4]  # under max_norm_ratio (100)
    inputs, weights = [*honest, hostile], [1.0, 1.0, 1.0, weight]

    async def main() -> list[Outcome]:
        round_ = Round(inputs, weights, [AllReduceRunner] * 4, max_weight=cap, clip_factor=clip)
        await round_.start()
        return await round_.outcomes()

    outcomes = asyncio.run(main())
    result = delta_of(outcomes[0])
    assert all(torch.equal(delta_of(o), result) for o in outcomes)
    reducer = InProcessReducer(get_codec("none"), max_weight=cap, clip_factor=clip)
    contributions = [
        Contribution(str(i), d, w) for i, d, w in zip("abcd", inputs, weights, strict=True)
    ]
    assert torch.equal(reducer.reduce(KEY, contributions).result().delta, result)
    assert torch.allclose(result.double(), _hand_mean(inputs, weights, cap, clip), rtol=1e-5)
    # The bound, per part: the hostile member moves the honest mean by at most its capped
    # weight share times (C * ref + the honest mean's norm).
    share = cap / (cap + 3.0)
    for lo, hi in butterfly_parts(numel, 4):
        honest_mean = sum(d[lo:hi].double() for d in honest) / 3
        ref = sorted(float(d[lo:hi].norm()) for d in inputs)[1]
        moved = float((result[lo:hi].double() - honest_mean).norm())
        assert moved <= share * (clip * ref + float(honest_mean.norm())) * (1 + 1e-6)


def _numpy_mean(inputs: Sequence[torch.Tensor], weights: Sequence[float]) -> np.ndarray:
    """The weighted mean in FP64 with numpy: shares no code with the protocol (the churn
    tests below turn clipping off to compare with it)."""
    xs = np.stack([x.numpy().astype(np.float64) for x in inputs])
    w = np.asarray(weights, dtype=np.float64)
    return (w[:, None] * xs).sum(axis=0) / w.sum()


def _survivors(n: int, *dead: int) -> list[int]:
    return [i for i in range(n) if i not in dead]


async def _kill(round_: Round, victim: int) -> None:
    round_.tasks[victim].cancel()
    round_.network.peers[round_.ids[victim]].kill()


@pytest.mark.parametrize("victim", [1, 3])  # 3: its substitute wraps around to member 0
def test_reducer_vanishing_after_matchmaking_is_rereduced_among_survivors(victim: int) -> None:
    inputs, weights = deltas(6_000, 4), [1.0, 2.0, 3.0, 1.5]
    alive = _survivors(4, victim)

    async def main() -> list[Outcome]:
        round_ = Round(
            inputs, weights, [AllReduceRunner] * 4, timeouts=TIMEOUTS.scaled(0.5), clip_factor=0
        )
        await round_.start()
        await _kill(round_, victim)  # before any of its tasks ran: nothing sent
        return await round_.outcomes(alive)

    outcomes = asyncio.run(main())
    want = _numpy_mean([inputs[i] for i in alive], [weights[i] for i in alive])
    first = delta_of(outcomes[0])
    assert np.allclose(first.numpy(), want, rtol=1e-6, atol=1e-9)
    for outcome in outcomes:
        assert torch.equal(delta_of(outcome), first)  # bit-identical on every survivor
        assert outcome.members == names(4, left_out=victim)  # type: ignore[union-attr]


class _DyingServer(PartServer):
    """Receives everyone's chunks, then its member dies before averaging them."""

    async def reduce(self) -> None:
        self.ready = asyncio.Event()
        while len(self.reducer.received) < self.plan.num_members - 1:
            await asyncio.sleep(0.01)
        self.ready.set()
        await asyncio.Event().wait()


_DYING_REDUCER = Injected(server=_DyingServer)


async def _kill_once_counted(round_: Round, victims: Sequence[int]) -> None:
    """Kill ``victims`` once each holds every other member's chunks and every other
    member's reducer holds theirs (they are counted in every other part)."""
    others = [r for i, r in enumerate(round_.runners) if i not in victims]
    servers = [round_.runners[v].server for v in victims]
    while not (
        all(getattr(s, "ready", None) is not None and s.ready.is_set() for s in servers)  # type: ignore[attr-defined]
        and all(v in r.server.reducer.received for r in others for v in victims)
    ):
        await asyncio.sleep(0.01)
    for victim in victims:
        await _kill(round_, victim)


def test_reducer_dying_mid_round_its_part_is_rereduced_among_survivors() -> None:
    inputs, weights, victim = deltas(5_000, 4), [1.0, 2.0, 1.0, 3.0], 2
    alive = _survivors(4, victim)

    async def main() -> list[Outcome]:
        types: list[Member] = [AllReduceRunner] * 4
        types[victim] = _DYING_REDUCER
        round_ = Round(inputs, weights, types, timeouts=TIMEOUTS.scaled(0.5), clip_factor=0)
        await round_.start()
        await _kill_once_counted(round_, [victim])
        return await round_.outcomes(alive)

    outcomes = asyncio.run(main())
    # its contributions were counted in the others' parts; its own part is the survivors'
    want = _numpy_mean(inputs, weights)
    lo, hi = butterfly_parts(5_000, 4)[victim]
    want[lo:hi] = _numpy_mean([inputs[i] for i in alive], [weights[i] for i in alive])[lo:hi]
    first = delta_of(outcomes[0])
    assert np.allclose(first.numpy(), want, rtol=1e-6, atol=1e-9)
    for outcome in outcomes:
        assert torch.equal(delta_of(outcome), first)
        assert outcome.members == names(4, left_out=victim)  # type: ignore[union-attr]


def test_reducer_and_its_substitute_dying_fail_the_round_for_every_survivor() -> None:
    victims = [0, 1]  # member 1 re-reduces part 0

    async def main() -> list[Outcome]:
        types: list[Member] = [AllReduceRunner] * 4
        for victim in victims:
            types[victim] = _DYING_REDUCER
        round_ = Round(deltas(5_000, 4), [1.0] * 4, types, timeouts=TIMEOUTS.scaled(0.5))
        await round_.start()
        await _kill_once_counted(round_, victims)
        return await round_.outcomes([2, 3])

    for outcome in asyncio.run(main()):
        assert isinstance(outcome, RoundFailed)
        assert outcome.reason == "parts [0] missing here"


class _StallingServer(PartServer):
    """Gathers everyone's chunks, never averages them, and gives up at the part deadline."""

    async def reduce(self) -> None:
        await asyncio.sleep(self.deadlines.part - asyncio.get_running_loop().time())
        self.reducer.fail("stalled")
        self._touch()


_STALLING_REDUCER = Injected(server=_StallingServer)


def test_stalled_reducer_part_rereduced_with_everyone_counted() -> None:
    inputs, weights, stalled = deltas(5_000, 4), [1.0, 2.0, 1.0, 3.0], 1
    types: list[Member] = [AllReduceRunner] * 4
    types[stalled] = _STALLING_REDUCER

    async def main() -> list[Outcome]:
        round_ = Round(inputs, weights, types, timeouts=TIMEOUTS.scaled(0.25), clip_factor=0)
        await round_.start()
        return await round_.outcomes()

    outcomes = asyncio.run(main())
    first = delta_of(outcomes[0])
    assert np.allclose(first.numpy(), _numpy_mean(inputs, weights), rtol=1e-6, atol=1e-9)
    assert torch.equal(first, expected(inputs, weights, clip_factor=0))
    for outcome in outcomes:  # the stalled member too: it sent its part to the substitute
        assert torch.equal(delta_of(outcome), first)
        assert outcome.members == names(4)  # type: ignore[union-attr]


def test_pair_whose_partner_vanishes_fails_the_round_no_group_of_one() -> None:
    async def main() -> list[Outcome]:
        round_ = Round(deltas(3_000, 2), [1.0, 1.0], [AllReduceRunner] * 2, timeouts=TIMEOUTS)
        await round_.start()
        await _kill(round_, 1)
        return await round_.outcomes([0])

    (outcome,) = asyncio.run(main())
    assert isinstance(outcome, RoundFailed)
    assert outcome.reason == "parts [1] missing here"
