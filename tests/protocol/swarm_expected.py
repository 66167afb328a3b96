"""The exact FP32 result a round must produce, computed in the test process."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import torch
from hivemind.p2p import PeerID
from swarm_peers import make_delta

from diloco.codecs import get_codec
from diloco.protocol.core.aggregation import CLIP_FACTOR, robust_mean
from diloco.protocol.core.partition import butterfly_parts
from diloco.protocol.core.reducer import Contribution, InProcessReducer, RoundKey
from diloco.protocol.core.round import chunk_spans
from diloco.protocol.matchmaking.lobby import leader_rank, round_key


def group_order(peer_ids: Sequence[str]) -> list[int]:
    """Indices of ``peer_ids`` in group order (sorted peer id bytes)."""
    return sorted(range(len(peer_ids)), key=lambda i: PeerID.from_base58(peer_ids[i]).to_bytes())


def leader_order(peer_ids: Sequence[str], run_id: str, key: RoundKey) -> list[int]:
    """Indices of ``peer_ids`` in line to lead round ``key`` (``leader_rank``), first first."""
    dht_key = round_key(run_id, key)
    return sorted(
        range(len(peer_ids)),
        key=lambda i: leader_rank(dht_key, PeerID.from_base58(peer_ids[i])),
    )


def in_process_delta(
    peer_ids: Sequence[str],
    numel: int,
    seeds: Sequence[int],
    weights: Sequence[float],
    codec: str,
    *,
    scales: Sequence[float] | None = None,
    max_weight: float = math.inf,
    reducing: str | None = None,
) -> torch.Tensor:
    """The in-process reducer's result on the same inputs, in group order.

    ``codec`` is a codec name, or ``"send/return"`` for a different return codec; peer
    ``i`` contributes ``scales[i]`` times its delta; weights are capped at ``max_weight``;
    ``reducing`` names the one peer that reduces the whole vector (the others' parts are
    empty), None: every peer reduces its part.
    """
    order = group_order(peer_ids)
    scales = scales or [1.0] * len(peer_ids)
    contributions = [
        Contribution(
            peer_ids[i],
            make_delta(numel, seeds[i]) * scales[i],
            weights[i],
            client=reducing is not None and peer_ids[i] != reducing,
        )
        for i in order
    ]
    send, _, back = codec.partition("/")
    reducer = InProcessReducer(get_codec(send), get_codec(back or send), max_weight=max_weight)
    return reducer.reduce(RoundKey(0, 1), contributions).result().delta


def sha(delta: torch.Tensor) -> str:
    """sha256 of a result's FP32 bytes, as the test peers report it."""
    return hashlib.sha256(delta.numpy().tobytes()).hexdigest()


def in_process_sha(
    peer_ids: Sequence[str], numel: int, seeds: Sequence[int], weights: Sequence[float], codec: str
) -> str:
    """sha256 of ``in_process_delta`` (no scales, no cap)."""
    return sha(in_process_delta(peer_ids, numel, seeds, weights, codec))


def partial_sha(
    peer_ids: Sequence[str],
    numel: int,
    seeds: Sequence[int],
    weights: Sequence[float],
    codec: str,
    excluded: int,
    own_part: bool = True,
) -> str:
    """sha256 when peer ``excluded`` is counted only in its own part (an excluded sender),
    or in no part (``own_part`` False: a member gone before it sent, its part re-reduced by
    the others); the parts are the whole group's."""
    c = get_codec(codec)
    order = group_order(peer_ids)
    spans = butterfly_parts(numel, len(order))
    result = torch.empty(numel)
    for reducer, (lo, hi) in enumerate(spans):
        own = own_part and order[reducer] == excluded
        members = [i for i in order if i != excluded or own]
        parts = [
            c.decode(c.encode(make_delta(numel, seeds[i])[lo:hi].contiguous())) for i in members
        ]
        mean = torch.empty(hi - lo)
        for a, b in chunk_spans(lo, hi):
            chunk = [part[a - lo : b - lo] for part in parts]
            mean[a - lo : b - lo] = robust_mean(
                chunk, [weights[i] for i in members], CLIP_FACTOR
            ).mean
        result[lo:hi] = c.decode(c.encode(mean))
    return hashlib.sha256(result.numpy().tobytes()).hexdigest()
