"""Butterfly split of one fragment's vector into per-reducer parts (docs/design.md "The round").

Pure planning, no I/O. Cost model: with ``M`` members and a vector of ``n`` values encoded
at ``b`` bits each, member ``j`` receives ``(M - 1)`` copies of its part (scatter phase) and
sends its averaged part ``M - 1`` times (gather phase), so a member's traffic is about
``2 * (M - 1) / M * n * b`` bits when the parts are equal. Parts proportional to announced
bandwidth shift work to the fast members (hivemind's ``load_balancing`` does the same).

Part boundaries are multiples of ``PART_ALIGN`` values, which every codec's block size
divides: encoding part by part then gives exactly the bytes of encoding the whole vector,
so the in-process reducer and the swarm agree bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence

PART_ALIGN = 256


def butterfly_parts(
    numel: int, num_parts: int, weights: Sequence[float] | None = None, align: int = PART_ALIGN
) -> list[tuple[int, int]]:
    """Cut ``range(numel)`` into ``num_parts`` contiguous ``(start, end)`` spans.

    Spans are aligned to ``align`` values (the last one ends at ``numel``) and sized in
    proportion to ``weights`` (default equal). A span may be empty when the vector is small;
    a weight of 0 gives an empty span (a client, which reduces no part), at least one
    weight must be positive.
    """
    if num_parts < 1:
        raise ValueError(f"num_parts must be >= 1, got {num_parts}")
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    if weights is None:
        weights = [1.0] * num_parts
    if (
        len(weights) != num_parts
        or any(not w >= 0 for w in weights)
        or not any(w > 0 for w in weights)
    ):
        raise ValueError(f"need {num_parts} weights >= 0, one positive, got {list(weights)}")
    num_blocks = -(-numel // align)
    total = float(sum(weights))
    spans: list[tuple[int, int]] = []
    cumulative = 0.0
    start_block = 0
    for weight in weights:
        cumulative += weight
        end_block = round(num_blocks * cumulative / total)
        spans.append((min(start_block * align, numel), min(end_block * align, numel)))
        start_block = end_block
    return spans


def substitute(part: int, num_members: int, clients: Sequence[bool] = ()) -> int | None:
    """The member that re-reduces part ``part`` when its reducer fails:
    the next member in group order that is not a client (nobody may be able to dial a
    client), so every member derives the same one without talking. Group order is sorted
    peer ids, which the round key's group id fixes: no member can pick the substitute of
    its choice. None when every other member is a client: the part cannot be re-reduced."""
    if num_members < 2 or not 0 <= part < num_members:
        raise ValueError(f"no substitute for part {part} of {num_members} members")
    for step in range(1, num_members):
        s = (part + step) % num_members
        if not (clients and clients[s]):
            return s
    return None
