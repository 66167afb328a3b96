"""Read a real node's JSON-lines metrics and turn them into a schedule to simulate.

Pure: takes the lines, not a file. What is read (other events and fields are ignored):

- one ``{"event": "config", "sync_every": H, "num_fragments": F, "tau": tau,
  "fragment_numel": [n_0, ..., n_{F-1}], "codec": "e3m0", ...}``;
- ``{"event": "step", "step_seconds": s, ...}``: measured compute seconds of one inner step
  (time blocked on the network excluded);
- ``{"event": "round", "fragment": p, "round": k, "bytes_sent": x, "bytes_received": y,
  "seconds": t, ...}``: one finished all-reduce of fragment ``p``.

The measured run becomes a DAG with one pseudo-layer per fragment, in fragment order:
compute is split in proportion to each fragment's parameter count (forward ``f``, backward
``2f``, the first without activation-backward, as in ``diloco.sim.methods``); a round puts
``8 * max(bytes_sent, bytes_received)`` bits on the link (a full-duplex link is as slow as
its busier direction; the codec and the all-reduce factor are already in the bytes). A
strided fragment's blocks are spread over the depth, so placing it at one position is an
approximation; the send and receive steps are exact (``diloco.node.model.fragments``).
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from diloco.sim.dag import StepCompute, SyncPlan


@dataclass(frozen=True, kw_only=True, slots=True)
class MeasuredRun:
    """What a node's metrics say about its schedule, compute and traffic."""

    sync_every: int
    num_fragments: int
    tau: int
    fragment_numel: tuple[int, ...]
    codec: str
    step_seconds: float
    """Median measured compute seconds per inner step."""
    num_steps: int
    """Step records read."""
    wire_bytes: tuple[float, ...]
    """Per fragment: mean over its rounds of ``max(bytes_sent, bytes_received)``."""
    num_rounds: int
    """Round records read."""
    observed_gbps: float
    """Bits on the wire over the seconds the rounds took, all rounds together: the rate the
    node's link delivered (matchmaking and latency included)."""


def _field(record: dict[str, Any], name: str, lineno: int, *, number: bool = False) -> Any:
    """``record[name]`` as an int (or a finite real when ``number``), else a clear error."""
    value = record.get(name)
    # bool is an int subclass; a flag is never a count here.
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or (isinstance(value, float) and not number)
    ):
        raise ValueError(
            f"line {lineno}: {record.get('event')!r} record needs {name!r} as "
            f"{'a number' if number else 'an integer'}, got {value!r}"
        )
    if not math.isfinite(value):
        raise ValueError(f"line {lineno}: {name!r} must be finite, got {value!r}")
    return value


def parse_metrics(lines: Iterable[str]) -> MeasuredRun:
    """Parse JSON lines into a :class:`MeasuredRun`.

    Raises:
        ValueError: a line is not a JSON object, a needed field is missing or mistyped, there
            is no config, no step or no round record, or a round names an unknown fragment.
    """
    config: dict[str, Any] | None = None
    step_seconds: list[float] = []
    rounds: list[tuple[int, float, float]] = []  # (fragment, wire bytes, seconds)
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"line {lineno}: not JSON ({exc.msg})") from exc
        if not isinstance(record, dict):
            raise ValueError(f"line {lineno}: expected a JSON object")
        event = record.get("event")
        if event == "config":
            config = record
            for name in ("sync_every", "num_fragments", "tau"):
                _field(record, name, lineno)
            if not isinstance(record.get("codec"), str):
                raise ValueError(f"line {lineno}: config record needs 'codec' as a string")
            numel = record.get("fragment_numel")
            if not isinstance(numel, list) or any(
                isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in numel
            ):
                raise ValueError(f"line {lineno}: fragment_numel must be a list of counts >= 0")
        elif event == "step":
            seconds = float(_field(record, "step_seconds", lineno, number=True))
            if not seconds > 0:
                raise ValueError(f"line {lineno}: step_seconds must be > 0, got {seconds}")
            step_seconds.append(seconds)
        elif event == "round":
            fragment = _field(record, "fragment", lineno)
            _field(record, "round", lineno)
            sent = _field(record, "bytes_sent", lineno, number=True)
            received = _field(record, "bytes_received", lineno, number=True)
            seconds = _field(record, "seconds", lineno, number=True)
            if min(sent, received, seconds) < 0:
                raise ValueError(f"line {lineno}: bytes and seconds must be >= 0")
            rounds.append((fragment, float(max(sent, received)), float(seconds)))
    if config is None:
        raise ValueError('no {"event": "config"} record: cannot tell the schedule')
    if not step_seconds:
        raise ValueError('no {"event": "step"} record: cannot tell the step time')
    if not rounds:
        raise ValueError('no {"event": "round"} record: cannot tell the bytes per round')
    numel = tuple(config["fragment_numel"])
    num_fragments = config["num_fragments"]
    if len(numel) != num_fragments:
        raise ValueError(
            f"config has num_fragments={num_fragments} but {len(numel)} fragment_numel entries"
        )
    per_fragment: list[list[float]] = [[] for _ in range(num_fragments)]
    for fragment, wire, _seconds in rounds:
        if not 0 <= fragment < num_fragments:
            raise ValueError(
                f"round record for fragment {fragment}, but the run has {num_fragments} fragments"
            )
        per_fragment[fragment].append(wire)
    # A fragment with no finished round yet costs what the others cost per value.
    measured_bytes = sum(sum(w) for w in per_fragment)
    measured_values = sum(numel[p] * len(w) for p, w in enumerate(per_fragment))
    bytes_per_value = measured_bytes / measured_values if measured_values else 0.0
    wire_bytes = tuple(
        statistics.fmean(w) if w else numel[p] * bytes_per_value for p, w in enumerate(per_fragment)
    )
    round_seconds = sum(seconds for _, _, seconds in rounds)
    return MeasuredRun(
        sync_every=config["sync_every"],
        num_fragments=num_fragments,
        tau=config["tau"],
        fragment_numel=numel,
        codec=config["codec"],
        step_seconds=statistics.median(step_seconds),
        num_steps=len(step_seconds),
        wire_bytes=wire_bytes,
        num_rounds=len(rounds),
        observed_gbps=(
            measured_bytes * 8 / round_seconds / 1e9 if round_seconds > 0 else float("inf")
        ),
    )


def measured_schedule(run: MeasuredRun) -> tuple[StepCompute, SyncPlan]:
    """The DAG of the measured run: one pseudo-layer per fragment (see the module docstring)."""
    total = sum(run.fragment_numel)
    if total == 0:
        raise ValueError("fragment_numel sums to 0: nothing to simulate")
    # forward f_p = backward_weight f_p = backward_activation f_p (p > 0), f_p ∝ numel_p.
    unit = run.step_seconds / (3 * total - run.fragment_numel[0])
    share = tuple(unit * n for n in run.fragment_numel)
    compute = StepCompute(
        forward_seconds=share,
        backward_activation_seconds=(0.0, *share[1:]),
        backward_weight_seconds=share,
    )
    plan = SyncPlan(
        fragments=tuple((p,) for p in range(run.num_fragments)),
        sync_every=run.sync_every,
        tau=run.tau,
        wire_bits=tuple(8 * b for b in run.wire_bytes),
    )
    return compute, plan
