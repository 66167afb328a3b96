"""A node's recent metrics, gathered from its own events for its DHT metrics record.

``RecentMetrics.observe`` takes every event the node emits (the JSON lines of
``--metrics-out``: ``config``, ``step``, ``progress``, ``eval``, ``round``,
``round_failed``, ``healed``, ``summary``) and keeps counters, how the node ended (and how
it trains, given at the start), and the newest ``MAX_POINTS`` losses and ``MAX_ROUNDS``
rounds; ``record`` turns them into the ``MetricsRecord`` the node publishes
(``diloco.protocol.records.metrics``). Non-finite losses (a diverged node) are left out:
the record carries finite numbers only.
"""

from __future__ import annotations

import collections
import math
import threading
from collections.abc import Mapping
from typing import Any

from diloco.protocol.records.metrics import (
    MAX_LABEL_CHARS,
    MAX_MEMBERS,
    MAX_POINTS,
    MAX_ROUNDS,
    LossPoint,
    MetricsRecord,
    RoundEntry,
)


class RecentMetrics:
    """Thread-safe: the training thread observes, the DHT worker reads ``record``."""

    def __init__(
        self, device: str | None = None, precision: str | None = None, batch: int | None = None
    ) -> None:
        """``device``, ``precision``, ``batch``: how the node trains, as it was started."""
        self._lock = threading.Lock()
        self.tokens_per_step = 0
        self.steps = self.tokens = self.bytes_sent = self.bytes_received = 0
        self.failed_rounds = self.healed_fragments = 0
        self.cu = 1.0
        self.device, self.precision = _label(device), _label(precision)
        self.batch_size = batch if batch is not None and batch > 0 else None
        self.end: str | None = None
        self.losses: collections.deque[LossPoint] = collections.deque(maxlen=MAX_POINTS)
        self.evals: collections.deque[LossPoint] = collections.deque(maxlen=MAX_POINTS)
        self.rounds: collections.deque[RoundEntry] = collections.deque(maxlen=MAX_ROUNDS)

    def observe(self, event: Mapping[str, Any]) -> None:
        """Account one node event; events of other kinds are ignored."""
        kind = event.get("event")
        with self._lock:
            if kind == "config":
                self.tokens_per_step = int(event.get("tokens_per_step", 0))
            elif kind == "step":
                self.steps += 1
                self.tokens += self.tokens_per_step
            elif kind == "progress":
                self.cu = min(1.0, max(0.0, float(event["cu"])))
                _append(self.losses, int(event["step"]), float(event["loss"]))
            elif kind == "eval":
                _append(self.evals, int(event["step"]), float(event["loss_outer"]))
            elif kind == "round":
                self.bytes_sent += int(event["bytes_sent"])
                self.bytes_received += int(event["bytes_received"])
                self.rounds.append(
                    RoundEntry(
                        int(event["fragment"]),
                        int(event["round"]),
                        int(event["step"]),
                        min(int(event["members"]), MAX_MEMBERS),
                        max(0.0, float(event["seconds"])),
                        int(event["bytes_sent"]),
                        int(event["bytes_received"]),
                        True,
                    )
                )
            elif kind == "round_failed":
                self.failed_rounds += 1
                fragment, round_, step = (int(event[k]) for k in ("fragment", "round", "step"))
                self.rounds.append(RoundEntry(fragment, round_, step, 0, 0.0, 0, 0, False))
            elif kind == "healed":
                self.healed_fragments += len(event["fragments"])
            elif kind == "summary":  # the node leaves: its final evaluation is the last one
                self.end = "stopped" if event.get("interrupted") else "finished"
                _append(self.evals, int(event["step"]), float(event["eval_loss"]))

    def record(self) -> MetricsRecord:
        """A snapshot as the record the node publishes."""
        with self._lock:
            return MetricsRecord(
                steps=self.steps,
                tokens=self.tokens,
                cu=self.cu,
                bytes_sent=self.bytes_sent,
                bytes_received=self.bytes_received,
                failed_rounds=self.failed_rounds,
                healed_fragments=self.healed_fragments,
                losses=tuple(self.losses),
                evals=tuple(self.evals),
                rounds=tuple(self.rounds),
                device=self.device,
                precision=self.precision,
                batch_size=self.batch_size,
                end=self.end,
            )


def _label(value: object) -> str | None:
    """A device or precision name as the record takes it, else None."""
    if isinstance(value, str) and 0 < len(value) <= MAX_LABEL_CHARS and value.isprintable():
        return value
    return None


def _append(points: collections.deque[LossPoint], step: int, loss: float) -> None:
    """Keep steps strictly increasing (as the record requires) and values finite."""
    if math.isfinite(loss) and loss >= 0 and (not points or step > points[-1].step):
        points.append(LossPoint(step, loss))
