"""The verification phase in process: members check each other's parts over in-memory
streams, with the production runners, routers and handlers (``inprocess``).

Liars are subclasses: a reducer-side ``PartServer`` that scales or edits its average, or
misreports a norm, and signs it (the same bytes go to everyone, so the REPORT digests
agree); a runner that lies in its answers to checks; members that stay silent.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence

import pytest
import torch
from faults import LYING_REDUCER, Injected, Member, ScalingServer
from hivemind.p2p import PeerID
from inprocess import delta_of, deltas, expected, member_id, names, run_round

from diloco.errors import RoundFailed
from diloco.protocol.allreduce.member import AllReduceRunner
from diloco.protocol.allreduce.part_server import PartServer
from diloco.protocol.core.reducer import RoundResult
from diloco.protocol.trust.round_signatures import sign_check
from diloco.protocol.wire.check import CheckRequest, CheckResponse
from diloco.protocol.wire.frames import Reject, RejectCode
from diloco.protocol.wire.part import Averaged

pytestmark = pytest.mark.clocked

NUMEL = 4 * 16 * 256  # four parts of 16 blocks
WEIGHTS = [1.0, 2.0, 3.0, 1.5]
LIAR = 1


class _OneBlockServer(ScalingServer):
    factor = 4.0
    blocks = (5,)


_ONE_BLOCK_REDUCER = Injected(server=_OneBlockServer)


class _NormServer(PartServer):
    """Averages honestly but reports member 3's chunk norm doubled (and seals that)."""

    def average_chunk(self, c: int, own: torch.Tensor) -> tuple[Averaged, torch.Tensor, list[int]]:
        msg, mean, clipped = self.reducer.average(c, own)
        norms = list(msg.norms)
        norms[3] *= 2
        return dataclasses.replace(msg, norms=tuple(norms)), mean, clipped


_NORM_REDUCER = Injected(server=_NormServer)


class _LyingAnswers(AllReduceRunner):
    """Answers checks about the parts it sent to others with doubled values (signed)."""

    async def answer_check(self, sender: PeerID, request: CheckRequest) -> Reject | bytes:
        answer = await super().answer_check(sender, request)
        if isinstance(answer, Reject):
            return answer
        msg = CheckResponse.parse(answer)
        values, pieces = self.plan.codec.decode(msg.payload), []
        sizes = [len(blocks) * 256 for _, blocks in request.parts]  # whole blocks here
        for (j, _), piece in zip(request.parts, values.split(sizes), strict=True):
            pieces.append(piece if j == self.index else piece * 2)
        payload = self.plan.codec.encode(torch.cat(pieces))
        assert self.identity is not None
        return sign_check(self.identity, dataclasses.replace(msg, payload=payload)).serialize()


class _Silent(AllReduceRunner):
    """Answers no check."""

    async def answer_check(self, sender: PeerID, request: CheckRequest) -> Reject | bytes:
        return Reject(RejectCode.MISMATCH, reason="test fault: silent")


class _CountingAnswers(AllReduceRunner):
    """Honest; counts the checks it answered."""

    async def answer_check(self, sender: PeerID, request: CheckRequest) -> Reject | bytes:
        answer = await super().answer_check(sender, request)
        self.__dict__.setdefault("answered", []).append(sorted(p for p, _ in request.parts))
        return answer


def _with(liar: Member, base: type[AllReduceRunner] = AllReduceRunner) -> list[Member]:
    types: list[Member] = [base] * 4
    types[LIAR] = liar
    return types


def _fails_naming(outcome: object, reducer: int, part: int, why: str) -> None:
    assert isinstance(outcome, RoundFailed), outcome
    assert outcome.reason.startswith(f"reducer {names(4)[reducer]} of part {part} lied: ")
    assert why in outcome.reason, outcome.reason


def _honest(members: Sequence[int]) -> list[int]:
    return [i for i in members if i != LIAR]


def test_honest_round_checked_by_everyone_bytes_as_in_process() -> None:
    inputs = deltas(NUMEL, 4)
    outcomes, round_ = run_round(inputs, WEIGHTS, [_CountingAnswers] * 4, "e3m0")
    want = expected(inputs, WEIGHTS, "e3m0")
    assert all(torch.equal(delta_of(o), want) for o in outcomes)
    assert round_.offences == [[], [], [], []]
    for i, runner in enumerate(round_.runners):
        # each other member asked once, about the three parts it did not reduce itself,
        # each including this member's own part
        asked = runner.__dict__["answered"]
        assert len(asked) == 3 and all(len(parts) == 3 and i in parts for parts in asked)


def test_unchecked_round_for_measurements_gives_the_same_bytes() -> None:
    inputs = deltas(NUMEL, 4)
    outcomes, round_ = run_round(inputs, WEIGHTS, [AllReduceRunner] * 4, "e3m0", verify=False)
    assert all(torch.equal(delta_of(o), expected(inputs, WEIGHTS, "e3m0")) for o in outcomes)
    assert all(runner.own is None for runner in round_.runners)


def test_reducer_sending_minus_30_times_the_mean_fails_the_round_for_every_honest_member() -> None:
    outcomes, round_ = run_round(deltas(NUMEL, 4), WEIGHTS, _with(LYING_REDUCER), "e3m0")
    for i in _honest(range(4)):
        _fails_naming(outcomes[i], LIAR, LIAR, "is not the average of the signed chunks")
        assert [who for who, _ in round_.offences[i]] == [LIAR]
        assert round_.bans[i].banned(member_id(LIAR))  # a proven lie bans at once
    # the liar checked the honest parts and found nothing: it alone applies its lie
    assert isinstance(outcomes[LIAR], RoundResult) and round_.offences[LIAR] == []


class _AllBlocks(AllReduceRunner):
    samples = 64


class _TwoBlocks(AllReduceRunner):
    """Checks two blocks of each part; its seeded draw misses block 5 of part 1."""

    samples = 2
    rng = random.Random(0)


def test_reducer_lying_on_one_block_caught_by_members_that_sample_it() -> None:
    assert 5 not in random.Random(0).sample(range(16), 2)
    types = _with(_ONE_BLOCK_REDUCER, base=_AllBlocks)
    types[3] = _TwoBlocks
    inputs = deltas(NUMEL, 4)
    outcomes, round_ = run_round(inputs, WEIGHTS, types, "e3m0")
    for i in (0, 2):
        _fails_naming(outcomes[i], LIAR, LIAR, "block 5 is not the average of the signed chunks")
    # (1 - f) ** s: the member that looked at 2 of 16 blocks did not see the lie, and applies
    # it; state hashes heal the minority later
    lied = delta_of(outcomes[3])
    honest = expected(inputs, WEIGHTS, "e3m0")
    different = (lied != honest).nonzero().flatten()
    lo = 1 * 16 * 256
    assert different.numel() > 0 and bool(
        ((different >= lo + 5 * 256) & (different < lo + 1536)).all()
    )
    assert round_.offences[3] == []


def test_reducer_misreporting_a_norm_fails_the_round_for_every_honest_member() -> None:
    outcomes, round_ = run_round(deltas(NUMEL, 4), WEIGHTS, _with(_NORM_REDUCER), "e3m0")
    for i in _honest(range(4)):
        _fails_naming(outcomes[i], LIAR, LIAR, "of member 3's chunk 0")
        assert [who for who, _ in round_.offences[i]] == [LIAR]


def test_sender_lying_in_its_answers_named_and_the_round_stands() -> None:
    inputs = deltas(NUMEL, 4)
    outcomes, round_ = run_round(inputs, WEIGHTS, _with(_LyingAnswers), "e3m0")
    want = expected(inputs, WEIGHTS, "e3m0")
    for i in _honest(range(4)):
        assert torch.equal(delta_of(outcomes[i]), want)
        # every part it sent to another reducer was disputed, and judged fine
        offenders = {who for who, _ in round_.offences[i]}
        assert offenders == {LIAR}
        assert all("is not what it signed" in what for _, what in round_.offences[i])


def test_silent_member_convicted_as_reducer_its_contributions_judged_from_evidence() -> None:
    outcomes, round_ = run_round(deltas(NUMEL, 4), WEIGHTS, _with(_Silent), "e3m0")
    # Its own values in its part are known to nobody else: that part is not accepted. Its
    # contributions to the other parts come from their reducers' evidence: no one else is
    # convicted.
    for i in _honest(range(4)):
        _fails_naming(outcomes[i], LIAR, LIAR, "it did not answer the check")
        assert [who for who, _ in round_.offences[i]] == [LIAR]
        assert not round_.bans[i].banned(member_id(LIAR))  # silence: an offence, no ban
