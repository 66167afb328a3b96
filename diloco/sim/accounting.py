"""Bandwidth accountant: bytes a whole run exchanges, and the peak rate it needs (docs/design.md
"The simulator").

For a run of ``D`` tokens with ``M`` replicas each taking ``B`` sequences of ``S`` tokens per
inner step, there are ``T = ceil(D / (M * B * S))`` inner steps. A reduction of ``n`` values at
``b`` bits costs each replica ``n * b * 2(M - 1)/M`` bits sent (and as many received), the
ring or butterfly all-reduce traffic (``diloco.node.observe.traffic``, which the node's run summary
uses too). Rounds per method, at the widths of ``RunSpec`` (defaults as in the simulator,
``diloco.sim.methods``):

- ``dp``: every step, all ``N`` parameters, ``dp_bits`` (bf16 gradients, 16);
- ``diloco``: ``floor(T / H)`` rounds of all ``N`` parameters, ``outer_bits`` (16);
- ``streaming`` and ``streaming-overlap``: fragment ``p`` sends at ``t_p + k*H <= T``
  (``diloco.node.model.fragments``), ``outer_bits``, ``N / L`` parameters per layer of the fragment;
- ``streaming-overlap-fp4``: the same rounds encoded with the run's codec (E3M0: 4.25 bits).

With ``max_group_size`` each round of the DiLoCo methods is staged over the
grid plan (``diloco.sim.staged_traffic``): about ``2(g-1)/g`` per stage instead of
``2(M-1)/M`` once, i.e. more bytes for far fewer streams; ``dp`` stays one flat ring.

Peak rate: the largest round's bits over the time it has before its result is needed, one
step for the blocking methods (for ``dp`` the next step's forward) and ``tau + 1`` steps with
overlap. This is the bandwidth that keeps the link from being the bottleneck when rounds are
spread evenly; the simulator (``diloco.sim.dag``) answers the exact CU question.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from diloco.node.model.fragments import fragment_blocks, fragment_offset
from diloco.node.observe.traffic import (
    DP_BITS,
    all_reduce_bytes,
    all_reduce_factor,
    data_parallel_bytes,
)
from diloco.sim.methods import METHODS, OUTER_BITS, Method
from diloco.sim.staged_traffic import staged_traffic

CODEC_BITS: dict[str, float] = {
    "none": 32.0,
    "bf16": 16.0,
    "fp16": 16.0,
    "int8": 8.5,  # one FP32 scale per block of 64 values (diloco.codecs.int8)
    "e3m0": 4.25,  # 4-bit codes plus one scale byte per block of 32 values
}
"""Bits on the wire per value for each codec (docs/design.md "Codecs")."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RunSpec:
    """A training run as the accountant sees it."""

    num_params: float
    """N: parameters, spread evenly over the layers."""
    num_layers: int
    """L: transformer blocks; fragments are groups of ``fragment_size`` of them."""
    num_tokens: float
    """D: training tokens over the whole run, all replicas together."""
    batch_size: int
    """Sequences per replica per inner step."""
    seq_len: int
    """Tokens per sequence."""
    num_replicas: int
    """M: replicas in each all-reduce."""
    sync_every: int
    """H: inner steps between two syncs of one fragment."""
    fragment_size: int
    """Layers per streaming fragment."""
    tau: int
    """Overlap in steps for the ``*-overlap`` methods."""
    codec: str
    """Codec of ``streaming-overlap-fp4`` (a key of ``CODEC_BITS``)."""
    step_seconds: float
    """Compute seconds of one inner step, for rates."""
    dp_bits: float = DP_BITS
    """Bits per gradient value of ``dp``."""
    outer_bits: float = OUTER_BITS
    """Bits per outer-gradient value of ``diloco``, ``streaming`` and ``streaming-overlap``."""
    max_group_size: int | None = None
    """Bounded groups: rounds of the DiLoCo methods run in stages of at most this many
    members (``diloco.protocol.staged.grid``); None: one flat group of all ``M`` replicas."""

    def __post_init__(self) -> None:
        if not min(self.dp_bits, self.outer_bits) > 0:
            raise ValueError("dp_bits and outer_bits must be > 0")
        if self.codec not in CODEC_BITS:
            raise ValueError(f"unknown codec {self.codec!r}; use one of {', '.join(CODEC_BITS)}")
        if self.max_group_size is not None and self.max_group_size < 2:
            raise ValueError(f"max_group_size must be >= 2, got {self.max_group_size}")
        if self.num_replicas < 2:
            raise ValueError(f"need at least 2 replicas to reduce, got {self.num_replicas}")
        if not 0 <= self.tau < self.sync_every:
            raise ValueError(f"need 0 <= tau < H, got tau={self.tau}, H={self.sync_every}")
        if min(self.num_layers, self.batch_size, self.seq_len, self.fragment_size) < 1:
            raise ValueError("num_layers, batch_size, seq_len and fragment_size must be >= 1")
        if not (self.num_params > 0 and self.num_tokens > 0 and self.step_seconds > 0):
            raise ValueError("num_params, num_tokens and step_seconds must be > 0")

    @property
    def num_steps(self) -> int:
        """T: inner steps of every replica."""
        return math.ceil(self.num_tokens / (self.num_replicas * self.batch_size * self.seq_len))


@dataclass(frozen=True, kw_only=True, slots=True)
class Traffic:
    """What one method costs over the run."""

    method: Method
    bits_per_value: float
    num_rounds: int
    """All-reduces one replica takes part in (one per fragment round)."""
    bytes_per_replica: float
    """Bytes one replica sends over the run (it receives as many)."""
    bytes_total: float
    """Bytes sent by all replicas together."""
    peak_gbps: float
    """Largest round over the time it may take (see the module docstring), Gbit/s."""
    mean_gbps: float
    """Bits one replica sends over the run's compute time, Gbit/s."""
    bytes_vs_dp: float
    """Data-parallel bytes divided by this method's bytes."""
    peak_vs_dp: float
    """Data-parallel peak divided by this method's peak."""


def account(run: RunSpec) -> list[Traffic]:
    """Traffic of every method in ``METHODS`` order, ``dp`` first."""
    m = run.num_replicas
    params_per_layer = run.num_params / run.num_layers
    steps = run.num_steps
    fragments = fragment_blocks(run.num_layers, run.fragment_size, "strided")
    # (values reduced per round, rounds) for each fragment of each schedule.
    whole_model = [(run.num_params, steps // run.sync_every)]
    streaming = [
        (
            params_per_layer * len(blocks),
            max(0, (steps - fragment_offset(p, run.sync_every, len(fragments))) // run.sync_every),
        )
        for p, blocks in enumerate(fragments)
    ]
    schedules: dict[Method, tuple[list[tuple[float, int]], float, int]] = {
        "dp": ([(run.num_params, steps)], run.dp_bits, 0),
        "diloco": (whole_model, run.outer_bits, 0),
        "streaming": (streaming, run.outer_bits, 0),
        "streaming-overlap": (streaming, run.outer_bits, run.tau),
        "streaming-overlap-fp4": (streaming, CODEC_BITS[run.codec], run.tau),
    }
    # Bytes one replica sends per value reduced, per bit of width / 8.
    factor = (
        all_reduce_factor(m)
        if run.max_group_size is None
        else staged_traffic(1.0, 8.0, m, run.max_group_size).bytes_sent
    )
    raw = []
    for method in METHODS:
        rounds, bits, tau = schedules[method]
        if method == "dp":
            sent = data_parallel_bytes(
                num_params=run.num_params, steps=steps, num_replicas=m, bits=bits
            ).bytes_sent
        else:
            sent = sum(n * bits / 8 * factor * k for n, k in rounds)
        if method == "dp":
            largest = all_reduce_bytes(max(n for n, _ in rounds), bits, m) * 8
        else:
            largest = max(n for n, _ in rounds) * bits * factor
        raw.append(
            (
                method,
                bits,
                sum(k for _, k in rounds),
                sent,
                largest / ((tau + 1) * run.step_seconds),
            )
        )
    dp_bytes, dp_peak = raw[0][3], raw[0][4]
    return [
        Traffic(
            method=method,
            bits_per_value=bits,
            num_rounds=num_rounds,
            bytes_per_replica=per_replica,
            bytes_total=per_replica * run.num_replicas,
            peak_gbps=peak / 1e9,
            mean_gbps=per_replica * 8 / (steps * run.step_seconds) / 1e9,
            bytes_vs_dp=dp_bytes / per_replica if per_replica else math.inf,
            peak_vs_dp=dp_peak / peak,
        )
        for method, bits, num_rounds, per_replica, peak in raw
    ]
