"""Measured and predicted CU of a real node, with the per-round costs the DAG leaves out.

Pure: takes a node's JSON-lines metrics (``diloco.sim.metrics`` for the config and step
records), not a file. Besides those, it reads:

- ``{"event": "round", "step": s, "members": m, "seconds": t, "matchmaking_seconds": g,
  "blocked_seconds": b, ...}``: a round applied at step ``s``; ``t`` runs from the send to
  the result, ``g`` of it forming the group, ``b`` the node waited for it at its receive step;
- ``{"event": "round_failed", "step": s, "blocked_seconds": b, ...}``: a round that failed.

**Measured CU** is the node's own: compute seconds over compute plus blocked seconds (the
summary's ``cu``), over the whole run and over the **steady state**: the steps after the
first round counted with every member (the most members any round of the run had), and the
rounds recorded after it. The start (a node alone waiting for joiners, joiners catching up)
is left out.

**Predicted CU** over the same window simulates the measured schedule (one pseudo-layer per
fragment) with, per round,

- *off the link*: the window's mean matchmaking seconds (window, waiting for the slowest
  member) plus the fixed part of the all-reduce (link latency, stream set-up, coding),
- *on the link*: the fragment's mean wire bytes at the measured rate,

where the all-reduce seconds (``seconds - matchmaking_seconds``) of the window's successful
rounds are fitted as ``fixed + 8 * bytes / rate`` by least squares (rounds of different sizes
tell the two apart; with one size, or a fit that comes out negative, all of it is rate).
The DAG gives the blocked seconds of a successful round; a **failed round**'s time is lost
(its measured blocked seconds) and its update missing (nothing applied, nothing else saved),
so the predicted blocked time is the successful rounds' count times the DAG's blocked seconds
per round plus the failed rounds' own, and the compute is the window's measured compute.

**At another round-trip time** (``rtt_seconds``, e.g. a loopback run predicted across the
internet): each round also waits ``round_trips * rtt_seconds`` off the link, the request /
response exchanges on its critical path (docs/design.md "Across the internet": with
matchmaking ahead of the send step, a follower's JOIN -> GROUP, then the all-reduce and its
checks, 3 measured at 0-300 ms). The measured run's own round trips cost what its network
charged (nothing on loopback), so the prediction is meant from a run at a lower RTT than the
one predicted. ``tau`` predicts at another overlap than the run's (a node with ``--tau
auto`` picks its own at each RTT).
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from diloco.sim.dag import StepCompute, SyncPlan, compute_utilisation
from diloco.sim.metrics import measured_schedule, parse_metrics

ROUND_TRIPS = 3.0
"""Round trips on a round's critical path: a follower's ``join part check``, the median
measured by ``benchmarks/wan.py`` (docs/design.md "Across the internet")."""


@dataclass(frozen=True, slots=True)
class Round:
    """One round as the node recorded it."""

    step: int
    fragment: int
    ok: bool
    members: int
    wire_bytes: float
    seconds: float
    matchmaking_seconds: float
    blocked_seconds: float


@dataclass(frozen=True, slots=True)
class Window:
    """The steps and rounds of one part of a run."""

    step_seconds: tuple[float, ...]
    rounds: tuple[Round, ...]


@dataclass(frozen=True, slots=True)
class WindowCU:
    """CU over the whole run and in steady state (None: the swarm never formed)."""

    whole: float
    steady: float | None
    steady_from_step: int | None
    """The steady state is the steps after this one."""

    def as_dict(self) -> dict[str, float | int | None]:
        return {
            "whole": self.whole,
            "steady": self.steady,
            "steady_from_step": self.steady_from_step,
        }


@dataclass(frozen=True, slots=True)
class RoundCosts:
    """What one window's rounds cost, as the prediction uses it."""

    matchmaking_seconds: float
    """Mean over the successful rounds."""
    fixed_seconds: float
    """Fitted all-reduce seconds that do not scale with bytes (latency, set-up, coding)."""
    rate_gbps: float
    """Fitted rate of the bytes (inf when no bytes were sent)."""
    wire_bytes: tuple[float, ...]
    """Per fragment: mean of ``max(bytes_sent, bytes_received)`` over its successful rounds."""
    failed_rounds: int
    failed_blocked_seconds: float
    """Sum over the failed rounds."""


def _number(record: dict[str, object], name: str, default: float | None = None) -> float:
    value = record.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{record.get('event')!r} record needs {name!r} as a finite number")
    if value < 0:
        raise ValueError(f"{record.get('event')!r} record has {name!r} < 0: {value!r}")
    return float(value)


def read_windows(lines: Iterable[str]) -> tuple[Window, Window | None, int | None]:
    """(whole run, steady state or None, the step the steady state starts after).

    Metrics written before ``matchmaking_seconds`` and a failed round's ``blocked_seconds``
    were recorded read as 0 for them.
    """
    steps: list[tuple[int, float]] = []
    rounds: list[Round] = []
    for line in lines:
        if not line.strip():
            continue
        record = json.loads(line)
        event = record.get("event") if isinstance(record, dict) else None
        if event == "step":
            steps.append((int(_number(record, "step")), _number(record, "step_seconds")))
        elif event in ("round", "round_failed"):
            ok = event == "round"
            wire = (
                max(_number(record, "bytes_sent"), _number(record, "bytes_received")) if ok else 0
            )
            rounds.append(
                Round(
                    step=int(_number(record, "step")),
                    fragment=int(_number(record, "fragment")),
                    ok=ok,
                    members=int(_number(record, "members")) if ok else 0,
                    wire_bytes=wire,
                    seconds=_number(record, "seconds") if ok else 0.0,
                    matchmaking_seconds=_number(record, "matchmaking_seconds", 0.0) if ok else 0.0,
                    blocked_seconds=_number(record, "blocked_seconds", 0.0),
                )
            )
    whole = Window(tuple(s for _, s in steps), tuple(rounds))
    full = max((r.members for r in rounds if r.ok), default=0)
    if full < 2:
        return whole, None, None
    start = min(r.step for r in rounds if r.ok and r.members == full)
    steady = Window(
        tuple(s for step, s in steps if step > start), tuple(r for r in rounds if r.step > start)
    )
    return whole, (steady if steady.step_seconds else None), start


def window_cu(window: Window) -> float:
    """Measured CU: compute over compute plus the seconds blocked on rounds."""
    compute = sum(window.step_seconds)
    total = compute + sum(r.blocked_seconds for r in window.rounds)
    return compute / total if total else 1.0


def measured_cu(lines: Sequence[str]) -> WindowCU:
    whole, steady, start = read_windows(lines)
    return WindowCU(window_cu(whole), window_cu(steady) if steady else None, start)


def fit_link(rounds: Sequence[Round]) -> tuple[float, float]:
    """(fixed seconds, Gbit/s): least squares of all-reduce seconds on wire bits."""
    bits = [8 * r.wire_bytes for r in rounds]
    seconds = [max(0.0, r.seconds - r.matchmaking_seconds) for r in rounds]
    if not rounds or sum(bits) == 0:
        return (statistics.fmean(seconds) if rounds else 0.0), math.inf
    mean_bits, mean_seconds = statistics.fmean(bits), statistics.fmean(seconds)
    spread = sum((b - mean_bits) ** 2 for b in bits)
    if spread > 0:
        slope = (
            sum((b - mean_bits) * (s - mean_seconds) for b, s in zip(bits, seconds, strict=True))
            / spread
        )
        fixed = mean_seconds - slope * mean_bits
        if slope > 0 and fixed >= 0:
            return fixed, 1 / slope / 1e9
    return 0.0, sum(bits) / sum(seconds) / 1e9 if sum(seconds) > 0 else math.inf


def round_costs(window: Window, num_fragments: int) -> RoundCosts:
    ok = [r for r in window.rounds if r.ok]
    failed = [r for r in window.rounds if not r.ok]
    fixed, rate = fit_link(ok)
    per_fragment = [[r.wire_bytes for r in ok if r.fragment == p] for p in range(num_fragments)]
    everyone = [r.wire_bytes for r in ok]
    fallback = statistics.fmean(everyone) if everyone else 0.0
    return RoundCosts(
        matchmaking_seconds=statistics.fmean(r.matchmaking_seconds for r in ok) if ok else 0.0,
        fixed_seconds=fixed,
        rate_gbps=rate,
        wire_bytes=tuple(statistics.fmean(w) if w else fallback for w in per_fragment),
        failed_rounds=len(failed),
        failed_blocked_seconds=sum(r.blocked_seconds for r in failed),
    )


def predict_window(
    window: Window,
    compute: StepCompute,
    plan: SyncPlan,
    bandwidth_gbps: float | None = None,
    rtt_seconds: float = 0.0,
    round_trips: float = ROUND_TRIPS,
) -> float:
    """Predicted CU of ``window`` (at the fitted rate, or at ``bandwidth_gbps``), with
    ``round_trips`` more round trips of ``rtt_seconds`` per round."""
    if not (rtt_seconds >= 0 and round_trips >= 0):
        raise ValueError(f"need rtt >= 0 and round trips >= 0, got {rtt_seconds}, {round_trips}")
    if not window.step_seconds:
        raise ValueError("no step in the window: nothing to predict")
    costs = round_costs(window, len(plan.fragments))
    step = statistics.fmean(window.step_seconds)
    scale = step / compute.step_seconds
    compute = StepCompute(
        forward_seconds=tuple(scale * t for t in compute.forward_seconds),
        backward_activation_seconds=tuple(scale * t for t in compute.backward_activation_seconds),
        backward_weight_seconds=tuple(scale * t for t in compute.backward_weight_seconds),
    )
    rate = bandwidth_gbps if bandwidth_gbps is not None else costs.rate_gbps
    wire_bits = tuple(8 * b for b in costs.wire_bytes)
    ok = [r for r in window.rounds if r.ok]
    # Each successful round's own matchmaking wait (they vary: waiting for the slowest
    # member), not their mean: a wait beyond the overlap blocks, a shorter one does not.
    extra = costs.fixed_seconds + round_trips * rtt_seconds
    blocked = sum(
        _blocked_per_round(compute, plan, wire_bits, r.matchmaking_seconds + extra, rate)
        for r in ok
    )
    total = sum(window.step_seconds)
    return total / (total + blocked + costs.failed_blocked_seconds)


def _blocked_per_round(
    compute: StepCompute, plan: SyncPlan, wire_bits: tuple[float, ...], pre: float, rate: float
) -> float:
    """Seconds a round blocks when every round waits ``pre`` off the link, then sends its
    fragment's bits at ``rate``: a period of ``H`` steps holds one round of each fragment."""
    plan = SyncPlan(
        fragments=plan.fragments,
        sync_every=plan.sync_every,
        tau=plan.tau,
        wire_bits=wire_bits,
        pre_seconds=(pre,) * len(plan.fragments),
    )
    cu = float(compute_utilisation(compute, plan, [rate if math.isfinite(rate) else 1e9])[0])
    return plan.sync_every * compute.step_seconds * (1 / cu - 1) / len(plan.fragments)


def predict_cu(
    lines: Sequence[str],
    bandwidth_gbps: float | None = None,
    rtt_seconds: float = 0.0,
    round_trips: float = ROUND_TRIPS,
    tau: int | None = None,
) -> WindowCU:
    """Predicted CU over the whole run and in steady state, from the node's own metrics
    (at ``rtt_seconds`` more round-trip time than the run had, and at ``tau``; None: the
    run's)."""
    compute, plan = measured_schedule(parse_metrics(lines))
    if tau is not None:
        plan = dataclasses.replace(plan, tau=tau)
    whole, steady, start = read_windows(lines)
    at = (bandwidth_gbps, rtt_seconds, round_trips)
    return WindowCU(
        predict_window(whole, compute, plan, *at),
        predict_window(steady, compute, plan, *at) if steady else None,
        start,
    )
