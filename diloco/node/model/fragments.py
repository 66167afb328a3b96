"""Fragments of transformer blocks and their staggered sync schedule (docs/design.md "Algorithm and
schedule", 2.3).

Everything here is a pure function of the run configuration and the global step, like
nanoGPT's ``get_lr``: nodes agree on the schedule without talking, and ``diloco.sim``
reuses it. Names follow torchtitan/torchft: ``sync_every`` is H, ``fragment_sync_delay``
is the paper's tau.

Steps are counted from 1: step ``t`` is the ``t``-th inner optimizer step, and "at step t"
means at the end of it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Literal

from torch import nn

Pattern = Literal["strided", "sequential"]
EmbeddingPlacement = Literal["own", "first"]


def num_block_fragments(num_layers: int, fragment_size: int) -> int:
    """How many fragments the ``num_layers`` blocks form (the last may be smaller)."""
    if num_layers < 1 or fragment_size < 1:
        raise ValueError(
            f"need num_layers >= 1 and fragment_size >= 1, got {num_layers}, {fragment_size}"
        )
    return math.ceil(num_layers / fragment_size)


def fragment_blocks(num_layers: int, fragment_size: int, pattern: Pattern) -> list[list[int]]:
    """Block indices of each fragment (docs/design.md "Algorithm and schedule").

    ``strided``: fragment ``p`` holds blocks ``p, p+P, p+2P, ...``; ``sequential``: blocks
    ``p*fs .. p*fs+fs-1``. Every block is in exactly one fragment.
    """
    num = num_block_fragments(num_layers, fragment_size)
    if pattern == "strided":
        return [list(range(p, num_layers, num)) for p in range(num)]
    if pattern == "sequential":
        return [
            list(range(p * fragment_size, min((p + 1) * fragment_size, num_layers)))
            for p in range(num)
        ]
    raise ValueError(f"unknown fragment pattern {pattern!r}; use 'strided' or 'sequential'")


def model_fragments(
    model: nn.Module,
    blocks: nn.ModuleList,
    fragment_size: int,
    pattern: Pattern,
    embedding_fragment: EmbeddingPlacement = "own",
) -> list[list[tuple[str, nn.Parameter]]]:
    """Named parameters of each fragment, in a fixed order every node derives alike.

    Fragments ``0..P-1`` hold the blocks of ``fragment_blocks``; the parameters outside
    ``blocks`` (embedding, final norm, head) form fragment ``P`` (``"own"``) or join
    fragment 0 (``"first"``). Every parameter is in exactly one fragment; within a fragment
    parameters keep the model's ``named_parameters`` order.
    """
    block_of: dict[int, int] = {}
    for index, block in enumerate(blocks):
        for param in block.parameters():
            block_of[id(param)] = index
    groups = fragment_blocks(len(blocks), fragment_size, pattern)
    fragment_of_block = {b: p for p, group in enumerate(groups) for b in group}
    fragments: list[list[tuple[str, nn.Parameter]]] = [[] for _ in groups]
    outside: list[tuple[str, nn.Parameter]] = []
    for name, param in model.named_parameters():
        if id(param) in block_of:
            fragments[fragment_of_block[block_of[id(param)]]].append((name, param))
        else:
            outside.append((name, param))
    if embedding_fragment == "own":
        if outside:
            fragments.append(outside)
    elif embedding_fragment == "first":
        fragments[0] = outside + fragments[0]
    else:
        raise ValueError(f"unknown embedding_fragment {embedding_fragment!r}; use 'own' or 'first'")
    return fragments


def train_only(fragments: list[list[tuple[str, nn.Parameter]]], fragment: int) -> None:
    """Freeze every fragment but one: frozen parameters get no gradient, so AdamW skips them."""
    for p, params in enumerate(fragments):
        for _, param in params:
            param.requires_grad_(p == fragment)


def fragment_offset(fragment: int, sync_every: int, num_fragments: int) -> int:
    """``t_p = floor(p * H / F)``: the step phase of fragment ``p`` (docs/design.md "Algorithm and
    schedule")."""
    return (fragment * sync_every) // num_fragments


def send_round(step: int, fragment: int, sync_every: int, num_fragments: int) -> int | None:
    """Round ``k >= 1`` that fragment ``p`` sends at the end of ``step``, or ``None``.

    Fragment ``p`` sends at ``t_p + k*H`` for ``k >= 1``, so its first sync covers at least
    ``H`` steps.
    """
    since = step - fragment_offset(fragment, sync_every, num_fragments)
    if since >= sync_every and since % sync_every == 0:
        return since // sync_every
    return None


def send_step(fragment: int, round: int, sync_every: int, num_fragments: int) -> int:
    """The step at whose end round ``k`` of fragment ``p`` is sent."""
    return fragment_offset(fragment, sync_every, num_fragments) + round * sync_every


def last_sent_round(step: int, fragment: int, sync_every: int, num_fragments: int) -> int:
    """Round ``k`` of fragment ``p``'s last send at or before the end of ``step`` (0: none)."""
    return max(0, (step - fragment_offset(fragment, sync_every, num_fragments)) // sync_every)


def next_send_step(step: int, fragment: int, sync_every: int, num_fragments: int) -> int:
    """The first step at or after ``step`` at whose end fragment ``p`` sends."""
    offset = fragment_offset(fragment, sync_every, num_fragments)
    rounds = max(1, -(-(step - offset) // sync_every))  # ceil, and never round 0
    return offset + rounds * sync_every


def last_send(step: int, fragment: int, sync_every: int, num_fragments: int, steps: int) -> bool:
    """Whether fragment ``p``'s send at the end of ``step`` is its last in a run of ``steps``
    steps (its next send step lies beyond the run)."""
    return next_send_step(step + 1, fragment, sync_every, num_fragments) > steps


def next_synced_fragment(step: int, sync_every: int, num_fragments: int) -> int:
    """The fragment that sends first at or after ``step`` (FedPart order); a tie, possible
    only when ``F > H``, goes to the lower index."""
    return min(
        range(num_fragments), key=lambda p: next_send_step(step, p, sync_every, num_fragments)
    )


def sends_at(step: int, sync_every: int, num_fragments: int) -> Iterator[tuple[int, int]]:
    """``(fragment, round)`` pairs sent at the end of ``step``, in fragment order."""
    for fragment in range(num_fragments):
        round = send_round(step, fragment, sync_every, num_fragments)
        if round is not None:
            yield fragment, round


def max_in_flight(sync_every: int, num_fragments: int, tau: int) -> int:
    """Upper bound on rounds in flight at once: ``ceil(F / H * (tau + 1))`` (docs/design.md
    "Algorithm and schedule")."""
    return math.ceil(num_fragments / sync_every * (tau + 1))
