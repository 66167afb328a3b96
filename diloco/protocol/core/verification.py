"""Sampled checks of the reducers' averages, and who lied when one fails. Pure.

The combine step is deterministic and elementwise given the chunk norms
(``aggregation.robust_mean``), so a member can recompute any block of an averaged part bit
for bit from the inputs at that block and the norms the reducer signed.
After the gather every member checks every part it did not reduce itself:

1. It picks ``SAMPLES_PER_PART`` blocks of ``BLOCK_VALUES`` values of the part with private
   randomness, only once it holds every averaged part, so a reducer cannot know which of
   its values will be looked at.
2. It asks every counted member (CHECK_REQ) for its contribution at those blocks, as its
   reducer decoded it, and its norm over every chunk of the part; answers are signed.
3. ``check_part`` recomputes each block with the capped GROUP weights, the counted mask,
   the run's clip factor and the norms from the reducer's signed AVERAGED chunks (so the
   clipping too), encodes it with the return codec and compares it exactly with the
   averaged values held. It also compares every member's
   chunk norms with the reducer's, and the reducer's own contribution at the blocks with
   the block norms it signed (its own contribution is the one input nobody else holds:
   the block norms commit it, so a reducer cannot answer with whatever values make its
   average look right and still claim a small norm for them).
4. Only when something differs (a dispute) it asks the reducer (EVIDENCE_REQ) for the signed
   PART chunks under the sampled blocks, and ``judge`` decides from signatures alone: a
   recomputation from the signed inputs that differs from the reducer's signed average,
   norms that are not those of the signed chunks, or evidence withheld, convict the
   reducer (its part is bad: the round is not applied); an answer that contradicts the
   sender's own signed chunk convicts that sender (the part is fine).

Bound: a lie that touches a fraction ``f`` of a part's blocks escapes one member's check
with probability at most ``(1 - f) ** s`` for ``s`` sampled blocks (fewer when sampling
without replacement), and every member checks independently, so a lie over a whole part
(``f = 1``) fails the round for every honest member alike and their states stay
identical. A lie over a few blocks fails it only for the members that sample one of them
(the others apply it); their states then differ and the published state hashes heal the
minority. Norms are compared with a relative tolerance of ``NORM_TOLERANCE``: machines sum
in another order; a norm wrong by that much changes a clipping factor by as little.

Return codecs whose encoding of a block is not the block of the encoded chunk (stochastic
rounding, ``drop``, ``topk``) cannot be recomputed; ``slices_alone`` says which can.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from diloco.codecs import Codec, CodecError, get_codec
from diloco.errors import ProtocolError
from diloco.protocol.core.aggregation import robust_mean
from diloco.protocol.core.norms import (
    BLOCK_VALUES,
    FLOAT32_MAX,
    Span,
    block_norms,
    chunk_norm,
    num_blocks,
)
from diloco.protocol.core.round import RoundPlan
from diloco.protocol.wire.frames import Buffer

SAMPLES_PER_PART = 16
"""Blocks each member checks in each part: with 4 members about 1.5% more bytes."""
NORM_TOLERANCE = 1e-6

_SLICE_ALONE_CODECS = ("none", "bf16", "fp16", "int8")


def slices_alone(codec: Codec) -> bool:
    """Whether encoding a ``BLOCK_VALUES``-aligned slice alone gives, bit for bit, the values
    it has in the encoded whole: block codecs with deterministic rounding."""
    return codec.name in _SLICE_ALONE_CODECS or (
        codec.name == "e3m0" and getattr(codec, "rounding", "") == "nearest"
    )


def block_span(span: Span, block: int) -> Span:
    """Values ``[a, b)`` of block ``block`` of part ``span``."""
    a = span[0] + block * BLOCK_VALUES
    return a, min(a + BLOCK_VALUES, span[1])


def sample_blocks(span: Span, count: int, rng: random.Random) -> tuple[int, ...]:
    """``count`` distinct blocks of part ``span`` (all of them if fewer), sorted."""
    blocks = num_blocks(span)
    return tuple(sorted(rng.sample(range(blocks), min(count, blocks))))


def chunk_of(chunks: Sequence[Span], span: Span) -> int:
    """The chunk that holds the values ``span`` (a block).

    Raises:
        ValueError: no chunk holds all of it (chunks must be cut at block boundaries).
    """
    for c, (a, b) in enumerate(chunks):
        if a <= span[0] < b:
            if span[1] > b:
                raise ValueError(f"values {span} cross the end of chunk {c}")
            return c
    raise ValueError(f"values {span} are in no chunk")


def close(a: float, b: float) -> bool:
    """Norms equal up to ``NORM_TOLERANCE`` (relative)."""
    return abs(a - b) <= NORM_TOLERANCE * max(abs(a), abs(b))


def close_block(computed: float, signed: float) -> bool:
    """A block norm computed here against one that travelled as FP32 (``block_norms``):
    equal up to ``NORM_TOLERANCE`` or two FP32 steps, whichever is larger."""
    computed = min(computed, FLOAT32_MAX)
    larger = max(computed, signed)
    step = float(np.spacing(np.float32(larger)))
    return abs(computed - signed) <= max(NORM_TOLERANCE * larger, 2 * step)


@dataclass(frozen=True, slots=True)
class PartClaims:
    """What the reducer of a part signed in its AVERAGED chunks, besides the values."""

    mask: tuple[bool, ...]
    norms: tuple[tuple[float, ...], ...]
    """Per chunk, every member's chunk norm (0: not counted)."""
    block_norms: tuple[tuple[float, ...], ...]
    """Per chunk, the norms of the reducer's own contribution over each block."""

    @property
    def counted(self) -> list[int]:
        return [i for i, bit in enumerate(self.mask) if bit]


@dataclass(frozen=True, slots=True)
class Sample:
    """What a member checks of part ``part``: the blocks, the claims, the values it holds."""

    part: int
    blocks: tuple[int, ...]
    claims: PartClaims
    averaged: torch.Tensor
    """The decoded averaged part, as this member applies it."""

    def spans(self, plan: RoundPlan) -> list[Span]:
        """The sampled blocks' values ``[a, b)`` in the vector."""
        return [block_span(plan.spans[self.part], block) for block in self.blocks]

    def size(self, plan: RoundPlan) -> int:
        """Values in the sampled blocks."""
        return sum(b - a for a, b in self.spans(plan))

    def held(self, plan: RoundPlan) -> torch.Tensor:
        """The averaged values held at the sampled blocks, one block after the other."""
        lo = plan.spans[self.part][0]
        return torch.cat([self.averaged[a - lo : b - lo] for a, b in self.spans(plan)])


def draw_samples(
    plan: RoundPlan,
    claims: Mapping[int, PartClaims],
    averaged: torch.Tensor,
    count: int,
    rng: random.Random,
) -> dict[int, Sample]:
    """The ``Sample`` of each part this member did not reduce: ``count`` blocks of it
    (``sample_blocks``), its reducer's ``claims`` and the ``averaged`` vector held. Parts
    without claims are not sampled: those a substitute re-reduced (``rereduction``)."""
    samples = {}
    for j, (lo, hi) in enumerate(plan.spans):
        if j == plan.index or j not in claims:
            continue
        blocks = sample_blocks((lo, hi), count, rng)
        if blocks:
            samples[j] = Sample(j, blocks, claims[j], averaged[lo:hi])
    return samples


@dataclass(frozen=True, slots=True)
class Answer:
    """A member's contribution to one part at the sampled blocks and its chunk norms."""

    values: torch.Tensor
    """The sampled blocks' values one after the other (blocks are sorted: only the last
    one may be short)."""
    norms: tuple[float, ...]
    """One per chunk of the part."""


@dataclass
class Findings:
    """What ``check_part`` found, before any dispute."""

    reducer: str = ""
    """Why the reducer lied, proven by what it signed itself; empty if nothing is proven."""
    silent: bool = False
    """The reducer is blamed for not answering (no proof of a lie: maybe a cut stream)."""
    blocks: list[int] = field(default_factory=list)
    """Sampled blocks whose recomputation differs from the values held."""
    norms: list[tuple[int, int]] = field(default_factory=list)
    """(member, chunk) whose norm differs between the member and the reducer."""
    missing: list[int] = field(default_factory=list)
    """Counted members, other than the reducer, that gave no answer."""

    @property
    def disputed(self) -> bool:
        """Whether only the reducer's evidence can tell who lied."""
        return not self.reducer and bool(self.blocks or self.norms or self.missing)


@dataclass(frozen=True, slots=True)
class Judgement:
    """Who lied about one part: the reducer (its part is bad) and senders (it is not)."""

    reducer: str = ""
    senders: dict[int, str] = field(default_factory=dict)
    silent: bool = False
    """The reducer is blamed for silence (no answer or no evidence), not a proven lie."""


def expected_values(
    plan: RoundPlan, sample: Sample, inputs: Sequence[torch.Tensor]
) -> torch.Tensor:
    """The decoded averaged values the reducer must have sent at the sampled blocks, from
    the counted members' values there (``inputs``, group order; blocks one after the other).

    Blocks of one chunk are combined together with that chunk's norms, and all of them are
    encoded in one call: every block but the last is whole and a multiple of every codec's
    block, so each encodes as it does in its chunk.
    """
    counted = sample.claims.counted
    weights = [plan.weights[i] for i in counted]
    means, offset = [], 0
    chunks = [chunk_of(plan.chunks[sample.part], span) for span in sample.spans(plan)]
    sizes = [b - a for a, b in sample.spans(plan)]
    for c in sorted(set(chunks)):
        size = sum(n for n, chunk in zip(sizes, chunks, strict=True) if chunk == c)
        norms = [sample.claims.norms[c][i] for i in counted]
        values = [x[offset : offset + size] for x in inputs]
        means.append(robust_mean(values, weights, plan.clip_factor, norms).mean)
        offset += size
    encoded = plan.return_codec.encode(torch.cat(means))
    return plan.return_codec.decode(encoded)


def differing_blocks(plan: RoundPlan, sample: Sample, inputs: Sequence[torch.Tensor]) -> list[int]:
    """Sampled blocks whose recomputation from ``inputs`` differs from the values held."""
    sizes = [b - a for a, b in sample.spans(plan)]
    want = torch.split(expected_values(plan, sample, inputs), sizes)
    held = torch.split(sample.held(plan), sizes)
    return [b for b, x, y in zip(sample.blocks, want, held, strict=True) if not torch.equal(x, y)]


def _reducer_claims(plan: RoundPlan, sample: Sample, own: Answer) -> str:
    """Why the reducer's own contribution contradicts what it signed; empty if it does not."""
    j, claims = sample.part, sample.claims
    for c, norms in enumerate(claims.norms):
        total = math.hypot(*claims.block_norms[c])
        if not close(total, norms[j]) or not close(own.norms[c], norms[j]):
            return f"its own norm {norms[j]:.9g} of chunk {c} is not its blocks' nor its answer's"
    # every sampled block is whole but the part's last: block norms of the answer are the
    # blocks' own, computed as the reducer computed its
    computed = block_norms(own.values)
    for block, (a, b), norm in zip(sample.blocks, sample.spans(plan), computed, strict=True):
        c = chunk_of(plan.chunks[j], (a, b))
        signed = claims.block_norms[c][(a - plan.chunks[j][c][0]) // BLOCK_VALUES]
        if not close_block(norm, signed):
            return f"its own values at block {block} are not of the block norm it signed"
    return ""


def check_part(plan: RoundPlan, sample: Sample, answers: Mapping[int, Answer]) -> Findings:
    """Check part ``sample.part`` against the members' ``answers`` (this member's included,
    by group index; members not counted are ignored)."""
    j, claims = sample.part, sample.claims
    findings = Findings()
    if j not in answers:
        findings.reducer, findings.silent = "it did not answer the check", True
        return findings
    findings.reducer = _reducer_claims(plan, sample, answers[j])
    if findings.reducer:
        return findings
    for i in claims.counted:
        if i == j:
            continue
        if i not in answers:
            findings.missing.append(i)
            continue
        for c, norm in enumerate(answers[i].norms):
            if not close(norm, claims.norms[c][i]):
                findings.norms.append((i, c))
    if findings.missing:
        return findings  # blocks are recomputed from the evidence instead
    inputs = [answers[i].values for i in claims.counted]
    findings.blocks = differing_blocks(plan, sample, inputs)
    return findings


def wanted_evidence(plan: RoundPlan, sample: Sample, findings: Findings) -> list[tuple[int, int]]:
    """The signed chunks ``(member, chunk)`` to ask the reducer for in a dispute: every
    counted sender's chunks under the sampled blocks, and the first disputed norm of each
    member (one settles who lied about it)."""
    j = sample.part
    chunks = {chunk_of(plan.chunks[j], block_span(plan.spans[j], b)) for b in sample.blocks}
    items = {(i, c) for i in sample.claims.counted if i != j for c in chunks}
    first: dict[int, int] = {}
    for i, c in findings.norms:
        first.setdefault(i, c)
    return sorted(items | set(first.items()))


def judge(
    plan: RoundPlan,
    sample: Sample,
    answers: Mapping[int, Answer],
    evidence: Mapping[tuple[int, int], bytes | str],
    wanted: Sequence[tuple[int, int]],
) -> Judgement:
    """Who lied about part ``sample.part``, from the reducer's ``evidence`` for ``wanted``:
    the payload of each signed PART chunk (signatures checked by the caller) or why there
    is none (withheld, not signed by its sender)."""
    j, claims = sample.part, sample.claims
    senders: dict[int, str] = {}
    signed: dict[tuple[int, int], torch.Tensor] = {}
    for i, c in wanted:
        item = evidence.get((i, c), "not sent")
        if isinstance(item, str):
            silent = item == "not sent"
            return Judgement(f"no signed chunk {c} of member {i} ({item})", senders, silent)
        a, b = plan.chunks[j][c]
        try:
            values = plan.codec.decode(item)
        except CodecError:
            return Judgement(f"it counted member {i}'s chunk {c}, which does not decode")
        if values.numel() != b - a:
            return Judgement(f"it counted member {i}'s chunk {c} of {values.numel()} values")
        norm = chunk_norm(values)
        if not close(norm, claims.norms[c][i]):
            return Judgement(f"norm {claims.norms[c][i]:.9g} of member {i}'s chunk {c}: {norm}")
        signed[(i, c)] = values
        answer = answers.get(i)
        if answer is not None and not close(answer.norms[c], norm):
            senders[i] = f"it said chunk {c} of part {j} has norm {answer.norms[c]:.9g}"
    spans = sample.spans(plan)
    sizes = [b - a for a, b in spans]
    inputs = []
    for i in claims.counted:
        if i == j:
            inputs.append(answers[j].values)
            continue
        truth = []
        for a, b in spans:
            c = chunk_of(plan.chunks[j], (a, b))
            lo = plan.chunks[j][c][0]
            truth.append(signed[(i, c)][a - lo : b - lo])
        inputs.append(torch.cat(truth))
        answer = answers.get(i)
        if answer is not None:
            said = zip(sample.blocks, torch.split(answer.values, sizes), truth, strict=True)
            lies = [block for block, x, y in said if not torch.equal(x, y)]
            if lies:
                senders[i] = f"its answer for block {lies[0]} of part {j} is not what it signed"
    wrong = differing_blocks(plan, sample, inputs)
    if wrong:
        return Judgement(f"block {wrong[0]} is not the average of the signed chunks", senders)
    return Judgement("", senders)


class OwnContribution:
    """This member's contribution to every part as its reducers decode it: what it answers
    in CHECK_RES and checks with.

    The norms are recorded as the chunks are encoded (``record``, in an executor). Values at
    blocks are encoded again from the delta when the codec ``slices_alone``; otherwise they
    are decoded from the payloads, which are then kept until the round ends.
    """

    def __init__(self, plan: RoundPlan, delta: torch.Tensor) -> None:
        self.plan, self.delta = plan, delta
        self.norms: dict[tuple[int, int], float] = {}
        self._payloads: dict[tuple[int, int], bytes] | None = (
            None if slices_alone(plan.codec) else {}
        )

    def record(
        self, part: int, chunk: int, payload: bytes, values: torch.Tensor | None = None
    ) -> None:
        """Keep what chunk ``chunk`` of ``part`` was sent as (its norm; maybe the bytes);
        ``values`` are the payload decoded, where the caller has them."""
        try:
            norm = self.plan.codec.decoded_norm(payload) if values is None else chunk_norm(values)
            self.norms[(part, chunk)] = norm
        except CodecError:  # a member that sends garbage is excluded; its answers do not count
            self.norms[(part, chunk)] = math.nan
        if self._payloads is not None:
            self._payloads[(part, chunk)] = payload

    def record_all(self, chunks: Sequence[tuple[int, int, bytes]]) -> None:
        """``record`` each of ``chunks`` (part, chunk, payload)."""
        for part, chunk, payload in chunks:
            self.record(part, chunk, payload)

    def complete(self, part: int) -> bool:
        """Whether every chunk of ``part`` was recorded."""
        return all((part, c) in self.norms for c in range(len(self.plan.chunks[part])))

    def answer(
        self, parts: Sequence[tuple[int, Sequence[int]]]
    ) -> tuple[bytes, list[tuple[float, ...]]]:
        """The answer for ``parts`` (ascending, each with sorted blocks; every chunk of them
        recorded): one payload that decodes to the values sent at all those blocks, one
        after the other, and each part's chunk norms."""
        spans = [(j, block_span(self.plan.spans[j], b)) for j, blocks in parts for b in blocks]
        norms = [
            tuple(self.norms[(j, c)] for c in range(len(self.plan.chunks[j]))) for j, _ in parts
        ]
        if self._payloads is None:  # one call: the blocks encode as they did in their chunks
            sent = torch.cat([self.delta[a:b] for _, (a, b) in spans])
            return self.plan.codec.encode(sent), norms
        decoded: dict[tuple[int, int], torch.Tensor] = {}
        values = []
        for j, (a, b) in spans:
            chunks = self.plan.chunks[j]
            c = chunk_of(chunks, (a, b))
            if (j, c) not in decoded:
                decoded[(j, c)] = self.plan.codec.decode(self._payloads[(j, c)])
            values.append(decoded[(j, c)][a - chunks[c][0] : b - chunks[c][0]])
        return RAW.encode(torch.cat(values)), norms


RAW = get_codec("none")
"""What an answer is encoded with when the run's codec cannot re-encode its blocks alone."""


def read_answers(
    plan: RoundPlan,
    parts: Sequence[tuple[int, Sequence[int]]],
    norms: Sequence[Sequence[float]],
    payload: Buffer,
) -> dict[int, Answer]:
    """A member's ``Answer`` for each of ``parts`` from its norms and its one payload (of the
    run's codec, or ``none``).

    Raises:
        ProtocolError: another codec, no decode, or not one value per value asked and one
            norm per chunk.
    """
    sizes = [sum(b - a for a, b in (block_span(plan.spans[j], x) for x in xs)) for j, xs in parts]
    decoder = plan.codec if payload[:1] == bytes([plan.codec.codec_id]) else RAW
    try:
        values = decoder.decode(payload)
    except CodecError as exc:
        raise ProtocolError(f"answer does not decode: {exc}") from exc
    if values.numel() != sum(sizes):
        raise ProtocolError(f"answer of {values.numel()} values, expected {sum(sizes)}")
    answers = {}
    for (j, _), part_norms, part_values in zip(
        parts, norms, torch.split(values, sizes), strict=True
    ):
        if len(part_norms) != len(plan.chunks[j]):
            raise ProtocolError(f"{len(part_norms)} chunk norms for part {j}")
        answers[j] = Answer(part_values, tuple(part_norms))
    return answers


def own_answers(
    own: OwnContribution, parts: Sequence[tuple[int, Sequence[int]]]
) -> dict[int, Answer]:
    """This member's own ``Answer`` for each of ``parts``, as others would read it."""
    payload, norms = own.answer(parts)
    return read_answers(own.plan, parts, norms, payload)
