"""Compute-utilisation simulator and bandwidth accountant (docs/design.md "The simulator").

Pure, sans-I/O: ``dag`` (the schedule), ``methods`` (presets and methods), ``sweep``
(required bandwidths), ``accounting`` (bytes and peak rates), ``metrics`` (a node's JSON lines
as a schedule), ``round_costs`` (a node's measured CU and the CU predicted with its per-round
costs), ``paper`` (the paper's own table, to compare with), ``staged_traffic`` (bytes
and streams per peer of a staged round) and ``protocol_sim`` (rounds among thousands of
simulated peers, on the protocol's own stage plan). ``plots`` writes PNG files
and ``commands`` backs the CLI; neither is imported here. matplotlib (the optional extra
``plots``) is loaded only when a figure is drawn.
"""

from diloco.sim.accounting import CODEC_BITS, RunSpec, Traffic, account
from diloco.sim.dag import Interval, Schedule, StepCompute, SyncPlan, compute_utilisation, simulate
from diloco.sim.methods import (
    METHODS,
    PRESETS,
    Method,
    ModelSpec,
    SyncSettings,
    step_compute,
    sync_plan,
)
from diloco.sim.metrics import MeasuredRun, measured_schedule, parse_metrics
from diloco.sim.sweep import DEFAULT_TARGETS, bandwidth_grid, cu_curves, required_bandwidth

__all__ = [
    "CODEC_BITS",
    "DEFAULT_TARGETS",
    "METHODS",
    "PRESETS",
    "Interval",
    "MeasuredRun",
    "Method",
    "ModelSpec",
    "RunSpec",
    "Schedule",
    "StepCompute",
    "SyncPlan",
    "SyncSettings",
    "Traffic",
    "account",
    "bandwidth_grid",
    "compute_utilisation",
    "cu_curves",
    "measured_schedule",
    "parse_metrics",
    "required_bandwidth",
    "simulate",
    "step_compute",
    "sync_plan",
]
