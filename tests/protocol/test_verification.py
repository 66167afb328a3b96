"""Sampled checks of a reducer's part and the judgement of disputes, on hand-made inputs.

A part is reduced by ``PartReducer`` itself (the arithmetic under check), then checked from
members' answers built by ``OwnContribution`` and judged from the chunks the reducer kept.
Lies are made by hand: scaled or edited averaged values, edited answers, edited claims.
"""

from __future__ import annotations

import dataclasses
import random
import re
from dataclasses import dataclass

import pytest
import torch

from diloco.codecs import Codec, get_codec
from diloco.errors import ProtocolError
from diloco.protocol.core.norms import chunk_norm, num_blocks
from diloco.protocol.core.partition import butterfly_parts
from diloco.protocol.core.round import PartReducer, RoundPlan, chunk_spans
from diloco.protocol.core.verification import (
    Answer,
    Judgement,
    OwnContribution,
    PartClaims,
    Sample,
    block_span,
    check_part,
    chunk_of,
    close_block,
    expected_values,
    judge,
    own_answers,
    read_answers,
    sample_blocks,
    slices_alone,
    wanted_evidence,
)
from diloco.protocol.wire.frames import RoundTag

TAG = RoundTag(bytes(range(16)), 1, 7)
GID = b"v" * 16
NUMEL = 18 * 256 + 100  # parts of 1536, 1792 and 1380 values
CHUNK = 512  # two blocks per chunk
WEIGHTS = (1.0, 2.5, 3.0)
PART = 1  # reduced by member 1, checked by member 0
CLIP = 3.0
"""C of these scenarios: their honest inputs, independent draws, are not clipped at 3x."""


def _plan(index: int, codec: Codec, return_codec: Codec) -> RoundPlan:
    spans = tuple(butterfly_parts(NUMEL, len(WEIGHTS)))
    chunks = tuple(tuple(chunk_spans(lo, hi, CHUNK)) for lo, hi in spans)
    norms = tuple(tuple(1.0 for _ in part) for part in chunks)
    return RoundPlan(TAG, GID, index, WEIGHTS, spans, chunks, norms, codec, return_codec, 1e6, CLIP)


@dataclass
class Scenario:
    """Part 1 reduced honestly; member 0 checks every block of it."""

    plan: RoundPlan
    reducer: PartReducer
    sample: Sample
    answers: dict[int, Answer]
    evidence: dict[tuple[int, int], bytes | str]
    clipped: list[int]
    """Members clipping scaled down, over all chunks."""


def _scenario(codec: str = "e3m0", return_codec: str = "e3m0", scale: float = 1.0) -> Scenario:
    """``scale``: member 2 sends that many times its delta (50: clipped in every chunk)."""
    send, back = get_codec(codec), get_codec(return_codec)
    generator = torch.Generator().manual_seed(3)
    deltas = [torch.randn(NUMEL, generator=generator) * 1e-2 for _ in WEIGHTS]
    deltas[2] = deltas[2] * scale
    reducer = PartReducer(_plan(PART, send, back))
    own = [OwnContribution(_plan(i, send, back), deltas[i]) for i in range(len(WEIGHTS))]
    chunks = reducer.plan.chunks[PART]
    for i in (0, 2):
        for c, (a, b) in enumerate(chunks):
            payload = send.encode(deltas[i][a:b].contiguous())
            own[i].record(PART, c, payload)
            reducer.add_chunk(i, c, reducer.check_chunk(c, payload))
    reducer.close_gather()
    values, norms, block_norms, clipped = [], [], [], []
    for c, (a, b) in enumerate(chunks):
        payload = send.encode(deltas[PART][a:b].contiguous())
        own[PART].record(PART, c, payload)
        msg, mean, scaled_down = reducer.average(c, send.decode(payload))
        clipped += scaled_down
        values.append(mean)
        norms.append(msg.norms)
        block_norms.append(msg.block_norms)
    assert reducer.mask is not None
    claims = PartClaims(reducer.mask, tuple(norms), tuple(block_norms))
    span = reducer.plan.spans[PART]
    sample = Sample(PART, tuple(range(num_blocks(span))), claims, torch.cat(values))
    answers = {i: own_answers(own[i], [(PART, sample.blocks)])[PART] for i in range(len(WEIGHTS))}
    evidence: dict[tuple[int, int], bytes | str] = {
        (i, c): bytes(reducer.received[i][c].payload) for i in (0, 2) for c in range(len(chunks))
    }
    return Scenario(_plan(0, send, back), reducer, sample, answers, evidence, clipped)


def _edited(answer: Answer, k: int, factor: float = 2.0, add: float = 0.0) -> Answer:
    """``answer`` with its ``k``-th sampled block (whole) scaled and shifted."""
    values = answer.values.clone()
    values[k * 256 : (k + 1) * 256] = values[k * 256 : (k + 1) * 256] * factor + add
    return Answer(values, answer.norms)


def test_sample_blocks_distinct_sorted_inside_the_part() -> None:
    rng = random.Random(1)
    span = (1024, 1024 + 40 * 256 + 17)  # 41 blocks, the last of 17 values
    for _ in range(50):
        blocks = sample_blocks(span, 16, rng)
        assert len(blocks) == 16 and list(blocks) == sorted(set(blocks))
        assert all(0 <= b < 41 for b in blocks)
    assert sample_blocks(span, 100, rng) == tuple(range(41))
    assert sample_blocks((5, 5), 16, rng) == ()
    assert block_span(span, 0) == (1024, 1280) and block_span(span, 40) == (11264, 11281)


def test_sample_blocks_private_randomness_differs_between_members() -> None:
    span = (0, 10_000 * 256)
    assert sample_blocks(span, 16, random.Random(1)) != sample_blocks(span, 16, random.Random(2))


def test_chunk_of_blocks_and_misaligned_chunks() -> None:
    chunks = [(0, 512), (512, 1024), (1024, 1030)]
    assert [chunk_of(chunks, s) for s in [(0, 256), (768, 1024), (1024, 1030)]] == [0, 1, 2]
    with pytest.raises(ValueError, match="cross"):
        chunk_of([(0, 100), (100, 300)], (0, 256))
    with pytest.raises(ValueError, match="no chunk"):
        chunk_of(chunks, (2048, 2304))


def test_slices_alone_only_for_deterministic_block_codecs() -> None:
    assert all(slices_alone(get_codec(n)) for n in ("none", "bf16", "fp16", "int8", "e3m0"))
    assert not slices_alone(get_codec("e3m0", rounding="stochastic"))
    assert not any(slices_alone(get_codec(n)) for n in ("drop", "topk"))


def test_close_block_tolerates_fp32_transport_of_block_norms() -> None:
    assert close_block(1.0 + 1e-7, 1.0) and not close_block(1.0 + 1e-5, 1.0)
    tiny = 3e-43  # an FP32 subnormal: its steps are coarse
    assert close_block(tiny, float(torch.tensor(tiny))) and not close_block(tiny, 10 * tiny)
    assert close_block(1e40, float(torch.finfo(torch.float32).max))  # clamped when sent


def test_expected_block_by_hand() -> None:
    # weights 1 : 2.5 : 3, the last capped at the lower median 2.5, of the constants 6.5,
    # 2.6 and -1.3 -> (6.5 + 6.5 - 3.25) / 6 = 1.625
    none = get_codec("none")
    plan = _plan(0, none, none)
    claims = PartClaims((True, True, True), ((1.0, 1.0, 1.0),) * 3, ((1.0, 1.0),) * 3)
    sample = Sample(PART, (1,), claims, torch.zeros(1536))
    inputs = [torch.full((256,), v) for v in (6.5, 2.6, -1.3)]
    got = expected_values(plan, sample, inputs)
    assert got.shape == (256,) and torch.allclose(got, torch.full((256,), 1.625), atol=1e-6)
    # member 2's claimed norm 10 > C * 1 (lower median): its values scaled by 3 / 10
    # -> (6.5 + 6.5 - 2.5 * 1.3 * 0.3) / 6 = 12.025 / 6
    norms = (1.0, 1.0, 10.0)
    clipped = dataclasses.replace(claims, norms=(norms, norms, norms))
    got = expected_values(plan, dataclasses.replace(sample, claims=clipped), inputs)
    assert torch.allclose(got, torch.full((256,), 12.025 / 6), atol=1e-6)


@pytest.mark.parametrize(
    ("codec", "return_codec", "scale"),
    [("e3m0", "e3m0", 1.0), ("none", "e3m0", 1.0), ("int8", "none", 1.0), ("e3m0", "e3m0", 50.0)],
)
def test_every_block_recomputed_bit_identical_to_the_part_reducer(
    codec: str, return_codec: str, scale: float
) -> None:
    s = _scenario(codec, return_codec, scale)
    assert s.clipped == ([2] * 4 if scale > 1 else [])  # clipping recomputed too
    inputs = [s.answers[i].values for i in (0, 1, 2)]
    assert torch.equal(expected_values(s.plan, s.sample, inputs), s.sample.averaged)
    # any subset of the blocks too (every block is sampled in the scenario)
    some = dataclasses.replace(s.sample, blocks=(1, 4, 6))
    lo = s.plan.spans[PART][0]
    sub = [torch.cat([x[b * 256 : (b + 1) * 256] for b in (1, 4, 6)]) for x in inputs]
    held = torch.cat([s.sample.averaged[b * 256 : (b + 1) * 256] for b in (1, 4, 6)])
    assert torch.equal(expected_values(s.plan, some, sub), held) and lo == 1536
    findings = check_part(s.plan, s.sample, s.answers)
    assert not findings.reducer and not findings.disputed


def test_own_contribution_answers_what_the_reducer_decoded() -> None:
    s = _scenario()
    for i in (0, 2):  # every block is sampled: the answer is the whole part as received
        held = torch.cat([chunk.values for chunk in s.reducer.received[i]])
        assert torch.equal(s.answers[i].values, held)
        assert s.answers[i].norms == pytest.approx(
            [chunk.norm for chunk in s.reducer.received[i]], rel=1e-12
        )


def test_own_contribution_with_stochastic_rounding_answers_from_the_payloads() -> None:
    codec = get_codec("e3m0", rounding="stochastic")
    plan = _plan(0, codec, codec)
    delta = torch.randn(NUMEL) * 1e-2
    own = OwnContribution(plan, delta)
    payloads = []
    for c, (a, b) in enumerate(plan.chunks[PART]):
        payloads.append(codec.encode(delta[a:b].contiguous()))
        assert not own.complete(PART)
        own.record(PART, c, payloads[-1])
    assert own.complete(PART)
    sent = torch.cat([codec.decode(p) for p in payloads])
    payload, norms = own.answer([(PART, (0, 5))])
    assert payload[0] == get_codec("none").codec_id  # no re-encoding: the values sent, raw
    answer = own_answers(own, [(PART, (0, 5))])[PART]
    lo = plan.spans[PART][0]
    assert torch.equal(answer.values, torch.cat([sent[0:256], sent[5 * 256 : 6 * 256]]))
    norms = [chunk_norm(codec.decode(p)) for p in payloads]
    assert lo == 1536 and answer.norms == pytest.approx(norms, rel=1e-12)


def test_reducer_scaling_its_average_found_in_every_block_and_convicted() -> None:
    s = _scenario()
    lie = get_codec("e3m0")
    s.sample = dataclasses.replace(
        s.sample, averaged=lie.decode(lie.encode(-30 * s.sample.averaged))
    )
    findings = check_part(s.plan, s.sample, s.answers)
    assert findings.blocks == list(s.sample.blocks) and findings.disputed
    wanted = wanted_evidence(s.plan, s.sample, findings)
    assert wanted == sorted(s.evidence)
    verdict = judge(s.plan, s.sample, s.answers, s.evidence, wanted)
    assert "not the average of the signed chunks" in verdict.reducer and not verdict.senders


def test_reducer_lying_on_one_block_found_only_there() -> None:
    s = _scenario()
    lo = s.plan.spans[PART][0]
    a, b = block_span(s.plan.spans[PART], 4)
    averaged = s.sample.averaged.clone()
    averaged[a - lo : b - lo] *= 4
    s.sample = dataclasses.replace(s.sample, averaged=averaged)
    findings = check_part(s.plan, s.sample, s.answers)
    assert findings.blocks == [4]
    verdict = judge(
        s.plan, s.sample, s.answers, s.evidence, wanted_evidence(s.plan, s.sample, findings)
    )
    assert verdict.reducer == "block 4 is not the average of the signed chunks"
    # a member that did not sample block 4 sees nothing
    unlucky = dataclasses.replace(s.sample, blocks=(0, 1, 2, 3, 5))
    assert not check_part(
        s.plan, unlucky, {i: _only(a, (0, 1, 2, 3, 5)) for i, a in s.answers.items()}
    ).disputed


def _only(answer: Answer, keep: tuple[int, ...]) -> Answer:
    return Answer(torch.cat([answer.values[k * 256 : (k + 1) * 256] for k in keep]), answer.norms)


def test_sender_lying_in_its_answer_convicted_the_part_stands() -> None:
    s = _scenario()
    s.answers[2] = _edited(s.answers[2], 3)
    findings = check_part(s.plan, s.sample, s.answers)
    assert findings.blocks == [s.sample.blocks[3]]
    verdict = judge(
        s.plan, s.sample, s.answers, s.evidence, wanted_evidence(s.plan, s.sample, findings)
    )
    assert verdict.reducer == ""
    assert verdict.senders == {2: "its answer for block 3 of part 1 is not what it signed"}


def test_reducer_misreporting_a_members_norm_convicted() -> None:
    s = _scenario()
    norms = list(s.sample.claims.norms)
    norms[1] = (norms[1][0] * 2, *norms[1][1:])  # member 0's norm of chunk 1, doubled
    claims = dataclasses.replace(s.sample.claims, norms=tuple(norms))
    s.sample = dataclasses.replace(s.sample, claims=claims)
    findings = check_part(s.plan, s.sample, s.answers)
    assert findings.norms == [(0, 1)]
    verdict = judge(
        s.plan, s.sample, s.answers, s.evidence, wanted_evidence(s.plan, s.sample, findings)
    )
    assert verdict.reducer.startswith("norm ") and "member 0's chunk 1" in verdict.reducer


def test_sender_lying_about_its_norm_convicted() -> None:
    s = _scenario()
    s.answers[0] = Answer(s.answers[0].values, (1.0, *s.answers[0].norms[1:]))
    findings = check_part(s.plan, s.sample, s.answers)
    assert findings.norms == [(0, 0)]
    verdict = judge(
        s.plan, s.sample, s.answers, s.evidence, wanted_evidence(s.plan, s.sample, findings)
    )
    assert not verdict.reducer and verdict.senders == {0: "it said chunk 0 of part 1 has norm 1"}


def test_reducer_own_values_off_its_block_norms_convicted_without_dispute() -> None:
    s = _scenario()
    # A reducer that answers with whatever own values make its lie look like an average
    # must also have signed block norms for them: here its block 2 answer is doubled.
    own = s.answers[PART]
    s.answers[PART] = _edited(own, 2)
    findings = check_part(s.plan, s.sample, s.answers)
    assert findings.reducer == "its own values at block 2 are not of the block norm it signed"
    assert not findings.disputed


def test_reducer_own_norm_not_its_block_norms_convicted() -> None:
    s = _scenario()
    block_norms = list(s.sample.claims.block_norms)
    block_norms[0] = (block_norms[0][0] / 10, block_norms[0][1])
    claims = dataclasses.replace(s.sample.claims, block_norms=tuple(block_norms))
    findings = check_part(s.plan, dataclasses.replace(s.sample, claims=claims), s.answers)
    assert findings.reducer.endswith("of chunk 0 is not its blocks' nor its answer's")


def test_silent_reducer_convicted_silent_sender_replaced_by_evidence() -> None:
    s = _scenario()
    answers = {i: a for i, a in s.answers.items() if i != PART}
    assert check_part(s.plan, s.sample, answers).reducer == "it did not answer the check"
    answers = {i: a for i, a in s.answers.items() if i != 2}
    findings = check_part(s.plan, s.sample, answers)
    assert findings.missing == [2] and findings.disputed
    wanted = wanted_evidence(s.plan, s.sample, findings)
    assert judge(s.plan, s.sample, answers, s.evidence, wanted) == Judgement()


@pytest.mark.parametrize(
    ("item", "match"),
    [
        (None, r"no signed chunk 1 of member 2 \(not sent\)"),
        ("not signed by its sender: bad signature", "not signed by its sender"),
        (b"\x04garbage", "does not decode"),
        (get_codec("e3m0").encode(torch.ones(100)), "of 100 values"),
    ],
)
def test_evidence_withheld_forged_or_broken_convicts_the_reducer(
    item: bytes | str | None, match: str
) -> None:
    s = _scenario()
    s.answers[2] = _edited(s.answers[2], 0, add=1.0)
    findings = check_part(s.plan, s.sample, s.answers)
    wanted = wanted_evidence(s.plan, s.sample, findings)
    if item is None:
        del s.evidence[(2, 1)]
    else:
        s.evidence[(2, 1)] = item
    assert (2, 1) in wanted
    verdict = judge(s.plan, s.sample, s.answers, s.evidence, wanted)
    assert re.search(match, verdict.reducer), verdict


def test_answers_of_several_parts_in_one_payload_of_the_runs_codec_or_raw() -> None:
    e3m0 = get_codec("e3m0")
    plan = _plan(0, e3m0, e3m0)
    delta = torch.randn(NUMEL, generator=torch.Generator().manual_seed(5))
    own = OwnContribution(plan, delta)
    for j, chunks in enumerate(plan.chunks):
        for c, (a, b) in enumerate(chunks):
            own.record(j, c, e3m0.encode(delta[a:b].contiguous()))
    parts = [(0, (0, 5)), (2, (1, 5))]  # part 2's block 5 is its last: 100 values
    payload, norms = own.answer(parts)
    answers = read_answers(plan, parts, norms, payload)
    sent = e3m0.decode(e3m0.encode(delta))  # every chunk cut at multiples of 256
    spans = [(0, 256), (1280, 1536), (3584, 3840), (4608, 4708)]
    assert torch.equal(answers[0].values, torch.cat([sent[a:b] for a, b in spans[:2]]))
    assert torch.equal(answers[2].values, torch.cat([sent[a:b] for a, b in spans[2:]]))
    assert answers[2].norms == norms[1] and len(norms[1]) == len(plan.chunks[2])
    raw = get_codec("none").encode(torch.cat([answers[0].values, answers[2].values]))
    from_raw = read_answers(plan, parts, norms, raw)
    assert all(torch.equal(from_raw[j].values, answers[j].values) for j in (0, 2))
    with pytest.raises(ProtocolError, match="expected 868"):
        read_answers(plan, parts, norms, e3m0.encode(torch.zeros(256)))
    with pytest.raises(ProtocolError, match="does not decode"):
        read_answers(plan, parts, norms, get_codec("bf16").encode(torch.zeros(868)))
    with pytest.raises(ProtocolError, match="chunk norms for part 2"):
        read_answers(plan, parts, [norms[0], norms[1][:1]], payload)
