"""Entry points of ``diloco-node simulate``, ``simulate-swarm`` and ``accounting``.

Each takes plain values from the command line, runs the pure simulator or accountant, draws
the requested figures (``diloco.sim.plots``) and returns text for the terminal; the CLI only
parses options, reads the metrics file and writes the JSON.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from diloco.node.model.fragments import send_step
from diloco.node.observe.traffic import DP_BITS, data_parallel_bytes
from diloco.sim import plots
from diloco.sim.accounting import RunSpec, account
from diloco.sim.dag import Interval, StepCompute, SyncPlan, compute_utilisation, simulate
from diloco.sim.methods import (
    METHODS,
    OUTER_BITS,
    PRESETS,
    Method,
    ModelSpec,
    SyncSettings,
    step_compute,
    sync_plan,
)
from diloco.sim.metrics import MeasuredRun, measured_schedule, parse_metrics
from diloco.sim.protocol_sim import Rule, SwarmSpec, summarise
from diloco.sim.round_costs import measured_cu, predict_cu
from diloco.sim.staged_traffic import staged_traffic
from diloco.sim.sweep import DEFAULT_TARGETS, bandwidth_grid, required_bandwidth

Scenario = tuple[StepCompute, SyncPlan]
MEASURED = "measured"
"""Name of the one scenario simulated from a node's metrics."""


def resolve_model(
    name: str,
    *,
    num_layers: int | None = None,
    num_params: float | None = None,
    step_seconds: float | None = None,
) -> ModelSpec:
    """A preset (1B, 10B, 100B) with optional overrides, or ``custom`` with all three given."""
    if name == "custom":
        if num_layers is None or num_params is None or step_seconds is None:
            raise ValueError("--model custom needs --layers, --params and --step-time")
        return ModelSpec(
            name="custom", num_layers=num_layers, num_params=num_params, step_seconds=step_seconds
        )
    if name not in PRESETS:
        raise ValueError(f"unknown model {name!r}; use one of {', '.join(PRESETS)} or custom")
    overrides: dict[str, Any] = {
        key: value
        for key, value in (
            ("num_layers", num_layers),
            ("num_params", num_params),
            ("step_seconds", step_seconds),
        )
        if value is not None
    }
    return dataclasses.replace(PRESETS[name], **overrides)


def timeline_steps(plan: SyncPlan) -> range:
    """A few steps around fragment 0's first round: the one before it to two after receive."""
    first_send = send_step(0, 1, plan.sync_every, len(plan.fragments))
    return range(max(1, first_send - 1), first_send + plan.tau + 3)


def timeline(compute: StepCompute, plan: SyncPlan, bandwidth_gbps: float) -> list[Interval]:
    """Every node of the steps of :func:`timeline_steps`, times shifted to start at 0."""
    steps = timeline_steps(plan)
    recorded = simulate(compute, plan, [bandwidth_gbps], steps[-1], record=True).intervals
    shown = [i for i in recorded if i.step in steps]
    origin = min(i.start for i in shown)
    return [dataclasses.replace(i, start=i.start - origin, end=i.end - origin) for i in shown]


@dataclass(frozen=True, kw_only=True, slots=True)
class SimulateRequest:
    """What ``diloco-node simulate`` was asked for."""

    model: str = "1B"
    """A preset name or ``custom`` (ignored with ``metrics_lines``)."""
    num_layers: int | None = None
    num_params: float | None = None
    step_seconds: float | None = None
    """Overrides of the preset; all three required for ``custom``."""
    methods: tuple[Method, ...] = METHODS
    settings: SyncSettings = field(default_factory=SyncSettings)
    """H, fragments, tau, M and the bit widths ``dp_bits``, ``outer_bits``, ``fp4_bits``."""
    bandwidth_gbps: float | None = None
    """CU at this one bandwidth (Gbit/s); also the bandwidth of the timeline."""
    targets: tuple[float, ...] | None = None
    """CU targets for the required-bandwidth table; the default table when nothing is asked."""
    plot_path: str | None = None
    timeline_path: str | None = None
    metrics_lines: Sequence[str] | None = None
    """A node's JSON-lines metrics (``diloco.sim.metrics``): simulate that run instead."""
    rtt_ms: float | None = None
    """With ``metrics_lines``: also predict that run at this much more round-trip time."""


@dataclass(frozen=True, slots=True)
class SimulateReport:
    text: str
    required: dict[str, Any] | None
    """``{"targets": [...], "required_gbps": {name: [Gbit/s or None per target]}}``."""


def _describe_model(model: ModelSpec, settings: SyncSettings) -> str:
    return (
        f"model {model.name}: {model.num_layers} layers, {model.num_params:.3g} parameters "
        f"({model.params_per_layer:.3g} per layer, embedding folded in), "
        f"{model.step_seconds:g} s per step; H={settings.sync_every}, fragment size "
        f"{settings.fragment_size} ({settings.pattern}), tau={settings.tau}, "
        f"M={settings.num_replicas} replicas; bits per value dp/outer/fp4: "
        f"{settings.dp_bits:g}/{settings.outer_bits:g}/{settings.fp4_bits:g}"
    )


def _describe_measured(run: MeasuredRun) -> str:
    per_round = ", ".join(f"{b / 1e6:.3g}" for b in run.wire_bytes)
    return (
        f"measured run: {run.num_steps} steps of {run.step_seconds:.4g} s (median), "
        f"{run.num_rounds} rounds, H={run.sync_every}, {run.num_fragments} fragments, "
        f"tau={run.tau}, codec {run.codec}\n"
        f"MB on the wire per round, by fragment: {per_round}\n"
        f"observed link rate: {run.observed_gbps:.4g} Gbit/s"
    )


def _round_cost_lines(
    metrics: Sequence[str], bandwidth_gbps: float | None, rtt_ms: float | None
) -> list[str]:
    """Measured CU and the CU predicted with the per-round costs (``round_costs``)."""
    measured = measured_cu(metrics)
    predicted = predict_cu(metrics)
    lines = [
        f"with per-round costs (steady state: after step {measured.steady_from_step}):",
        f"  {'':<22}{'whole run':>10}{'steady':>10}",
    ]
    rows = [("measured", measured), ("predicted", predicted)]
    if bandwidth_gbps is not None:
        rows.append(
            (f"predicted at {bandwidth_gbps:g} Gbit/s", predict_cu(metrics, bandwidth_gbps))
        )
    if rtt_ms is not None:
        at_rtt = predict_cu(metrics, bandwidth_gbps, rtt_seconds=rtt_ms / 1000)
        rows.append((f"predicted, +{rtt_ms:g} ms RTT", at_rtt))
    for name, cu in rows:
        steady = "-" if cu.steady is None else f"{cu.steady:.4f}"
        lines.append(f"  {name:<22}{cu.whole:>10.4f}{steady:>10}")
    return lines


def _format_gbps(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def simulate_report(request: SimulateRequest) -> SimulateReport:
    """Simulate each method (or the measured run) and answer what was asked."""
    if request.timeline_path is not None and request.bandwidth_gbps is None:
        raise ValueError("--timeline draws the schedule at one bandwidth: give --bandwidth")
    if request.plot_path is not None or request.timeline_path is not None:
        try:
            plots.require_matplotlib()  # before the work, not after it
        except plots.PlotsUnavailable as error:
            raise ValueError(f"--plot and --timeline: {error}") from error
    lines: list[str] = []
    scenarios: dict[str, Scenario]
    if request.metrics_lines is not None:
        run = parse_metrics(request.metrics_lines)
        scenarios = {MEASURED: measured_schedule(run)}
        lines.append(_describe_measured(run))
        title = f"measured run ({run.num_fragments} fragments, H={run.sync_every})"
        if np.isfinite(run.observed_gbps):
            compute, plan = scenarios[MEASURED]
            cu = compute_utilisation(compute, plan, [run.observed_gbps])[0]
            lines.append(f"transfers only, CU at the observed rate: {cu:.4f}")
        lines += _round_cost_lines(request.metrics_lines, request.bandwidth_gbps, request.rtt_ms)
    else:
        model = resolve_model(
            request.model,
            num_layers=request.num_layers,
            num_params=request.num_params,
            step_seconds=request.step_seconds,
        )
        scenarios = {
            method: (step_compute(model), sync_plan(model, method, request.settings))
            for method in request.methods
        }
        lines.append(_describe_model(model, request.settings))
        title = f"{model.name}: H={request.settings.sync_every}, tau={request.settings.tau}"
    width = max(len(name) for name in scenarios) + 2

    if request.bandwidth_gbps is not None:
        lines.append(f"CU at {request.bandwidth_gbps:g} Gbit/s:")
        for name, (compute, plan) in scenarios.items():
            cu = compute_utilisation(compute, plan, [request.bandwidth_gbps])[0]
            lines.append(f"  {name:<{width}}{cu:.4f}")

    targets = request.targets
    if targets is None and request.bandwidth_gbps is None:
        targets = DEFAULT_TARGETS
    required: dict[str, Any] | None = None
    grid = bandwidth_grid(1e-4, 1e5)
    curves = (
        {
            name: compute_utilisation(compute, plan, grid)
            for name, (compute, plan) in scenarios.items()
        }
        if targets is not None or request.plot_path is not None
        else {}
    )
    if targets is not None:
        table = {name: required_bandwidth(grid, cu, targets) for name, cu in curves.items()}
        required = {"targets": list(targets), "required_gbps": table}
        lines.append(
            "Gbit/s needed to reach a CU of (lowest point of a log grid, "
            f"{grid[1] / grid[0] - 1:.1%} steps; '-' = not below {grid[-1]:g}):"
        )
        lines.append(f"  {'':<{width}}" + "".join(f"{f'{t * 100:g}%':>9}" for t in targets))
        for name, values in table.items():
            lines.append(f"  {name:<{width}}" + "".join(f"{_format_gbps(v):>9}" for v in values))
        if "dp" in table and "streaming-overlap-fp4" in table:
            ratios = [
                _format_gbps(dp / fp4) if dp is not None and fp4 is not None else "-"
                for dp, fp4 in zip(table["dp"], table["streaming-overlap-fp4"], strict=True)
            ]
            lines.append(f"  {'dp / fp4':<{width}}" + "".join(f"{r:>9}" for r in ratios))

    if request.plot_path is not None:
        plots.plot_cu_curves(request.plot_path, grid, curves, title=title, targets=targets or ())
        lines.append(f"wrote {request.plot_path}")
    if request.timeline_path is not None and request.bandwidth_gbps is not None:
        timelines = {
            name: timeline(compute, plan, request.bandwidth_gbps)
            for name, (compute, plan) in scenarios.items()
        }
        plots.plot_timeline(
            request.timeline_path, timelines, title=f"{title}, {request.bandwidth_gbps:g} Gbit/s"
        )
        lines.append(f"wrote {request.timeline_path}")
    return SimulateReport(text="\n".join(lines), required=required)


def accounting_report(
    *,
    model: str,
    num_tokens: float | None,
    batch_size: int,
    seq_len: int,
    num_replicas: int,
    sync_every: int,
    fragment_size: int,
    tau: int,
    codec: str,
    num_layers: int | None = None,
    num_params: float | None = None,
    step_seconds: float | None = None,
    dp_bits: float = DP_BITS,
    outer_bits: float = OUTER_BITS,
    max_group_size: int | None = None,
) -> str:
    """The accountant's table for one run, as text; ``num_tokens=None`` means ``20 N``
    (Chinchilla). ``codec`` sets the quantised row's bits, ``dp_bits`` and ``outer_bits`` the
    others'."""
    spec = resolve_model(
        model, num_layers=num_layers, num_params=num_params, step_seconds=step_seconds
    )
    run = RunSpec(
        num_params=spec.num_params,
        num_layers=spec.num_layers,
        num_tokens=20 * spec.num_params if num_tokens is None else num_tokens,
        batch_size=batch_size,
        seq_len=seq_len,
        num_replicas=num_replicas,
        sync_every=sync_every,
        fragment_size=fragment_size,
        tau=tau,
        codec=codec,
        step_seconds=spec.step_seconds,
        dp_bits=dp_bits,
        outer_bits=outer_bits,
        max_group_size=max_group_size,
    )
    header = (
        f"model {spec.name}: {run.num_params:.3g} parameters, {run.num_layers} layers; "
        f"{run.num_tokens:.3g} tokens, {run.num_replicas} replicas x {run.batch_size} "
        f"sequences x {run.seq_len} tokens per step = {run.num_steps} steps of "
        f"{run.step_seconds:g} s; H={run.sync_every}, fragment size {run.fragment_size}, "
        f"tau={run.tau}, codec {run.codec}"
    )
    columns = (
        "method",
        "bits",
        "rounds",
        "GB/replica",
        "GB total",
        "peak Gbit/s",
        "mean Gbit/s",
        "DP/bytes",
        "DP/peak",
    )
    rows = [
        (
            t.method,
            f"{t.bits_per_value:g}",
            f"{t.num_rounds}",
            f"{t.bytes_per_replica / 1e9:.4g}",
            f"{t.bytes_total / 1e9:.4g}",
            f"{t.peak_gbps:.4g}",
            f"{t.mean_gbps:.4g}",
            f"{t.bytes_vs_dp:.4g}",
            f"{t.peak_vs_dp:.4g}",
        )
        for t in account(run)
    ]
    widths = [max(len(row[i]) for row in (columns, *rows)) + 2 for i in range(len(columns))]
    table = [
        "".join(
            cell.rjust(w) if i else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in (columns, *rows)
    ]
    note = (
        "bytes are what one replica sends (it receives as many); peak = largest round over "
        "the steps it may take (1, or tau + 1 with overlap)"
    )
    dp = data_parallel_bytes(
        num_params=run.num_params, steps=run.num_steps, num_replicas=num_replicas, bits=dp_bits
    )
    plan = staged_traffic(1.0, 8.0, num_replicas, max_group_size)
    shape = "x".join(str(side) for side in reversed(plan.shape))
    groups = (
        f"DiLoCo rounds in {plan.num_stages} stage(s) on a {shape} grid (max group "
        f"{max_group_size or 'flat'}): {plan.streams:.1f} streams per replica per round "
        f"(flat: {num_replicas - 1}), {plan.bytes_sent:.3g} values sent per value reduced "
        f"(flat: {2 * (num_replicas - 1) / num_replicas:.3g})"
    )
    return "\n".join([header, *table, note, groups, f"data-parallel bytes: {dp.assumption}"])


def swarm_report(
    *,
    peers: Sequence[int],
    group_sizes: Sequence[int | None],
    lifetimes: Sequence[float],
    rules: Sequence[Rule],
    num_rounds: int,
    seed: int,
    base: SwarmSpec,
) -> Iterator[str]:
    """The protocol simulator's table (``diloco.sim.protocol_sim``), line by line as rows
    are simulated, with the plan's per-peer traffic (``diloco.sim.staged_traffic``)."""
    yield from [
        f"{base.num_values:,} values at {base.bits:g} bits; links: up {base.links.up_mbps:g} / "
        f"down {base.links.down_mbps:g} Mbit/s median (log-normal sigma {base.links.sigma:g}), "
        f"one-way latency {base.links.latency_ms[0]:g}-{base.links.latency_ms[1]:g} ms, "
        f"{base.links.setup_rtts:g} RTT per wave of {base.links.max_streams} streams, stream "
        f"loss {base.links.stream_loss:g}; stage budget {base.timeout_factor:g} x nominal; "
        f"{num_rounds} rounds per row",
        "| N | groups | shape | streams/peer | MB sent/peer | lifetime | rule | success "
        "| applied | median s | p90 s | matchmaking s |",
        "| ---: | ---: | --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for n in peers:
        for size in group_sizes:
            traffic = staged_traffic(base.num_values, base.bits, n, size)
            shape = "x".join(str(side) for side in reversed(traffic.shape))
            for lifetime in lifetimes:
                for rule in rules:
                    spec = dataclasses.replace(
                        base, num_peers=n, max_group_size=size, lifetime_s=lifetime, rule=rule
                    )
                    s = summarise(spec, num_rounds, seed)
                    life = "-" if math.isinf(lifetime) else f"{lifetime:g} s"
                    yield (
                        f"| {n} | {size or 'flat'} | {shape} | {traffic.streams:.1f} | "
                        f"{traffic.bytes_sent / 1e6:.2f} | {life} | {rule} | "
                        f"{s.success_rate:.2f} | {s.applied:.3f} | {s.median_seconds:.2f} | "
                        f"{s.p90_seconds:.2f} | {s.matchmaking_seconds:.1f} |"
                    )
