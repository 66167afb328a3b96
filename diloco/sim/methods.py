"""Model presets and the five synchronisation methods as DAG inputs (docs/design.md "The
simulator").

The paper's setting (Douillard et al., 2025, arXiv:2501.18512): 1B / 10B / 100B parameter
models with 24 / 48 / 108 layers whose inner step takes 0.1 / 0.8 / 4.9 seconds (about 60% MFU).
Every layer holds ``params / L`` parameters: the embedding and the output head are folded into
the layers evenly, not modelled as a separate fragment.

Compute split: a layer's forward takes ``f``; its backward takes ``2f`` (activations ``f`` and
weights ``f``, the usual "backward is twice the forward"), except layer 0 whose input needs no
gradient (weights only). One step is therefore ``(3L - 1) f`` seconds.

Wire bits of one reduction of one layer with ``M`` replicas: ``n * b * 2(M - 1)/M``, the
per-member traffic of a ring or butterfly all-reduce (``diloco.node.observe.traffic``). The widths
``b`` are settings; the defaults reproduce the paper's Table 4: 16 bits for data-parallel
gradients and for unquantised outer gradients, 4 for the FP4 ones. The paper does not state
the unquantised width, but its own rows give it: at every model size and CU target its
overlapped-FP4 row needs about a quarter of the overlapped row's bandwidth (3.4-4.8x on its
grid of 20.7% steps), where FP32 would make it an eighth. CU depends on the bits only through
``bits / bandwidth``, so halving a width halves a row's required bandwidth exactly. Our own
E3M0 codec sends 4.25 bits per value (``diloco.sim.accounting.CODEC_BITS``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from diloco.node.model.fragments import Pattern, fragment_blocks
from diloco.node.observe.traffic import DP_BITS, all_reduce_factor
from diloco.sim.dag import StepCompute, SyncPlan

Method = Literal["dp", "diloco", "streaming", "streaming-overlap", "streaming-overlap-fp4"]
METHODS: tuple[Method, ...] = get_args(Method)

OUTER_BITS = 16.0
"""Bits per unquantised outer-gradient value: 16, what the paper's rows imply (see above)."""
FP4_BITS = 4.0
"""Bits per outer-gradient value of ``streaming-overlap-fp4``: the paper's E3M0 without scales."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSpec:
    """A model as the simulator sees it: layers, parameters, compute seconds per step."""

    name: str
    num_layers: int
    """L: transformer blocks (embedding folded in)."""
    num_params: float
    """N: parameters, spread evenly over the layers."""
    step_seconds: float
    """Compute seconds of one inner step of one replica (no communication)."""

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {self.num_layers}")
        if not self.num_params > 0 or not self.step_seconds > 0:
            raise ValueError("num_params and step_seconds must be > 0")

    @property
    def params_per_layer(self) -> float:
        return self.num_params / self.num_layers


PRESETS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(name="1B", num_layers=24, num_params=1e9, step_seconds=0.1),
        ModelSpec(name="10B", num_layers=48, num_params=1e10, step_seconds=0.8),
        ModelSpec(name="100B", num_layers=108, num_params=1e11, step_seconds=4.9),
    )
}


@dataclass(frozen=True, kw_only=True, slots=True)
class SyncSettings:
    """The knobs shared by the methods; each method takes what applies to it."""

    sync_every: int = 100
    """H: inner steps between two syncs of one fragment (DiLoCo variants)."""
    fragment_size: int = 3
    """Layers per fragment for the streaming variants."""
    pattern: Pattern = "strided"
    """Which layers form a fragment (docs/design.md "Algorithm and schedule")."""
    tau: int = 1
    """Overlap in steps for the ``*-overlap`` methods (0 <= tau < H)."""
    num_replicas: int = 2
    """M: replicas in the all-reduce."""
    dp_bits: float = DP_BITS
    """Bits per gradient value for data-parallel (bf16)."""
    outer_bits: float = OUTER_BITS
    """Bits per outer-gradient value of ``diloco``, ``streaming``, ``streaming-overlap``."""
    fp4_bits: float = FP4_BITS
    """Bits per outer-gradient value of ``streaming-overlap-fp4`` (4.25: our E3M0 codec)."""

    def __post_init__(self) -> None:
        if self.num_replicas < 2:
            raise ValueError(f"need at least 2 replicas to reduce, got {self.num_replicas}")
        if not 0 <= self.tau < self.sync_every:
            raise ValueError(f"need 0 <= tau < H, got tau={self.tau}, H={self.sync_every}")
        if self.fragment_size < 1:
            raise ValueError(f"fragment_size must be >= 1, got {self.fragment_size}")
        if not min(self.dp_bits, self.outer_bits, self.fp4_bits) > 0:
            raise ValueError("dp_bits, outer_bits and fp4_bits must be > 0")

    @property
    def all_reduce_factor(self) -> float:
        """``2(M - 1)/M``: what each member sends per value reduced (ring or butterfly)."""
        return all_reduce_factor(self.num_replicas)


def step_compute(model: ModelSpec) -> StepCompute:
    """Per-layer compute seconds: forward ``f``, backward ``2f`` (``f`` for layer 0)."""
    f = model.step_seconds / (3 * model.num_layers - 1)
    layers = range(model.num_layers)
    return StepCompute(
        forward_seconds=tuple(f for _ in layers),
        backward_activation_seconds=tuple(0.0 if layer == 0 else f for layer in layers),
        backward_weight_seconds=tuple(f for _ in layers),
    )


def sync_plan(model: ModelSpec, method: Method, settings: SyncSettings) -> SyncPlan:
    """The DAG's reductions for one method (docs/design.md "The simulator").

    ``dp``: every layer every step at ``dp_bits``, the next forward waits. ``diloco``: the
    whole model every ``H`` steps at ``outer_bits``, blocking. ``streaming``: fragments of
    ``fragment_size`` layers at their offsets, blocking. ``streaming-overlap``: the same,
    received ``tau`` steps later. ``streaming-overlap-fp4``: the same at ``fp4_bits``.
    """
    all_layers: tuple[tuple[int, ...], ...] = (tuple(range(model.num_layers)),)
    if method == "dp":
        fragments, sync_every, tau, bits = all_layers, 1, 0, settings.dp_bits
    elif method == "diloco":
        fragments, sync_every, tau, bits = all_layers, settings.sync_every, 0, settings.outer_bits
    elif method in ("streaming", "streaming-overlap", "streaming-overlap-fp4"):
        fragments = tuple(
            tuple(blocks)
            for blocks in fragment_blocks(
                model.num_layers, settings.fragment_size, settings.pattern
            )
        )
        sync_every = settings.sync_every
        tau = 0 if method == "streaming" else settings.tau
        bits = settings.fp4_bits if method == "streaming-overlap-fp4" else settings.outer_bits
    else:
        raise ValueError(f"unknown method {method!r}; use one of {', '.join(METHODS)}")
    layer_bits = model.params_per_layer * bits * settings.all_reduce_factor
    return SyncPlan(
        fragments=fragments,
        sync_every=sync_every,
        tau=tau,
        wire_bits=tuple(layer_bits for _ in range(model.num_layers)),
    )
