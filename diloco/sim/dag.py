"""The schedule DAG of one replica: a compute chain and one FIFO link (docs/design.md "The
simulator").

Streaming DiLoCo (Douillard et al., 2025, arXiv:2501.18512, the simulation behind its Figure
4) estimates compute utilisation (CU) with a simulated schedule. One inner step of one replica
is a chain of per-layer compute nodes: forward for layers ``0..L-1``, then for ``l = L-1..0``
the backward with respect to the activations (absent for layer 0) and the backward with
respect to the weights. With one reduction node per layer that makes ``4L - 1`` nodes per
step. A layer's reduction may start once its weight gradient (data-parallel) or its outer
gradient (DiLoCo variants) is ready, i.e. at the end of its weight-backward in the send step
``s``; it occupies the one link for ``wire_bits / bandwidth`` seconds, transfers queue first
in, first out, and the forward of that layer in step ``s + tau + 1`` (the first step after the
receive step ``s + tau`` of docs/design.md "Algorithm and schedule") cannot start before the
reduction ends. A reduction may first wait ``pre_seconds`` off the link (a real round's matchmaking,
latency and stream set-up) before it takes its turn on the link.

Every node's time is a max-plus expression of earlier ones, so the simulation is exact and
deterministic. The compute chain is one device, so weight gradients become ready in a fixed
order whatever the bandwidth: the link order is static, and one pass evaluates a whole
vector of bandwidths at once (numpy arrays over the bandwidth axis, shape ``(B,)``).

Pure: no I/O. Only the schedule functions of ``diloco.node.model.fragments`` are reused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
from numpy.typing import ArrayLike, NDArray

from diloco.node.model.fragments import sends_at

NodeKind = Literal["forward", "backward_activation", "backward_weight", "reduction"]
BITS_PER_GIGABIT = 1e9


@dataclass(frozen=True, kw_only=True, slots=True)
class StepCompute:
    """Seconds of each compute node of one inner step, per layer (index 0 is the first layer)."""

    forward_seconds: tuple[float, ...]
    """Forward of each layer."""
    backward_activation_seconds: tuple[float, ...]
    """Backward with respect to the activations; must be 0 for layer 0 (nothing to feed)."""
    backward_weight_seconds: tuple[float, ...]
    """Backward with respect to the weights; the layer's gradient is ready at its end."""

    def __post_init__(self) -> None:
        n = len(self.forward_seconds)
        if n < 1:
            raise ValueError("need at least one layer")
        if len(self.backward_activation_seconds) != n or len(self.backward_weight_seconds) != n:
            raise ValueError(
                "forward, backward_activation and backward_weight need one entry per layer"
            )
        durations = (
            *self.forward_seconds,
            *self.backward_activation_seconds,
            *self.backward_weight_seconds,
        )
        if any(not (d >= 0 and np.isfinite(d)) for d in durations):
            raise ValueError("compute seconds must be finite and >= 0")
        if self.backward_activation_seconds[0] != 0:
            raise ValueError("layer 0 has no backward with respect to activations; set it to 0")

    @property
    def num_layers(self) -> int:
        return len(self.forward_seconds)

    @property
    def step_seconds(self) -> float:
        """Compute seconds of one step: the numerator of CU."""
        return (
            sum(self.forward_seconds)
            + sum(self.backward_activation_seconds)
            + sum(self.backward_weight_seconds)
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class SyncPlan:
    """Which layers are reduced when, and how many bits each reduction puts on the link.

    Data-parallel is ``sync_every = 1`` with one fragment holding every layer and ``tau = 0``;
    DiLoCo is one fragment every ``H`` steps; Streaming DiLoCo has several fragments whose
    send steps follow ``diloco.node.model.fragments.sends_at`` (offsets ``floor(p * H / F)``).
    """

    fragments: tuple[tuple[int, ...], ...]
    """Layer indices of each fragment; every layer in exactly one fragment."""
    sync_every: int
    """H: inner steps between two sends of one fragment."""
    tau: int
    """Steps between send and receive: the forward of step ``s + tau + 1`` waits."""
    wire_bits: tuple[float, ...]
    """Per layer: bits one replica puts on its link to reduce that layer once (codec and
    all-reduce factor included)."""
    pre_seconds: tuple[float, ...] = ()
    """Per layer: seconds between the gradient being ready and its transfer starting that do
    not occupy the link (matchmaking, latency, stream set-up; ``diloco.sim.round_costs``);
    empty: none."""

    def __post_init__(self) -> None:
        layers = sorted(layer for fragment in self.fragments for layer in fragment)
        if layers != list(range(len(self.wire_bits))):
            raise ValueError(
                "fragments must cover layers 0..L-1 exactly once (one wire_bits entry per layer)"
            )
        if self.sync_every < 1:
            raise ValueError(f"sync_every (H) must be >= 1, got {self.sync_every}")
        if not 0 <= self.tau < self.sync_every:
            raise ValueError(f"need 0 <= tau < H, got tau={self.tau}, H={self.sync_every}")
        if any(not (b >= 0 and np.isfinite(b)) for b in self.wire_bits):
            raise ValueError("wire_bits must be finite and >= 0")
        if self.pre_seconds and len(self.pre_seconds) != len(self.wire_bits):
            raise ValueError("pre_seconds needs one entry per layer (or none)")
        if any(not (d >= 0 and np.isfinite(d)) for d in self.pre_seconds):
            raise ValueError("pre_seconds must be finite and >= 0")


@dataclass(frozen=True, slots=True)
class Interval:
    """One node of the schedule, as drawn in a Gantt chart (seconds from the start)."""

    kind: NodeKind
    layer: int
    step: int
    start: float
    end: float


@dataclass(frozen=True, slots=True)
class Schedule:
    """Result of :func:`simulate`."""

    step_starts: NDArray[np.float64]
    """``(num_steps, B)``: row ``s - 1`` is when the forward of layer 0 in step ``s`` starts."""
    end: NDArray[np.float64]
    """``(B,)``: when the last node (compute or reduction) ends."""
    intervals: tuple[Interval, ...]
    """Every node with its times; only filled when recording (one bandwidth)."""


def simulate(
    compute: StepCompute,
    plan: SyncPlan,
    bandwidth_gbps: ArrayLike,
    num_steps: int,
    *,
    record: bool = False,
) -> Schedule:
    """Run steps ``1..num_steps`` of the schedule at each bandwidth (Gbit/s, shape ``(B,)``).

    ``record=True`` also returns every node as an :class:`Interval` (one bandwidth only).
    """
    if len(plan.wire_bits) != compute.num_layers:
        raise ValueError(f"plan has {len(plan.wire_bits)} layers, compute has {compute.num_layers}")
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    bandwidth = np.atleast_1d(np.asarray(bandwidth_gbps, dtype=np.float64))  # (B,)
    if bandwidth.ndim != 1 or not np.all(bandwidth > 0):
        raise ValueError("bandwidths must be a 1-D sequence of positive Gbit/s")
    if record and bandwidth.shape[0] != 1:
        raise ValueError("recording intervals needs exactly one bandwidth")

    num_layers = compute.num_layers
    link_seconds = [bits / (bandwidth * BITS_PER_GIGABIT) for bits in plan.wire_bits]  # L x (B,)
    pre = plan.pre_seconds or (0.0,) * num_layers
    # Backward chain, fixed within a step: seconds after the forward ends at which each
    # backward node starts, and when each layer's weight gradient is ready.
    backward: list[tuple[NodeKind, int, float, float]] = []
    ready_after = [0.0] * num_layers
    offset = 0.0
    for layer in reversed(range(num_layers)):
        if layer > 0:
            seconds = compute.backward_activation_seconds[layer]
            backward.append(("backward_activation", layer, offset, offset + seconds))
            offset += seconds
        seconds = compute.backward_weight_seconds[layer]
        backward.append(("backward_weight", layer, offset, offset + seconds))
        offset += seconds
        ready_after[layer] = offset
    backward_seconds = offset
    # Link order inside one send step: by readiness (last layer first), then by layer index.
    link_order = sorted(range(num_layers), key=lambda layer: (ready_after[layer], layer))
    num_fragments = len(plan.fragments)
    fragment_of = {layer: p for p, fragment in enumerate(plan.fragments) for layer in fragment}

    intervals: list[Interval] = []
    waits: dict[int, dict[int, NDArray[np.float64]]] = {}  # step -> layer -> reduction end
    chain = np.zeros_like(bandwidth)  # the device is free from this time on
    link = np.zeros_like(bandwidth)  # the link is free from this time on
    step_starts = np.empty((num_steps, bandwidth.shape[0]))
    for step in range(1, num_steps + 1):
        step_waits = waits.pop(step, {})
        t = chain
        pending = 0.0  # seconds of forward since t with no wait in between (a scalar add)
        for layer in range(num_layers):
            arrival = step_waits.get(layer)
            if arrival is not None:
                t = np.maximum(t + pending, arrival)
                pending = 0.0
            if layer == 0:
                step_starts[step - 1] = t + pending
            if record:
                start = float(t[0]) + pending
                intervals.append(
                    Interval("forward", layer, step, start, start + compute.forward_seconds[layer])
                )
            pending += compute.forward_seconds[layer]
        forward_end = t + pending
        chain = forward_end + backward_seconds
        if record:
            base = float(forward_end[0])
            intervals.extend(
                Interval(kind, layer, step, base + a, base + b) for kind, layer, a, b in backward
            )

        sending = {p for p, _round in sends_at(step, plan.sync_every, num_fragments)}
        if not sending:
            continue
        arrivals = waits.setdefault(step + plan.tau + 1, {})
        for layer in link_order:
            if fragment_of[layer] not in sending:
                continue
            start_link = np.maximum(link, forward_end + ready_after[layer] + pre[layer])
            link = start_link + link_seconds[layer]
            arrivals[layer] = link
            if record:
                intervals.append(
                    Interval("reduction", layer, step, float(start_link[0]), float(link[0]))
                )
    # Reductions still queued at the end belong to the horizon too.
    end = np.maximum(chain, link)
    return Schedule(step_starts=step_starts, end=end, intervals=tuple(intervals))


def compute_utilisation(
    compute: StepCompute,
    plan: SyncPlan,
    bandwidth_gbps: ArrayLike,
    *,
    warmup_periods: int = 2,
    periods: int = 4,
) -> NDArray[np.float64]:
    """CU = compute time / wall time over ``periods`` sync periods of ``H`` steps.

    The window starts after ``warmup_periods`` periods (the first ``H`` steps have no sync, and
    queues need a period or two to settle) and runs from the start of step ``W*H + 1`` to the
    start of step ``(W + K)*H + 1``; every fragment syncs exactly once per period, so the window
    holds each fragment's blocking ``K`` times, as in a long run.
    """
    if warmup_periods < 1 or periods < 1:
        raise ValueError("need warmup_periods >= 1 and periods >= 1")
    first = warmup_periods * plan.sync_every + 1
    last = (warmup_periods + periods) * plan.sync_every
    starts = simulate(compute, plan, bandwidth_gbps, last + 1).step_starts
    wall: NDArray[np.float64] = starts[last] - starts[first - 1]  # start(last+1) - start(first)
    return (last - first + 1) * compute.step_seconds / wall
