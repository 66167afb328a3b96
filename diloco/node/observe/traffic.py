"""Bytes on the wire of an all-reduce, and what data-parallel training would send (docs/design.md
"The round", 6).

One estimate shared by the node's run summary and the simulator's accountant
(``diloco.sim.accounting``), so the two never disagree. It lives in ``node`` because ``sim``
imports from ``node`` and never the other way (STYLE, "sim/"); it imports nothing of ours.

Cost model (``diloco.protocol.core.partition``): reducing ``n`` values of ``b`` bits among ``M``
members, each member sends ``n * b * 2(M - 1)/M`` bits and receives as many, the traffic of
a ring or butterfly all-reduce (Patarasuk and Yuan, 2009). Data-parallel reduces every
parameter's gradient at every inner step; the paper's gradients travel in bf16 (Douillard
et al., 2025, arXiv:2501.18512, Table 1: its 400x fewer bits than data-parallel at H = 100
with 4-bit outer gradients means 16-bit gradients).
"""

from __future__ import annotations

from dataclasses import dataclass

DP_BITS = 16.0
"""Bits per gradient value of data-parallel training (bf16, as in the paper)."""


def all_reduce_factor(num_replicas: int) -> float:
    """``2(M - 1)/M``: values each member sends per value reduced (ring or butterfly)."""
    if num_replicas < 1:
        raise ValueError(f"an all-reduce needs at least 1 member, got {num_replicas}")
    return 2 * (num_replicas - 1) / num_replicas


def all_reduce_bytes(num_values: float, bits: float, num_replicas: int) -> float:
    """Bytes one member sends to reduce ``num_values`` values of ``bits`` bits."""
    return num_values * bits / 8 * all_reduce_factor(num_replicas)


@dataclass(frozen=True, kw_only=True, slots=True)
class DataParallelBytes:
    """What one replica of a data-parallel run would send, and the assumption behind it."""

    bytes_sent: float
    """Bytes one replica sends over the run (it receives as many)."""
    assumption: str
    """The formula with its numbers, to print or record next to the figure."""


def data_parallel_bytes(
    *, num_params: float, steps: int, num_replicas: int, bits: float = DP_BITS
) -> DataParallelBytes:
    """Bytes one replica sends if ``num_replicas`` replicas all-reduce every gradient at every
    one of ``steps`` steps, at ``bits`` bits per value."""
    if num_params < 0 or steps < 0 or not bits > 0:
        raise ValueError("need num_params >= 0, steps >= 0 and bits > 0")
    factor = all_reduce_factor(num_replicas)
    per_step = all_reduce_bytes(num_params, bits, num_replicas)
    return DataParallelBytes(
        bytes_sent=per_step * steps,
        assumption=(
            f"{num_params:.6g} parameters x {bits:g} bits / 8 x 2(M-1)/M = {factor:.4g} "
            f"(ring all-reduce, M = {num_replicas}) x {steps} steps: {bits:g}-bit gradients "
            "reduced every step, bytes one replica sends"
        ),
    )
