"""The ``Reducer`` interface: reduce one fragment round, whatever the transport.

The outer step and merge (``diloco.node.outer``) see only this interface, so the
in-process multi-replica trainer and the swarm node run one algorithm ("one algorithm, two
transports"). ``InProcessReducer`` follows the wire path of the butterfly all-reduce
(SPEC 4) exactly: every member's part is encoded with the run's codec and decoded by its
reducer, the weighted mean is accumulated in FP32 in group order (``weighted_mean``), the
mean is encoded once and every member (the reducer too) uses the decoded bytes. Bytes are
counted from the encoded payloads of both phases.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from diloco.codecs import Codec
from diloco.protocol.partition import butterfly_parts


@dataclass(frozen=True, slots=True)
class RoundKey:
    """One round of one fragment: ``k``-th sync of fragment ``p`` (SPEC 2.4)."""

    fragment: int
    round: int


@dataclass(frozen=True, slots=True)
class Contribution:
    """One member's outer gradient for a round.

    ``delta`` is the FP32 outer gradient ``outer_p - theta_m[p]``, 1-D, on the CPU;
    ``weight`` is the number of tokens the member processed since its previous sync of this
    fragment (SPEC 2.4 step 3).
    """

    member: str
    delta: torch.Tensor
    weight: float


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


class Reducer(ABC):
    """Reduces fragment rounds; implementations own their codec and transport."""

    @abstractmethod
    def reduce(self, key: RoundKey, contributions: Sequence[Contribution]) -> Future[RoundResult]:
        """Start reducing ``key`` with this process's ``contributions``; never blocks.

        The future resolves to a ``RoundResult`` or raises ``diloco.errors.RoundFailed``.
        """

    def close(self) -> None:
        """Release transport resources; the default holds none."""


def weighted_mean(parts: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """FP32 weighted mean, accumulated in the given (group) order.

    Each contribution is scaled by its normalised weight before it is added, so a single
    member gets its own values back exactly, and every reducer of every transport performs
    the same float operations in the same order. The product and the sum are two separate
    operations, each rounded once on every CPU: ``add_(x, alpha=w)`` fuses them into one FMA
    where the CPU has it (AVX2) and not elsewhere, and members that recompute a reducer's
    blocks (``verification``) must get its bits on any machine, value by value.
    """
    total = float(sum(weights))
    if not parts or total <= 0:
        raise ValueError("weighted_mean needs at least one part with positive total weight")
    acc = torch.zeros_like(parts[0], dtype=torch.float32)
    for part, weight in zip(parts, weights, strict=True):
        acc.add_(part.to(torch.float32) * (float(weight) / total))
    return acc


class InProcessReducer(Reducer):
    """All members live in this process (``diloco-node local``); results are immediate."""

    def __init__(self, codec: Codec, return_codec: Codec | None = None) -> None:
        self.codec = codec
        self.return_codec = return_codec or codec

    def reduce(self, key: RoundKey, contributions: Sequence[Contribution]) -> Future[RoundResult]:
        future: Future[RoundResult] = Future()
        start = time.perf_counter()
        num_members = len(contributions)
        numel = contributions[0].delta.numel()
        weights = [c.weight for c in contributions]
        result = torch.empty(numel, dtype=torch.float32)
        sent = [0] * num_members
        received = [0] * num_members
        for reducer, (lo, hi) in enumerate(butterfly_parts(numel, num_members)):
            decoded = []
            for member, contribution in enumerate(contributions):
                payload = self.codec.encode(contribution.delta[lo:hi].contiguous())
                decoded.append(self.codec.decode(payload))
                if member != reducer:
                    sent[member] += len(payload)
                    received[reducer] += len(payload)
            averaged = self.return_codec.encode(weighted_mean(decoded, weights))
            result[lo:hi] = self.return_codec.decode(averaged)
            for member in range(num_members):
                if member != reducer:
                    sent[reducer] += len(averaged)
                    received[member] += len(averaged)
        future.set_result(
            RoundResult(
                delta=result,
                members=tuple(c.member for c in contributions),
                bytes_sent=sum(sent) // num_members,
                bytes_received=sum(received) // num_members,
                seconds=time.perf_counter() - start,
            )
        )
        return future
