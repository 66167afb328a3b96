"""The ``Reducer`` interface: reduce one fragment round, whatever the transport.

The outer step and merge (``diloco.node.training.outer``) see only this interface, so the
in-process multi-replica trainer and the swarm node run one algorithm ("one algorithm, two
transports"). ``InProcessReducer`` follows the wire path of the butterfly all-reduce
(docs/design.md "The round") exactly: every member's part is encoded with the run's codec and
decoded by its reducer, contributions are combined chunk by chunk as the swarm's reducers combine
them (``aggregation.robust_mean``: weights capped, norms clipped, FP32 in group order), the
mean is encoded once and every member (the reducer too) uses the decoded bytes. Bytes are
counted from the encoded payloads of both phases.
"""

from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from diloco.codecs import Codec
from diloco.protocol.core.aggregation import (
    CLIP_FACTOR,
    cap_weights,
    check_clip_factor,
    robust_mean,
)
from diloco.protocol.core.partition import butterfly_parts
from diloco.protocol.core.round import chunk_spans


@dataclass(frozen=True, slots=True)
class RoundKey:
    """One round of one fragment: ``k``-th sync of fragment ``p`` (docs/design.md "Algorithm and
    schedule")."""

    fragment: int
    round: int


@dataclass(frozen=True, slots=True)
class Contribution:
    """One member's outer gradient for a round.

    ``delta`` is the FP32 outer gradient ``outer_p - theta_m[p]``, 1-D, on the CPU;
    ``weight`` is the number of tokens the member processed since its previous sync of this
    fragment (docs/design.md "Algorithm and schedule" step 3); ``prior`` is the hash of the
    fragment's outer state the member starts from (empty: not checked), so that only equal priors
    share a round.
    """

    member: str
    delta: torch.Tensor
    weight: float
    prior: str = ""
    client: bool = False
    """It reduces no part (a swarm client): its part is empty, as on the wire, so the
    chunks, and the norms clipping compares, are the swarm's."""
    last: bool = False
    """The run's last round of this fragment: a member that misses it can heal only at
    the run's end, from the peers still there; a swarm node that counts a peer waits the
    widest window for it."""


@dataclass(frozen=True, slots=True)
class RoundResult:
    """What every member of a round gets back, identically.

    ``delta`` is the decoded weighted mean (FP32, 1-D); ``members`` are those counted, in
    group order; byte counts are per local member, both all-reduce phases, on the wire.
    """

    delta: torch.Tensor
    members: tuple[str, ...]
    bytes_sent: int
    bytes_received: int
    seconds: float
    matchmaking_seconds: float = 0.0
    """Of ``seconds``, the part spent forming the group (metrics and the simulator)."""
    stages: tuple[StageMetrics, ...] = ()
    """Per stage of a staged round (``staged_runner``); empty for a flat one."""
    weights: Mapping[str, float] = field(default_factory=dict)
    """Each counted member's announced weight (tokens), as the group carried it: what a
    node witnessed each peer contribute (docs/design.md "Pace")."""
    round_trips: tuple[tuple[str, float], ...] = ()
    """The exchanges on this member's critical path, ``(kind, seconds)`` in order
    (``round_trips``; empty where nothing counts them)."""
    withdrawn: Callable[[], str | None] | None = field(default=None, compare=False)
    """Asked when the result is applied: why it no longer holds, or None. A round of one
    is withdrawn once a peer took this node's state after it was decided: that peer starts
    without it and looks for this node in the same round (docs/design.md "Algorithm and
    schedule")."""


@dataclass(frozen=True, slots=True)
class StageMetrics:
    """One stage of a staged round at one member: its group's size, this member's bytes
    on the wire (both phases, checks included) and the stage's seconds."""

    stage: int
    members: int
    bytes_sent: int
    bytes_received: int
    seconds: float


class Reducer(ABC):
    """Reduces fragment rounds; implementations own their codec and transport."""

    @abstractmethod
    def reduce(self, key: RoundKey, contributions: Sequence[Contribution]) -> Future[RoundResult]:
        """Start reducing ``key`` with this process's ``contributions``; never blocks.

        The future resolves to a ``RoundResult`` or raises ``diloco.errors.RoundFailed``.
        """

    def prepare(self, key: RoundKey, numel: int, weight: float, prior: str, lead: float) -> None:
        """Say that round ``key`` (``numel`` values) will be sent in about ``lead`` seconds,
        starting from the fragment state of hash ``prior``, with about ``weight``: a
        transport may start matchmaking now (docs/design.md "Across the internet"). Never
        blocks; the default does nothing."""

    def forgo(self, key: RoundKey) -> None:
        """Say that this node skipped round ``key``'s send step after ``prepare`` (it caught
        up with the swarm): a transport tells the peers waiting for it. Never blocks; the
        default does nothing."""

    def close(self) -> None:
        """Release transport resources; the default holds none."""


class InProcessReducer(Reducer):
    """All members live in this process (``diloco-node local``); results are immediate.

    ``max_weight`` and ``clip_factor`` are the swarm's rules (``aggregation``): weights
    clamped to the cap, contributions clipped chunk by chunk (the swarm's chunks), so both
    transports give the same bits. ``clipped`` counts the contributions to a chunk that
    clipping scaled down, ``combined`` every contribution to a chunk (honest runs: 0 of N).
    """

    def __init__(
        self,
        codec: Codec,
        return_codec: Codec | None = None,
        *,
        max_weight: float = math.inf,
        clip_factor: float = CLIP_FACTOR,
    ) -> None:
        check_clip_factor(clip_factor)
        if not max_weight > 0:
            raise ValueError(f"max_weight must be > 0 tokens, got {max_weight!r}")
        self.codec = codec
        self.return_codec = return_codec or codec
        self.max_weight, self.clip_factor = max_weight, clip_factor
        self.clipped = 0
        self.combined = 0

    def reduce(self, key: RoundKey, contributions: Sequence[Contribution]) -> Future[RoundResult]:
        future: Future[RoundResult] = Future()
        start = time.perf_counter()
        num_members = len(contributions)
        numel = contributions[0].delta.numel()
        weights = cap_weights([c.weight for c in contributions], self.max_weight)
        result = torch.empty(numel, dtype=torch.float32)
        sent = [0] * num_members
        received = [0] * num_members
        shares = [0.0 if c.client else 1.0 for c in contributions]
        for reducer, (lo, hi) in enumerate(butterfly_parts(numel, num_members, shares)):
            if contributions[reducer].client:
                continue  # an empty part: nothing goes on the wire
            decoded = []
            for member, contribution in enumerate(contributions):
                payload = self.codec.encode(contribution.delta[lo:hi].contiguous())
                decoded.append(self.codec.decode(payload))
                if member != reducer:
                    sent[member] += len(payload)
                    received[reducer] += len(payload)
            mean = torch.empty(hi - lo, dtype=torch.float32)
            for a, b in chunk_spans(lo, hi) if hi > lo else []:
                combined = robust_mean(
                    [d[a - lo : b - lo] for d in decoded], weights, self.clip_factor
                )
                mean[a - lo : b - lo] = combined.mean
                self.clipped += len(combined.clipped)
                self.combined += num_members
            averaged = self.return_codec.encode(mean)
            result[lo:hi] = self.return_codec.decode(averaged)
            for member in range(num_members):
                if member != reducer:
                    sent[reducer] += len(averaged)
                    received[member] += len(averaged)
        future.set_result(
            RoundResult(
                delta=result,
                members=tuple(c.member for c in contributions),
                weights={c.member: c.weight for c in contributions},
                bytes_sent=sum(sent) // num_members,
                bytes_received=sum(received) // num_members,
                seconds=time.perf_counter() - start,
            )
        )
        return future
