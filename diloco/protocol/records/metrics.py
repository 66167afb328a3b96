"""Per-node metrics records: what a dashboard shows that node records do not carry.

A node record (``records``) says where a node is (step, fragment versions, throughput);
this record says how it got there, bounded to the recent past: its training losses, the
held-out losses of its outer weights, its last rounds, compute utilisation, tokens and
bytes. Nodes publish it next to their node record; ``diloco-node dashboard`` reads it.

Layout in the DHT (a signed envelope of ``signed_records``, subkey = the author's peer id)::

    key "{run_id}/metrics"    payload = MetricsRecord.to_wire(), at most MAX_METRICS_BYTES

What a peer claims here is only its word: the dashboard shows it, nothing decides on it.
Payloads are validated strictly (exact keys, types, ranges, at most ``MAX_POINTS`` losses
and ``MAX_ROUNDS`` rounds) and rejected rather than coerced.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hivemind import DHT
from hivemind.utils import get_dht_time

from diloco.errors import ProtocolError
from diloco.protocol.trust.envelopes import (
    pack_payload,
    read_signed,
    store_signed,
    unpack_payload,
)
from diloco.protocol.wire.run_id import RUN_ID_PATTERN, check_run_id

logger = logging.getLogger(__name__)

METRICS_SCHEMA = 1
MAX_POINTS = 64
"""Most loss points of each kind in one record (the newest)."""
MAX_ROUNDS = 64
"""Most rounds in one record (the newest)."""
MAX_METRICS_BYTES = 8 * 1024
"""Above the largest valid record: 2 x 64 points and 64 rounds of 64-bit values, ~6.5 KB,
and its few labels (under 100 bytes)."""
MAX_MEMBERS = 4096
METRICS_KEY_PATTERN = re.compile(RUN_ID_PATTERN.pattern.strip("^$") + "/metrics")

_KEYS = {"v", "steps", "tok", "cu", "sent", "recv", "fail", "heal", "loss", "eval", "rounds"}
_OPTIONAL_KEYS = {"dev", "prec", "batch", "end"}
"""Added later: a record without them is still valid (an older node's)."""
MAX_LABEL_CHARS = 32
"""Longest device or precision name (``cuda:0``, ``bf16``)."""
ENDS = ("finished", "stopped")


@dataclass(frozen=True, slots=True)
class LossPoint:
    """A loss (nats per token) at an inner step."""

    step: int
    loss: float


@dataclass(frozen=True, slots=True)
class RoundEntry:
    """One fragment round as its node saw it; ``step`` is where it was applied (``s + tau``).

    A failed round has no members and no bytes.
    """

    fragment: int
    round: int
    step: int
    members: int
    seconds: float
    bytes_sent: int
    bytes_received: int
    ok: bool


@dataclass(frozen=True, slots=True)
class MetricsRecord:
    """A node's recent metrics; counts are since the node process started."""

    steps: int
    """Inner steps this process trained."""
    tokens: int
    """Tokens it trained on (steps x batch size x sequence length)."""
    cu: float
    """Compute utilisation: share of wall time not blocked on the network, in [0, 1]."""
    bytes_sent: int
    bytes_received: int
    failed_rounds: int
    healed_fragments: int
    losses: tuple[LossPoint, ...]
    """Training loss of the live weights (mean of a progress interval), steps increasing."""
    evals: tuple[LossPoint, ...]
    """Held-out loss of the outer weights (``--eval-every``), steps increasing."""
    rounds: tuple[RoundEntry, ...]
    device: str | None = None
    """Where it trains (``cpu``, ``cuda:0``), for people comparing nodes; None: unsaid."""
    precision: str | None = None
    """Its inner steps' precision (``fp32``, ``bf16``)."""
    batch_size: int | None = None
    """Sequences per inner step it was started with (pace may train fewer)."""
    end: str | None = None
    """``finished`` (the run's last step) or ``stopped`` (a signal): the node's last record,
    published as it leaves; its last eval is the final one. None: still training."""

    def check(self) -> None:
        """Raise ProtocolError unless every field is in range.

        Raises:
            ProtocolError: naming the first bad field.
        """
        for name in ("steps", "tokens", "bytes_sent", "bytes_received", "failed_rounds"):
            _require(_count(getattr(self, name)), name)
        _require(_count(self.healed_fragments), "healed_fragments")
        _require(_real(self.cu) and self.cu <= 1.0, f"cu {self.cu!r}")
        for name, points in (("losses", self.losses), ("evals", self.evals)):
            _require(len(points) <= MAX_POINTS, f"{len(points)} {name}")
            previous = -1
            for point in points:
                _require(_count(point.step) and point.step > previous, f"{name} step order")
                _require(_real(point.loss), f"{name} value {point.loss!r}")
                previous = point.step
        _require(len(self.rounds) <= MAX_ROUNDS, f"{len(self.rounds)} rounds")
        for r in self.rounds:
            counts = (r.fragment, r.round, r.step, r.bytes_sent, r.bytes_received)
            _require(all(_count(c) for c in counts), f"round entry {r!r:.200}")
            _require(_count(r.members) and r.members <= MAX_MEMBERS, f"members {r.members!r}")
            _require(_real(r.seconds), f"round seconds {r.seconds!r}")
            _require(isinstance(r.ok, bool), "round outcome")
            _require(r.ok or (r.members, r.bytes_sent, r.bytes_received) == (0, 0, 0), "failed")
        for name in ("device", "precision"):
            label = getattr(self, name)
            _require(
                label is None
                or (
                    isinstance(label, str)
                    and 0 < len(label) <= MAX_LABEL_CHARS
                    and label.isprintable()
                ),
                f"{name} {label!r:.80}",
            )
        _require(
            self.batch_size is None or (_count(self.batch_size) and self.batch_size > 0),
            f"batch size {self.batch_size!r}",
        )
        _require(self.end is None or self.end in ENDS, f"end {self.end!r:.80}")

    def to_wire(self) -> dict[str, Any]:
        """The msgpack-able value stored under the node's subkey."""
        self.check()
        optional = {"dev": self.device, "prec": self.precision, "batch": self.batch_size}
        return {k: v for k, v in (optional | {"end": self.end}).items() if v is not None} | {
            "v": METRICS_SCHEMA,
            "steps": self.steps,
            "tok": self.tokens,
            "cu": self.cu,
            "sent": self.bytes_sent,
            "recv": self.bytes_received,
            "fail": self.failed_rounds,
            "heal": self.healed_fragments,
            "loss": [[p.step, p.loss] for p in self.losses],
            "eval": [[p.step, p.loss] for p in self.evals],
            "rounds": [
                [
                    r.fragment,
                    r.round,
                    r.step,
                    r.members,
                    r.seconds,
                    r.bytes_sent,
                    r.bytes_received,
                    r.ok,
                ]
                for r in self.rounds
            ],
        }

    @classmethod
    def from_wire(cls, value: object) -> MetricsRecord:
        """Parse and check an untrusted DHT value.

        Raises:
            ProtocolError: for any deviation from the schema (extra or missing keys too).
        """
        _require(isinstance(value, Mapping), f"record of type {type(value).__name__}")
        assert isinstance(value, Mapping)
        _require(_KEYS <= set(value) <= _KEYS | _OPTIONAL_KEYS, "record keys")
        _require(value["v"] == METRICS_SCHEMA, f"schema {value['v']!r}")
        record = cls(
            steps=value["steps"],
            tokens=value["tok"],
            cu=value["cu"],
            bytes_sent=value["sent"],
            bytes_received=value["recv"],
            failed_rounds=value["fail"],
            healed_fragments=value["heal"],
            losses=tuple(LossPoint(*_entry(p, 2, "loss")) for p in _list(value["loss"])),
            evals=tuple(LossPoint(*_entry(p, 2, "eval")) for p in _list(value["eval"])),
            rounds=tuple(RoundEntry(*_entry(r, 8, "round")) for r in _list(value["rounds"])),
            device=value.get("dev"),
            precision=value.get("prec"),
            batch_size=value.get("batch"),
            end=value.get("end"),
        )
        record.check()
        return record

    @classmethod
    def from_payload(cls, payload: bytes) -> MetricsRecord:
        """Parse a signed record's payload (msgpack of ``to_wire``).

        Raises:
            ProtocolError: oversize, undecodable, or failing ``from_wire``.
        """
        return cls.from_wire(unpack_payload(payload, MAX_METRICS_BYTES))


def metrics_key(run_id: str) -> str:
    """DHT key under which every node of the run publishes its metrics record."""
    return f"{check_run_id(run_id)}/metrics"


async def publish_metrics(dht: DHT, run_id: str, record: MetricsRecord, ttl: float) -> bool:
    """Store ``record`` (signed by this node) for ``ttl`` seconds; returns whether stored."""
    payload = pack_payload(record.to_wire())
    return await store_signed(dht, metrics_key(run_id), payload, get_dht_time() + ttl)


async def read_metrics(dht: DHT, run_id: str) -> dict[str, MetricsRecord]:
    """Every valid, unexpired, correctly signed metrics record of the run, by author peer
    id; invalid ones are logged with the peer id they claim."""
    found = {}
    for peer_id, signed in (await read_signed(dht, metrics_key(run_id))).items():
        try:
            found[peer_id] = MetricsRecord.from_payload(signed.payload)
        except ProtocolError as exc:
            logger.warning("ignoring invalid metrics record from %s: %s", peer_id, exc)
    return found


def check_metrics_payload(key: str, author: str, payload: bytes) -> None:
    """The DHT validator's schema of metrics records (``records.record_validator``)."""
    MetricsRecord.from_payload(payload)


def _list(value: object) -> list[object]:
    _require(isinstance(value, list) and len(value) <= max(MAX_POINTS, MAX_ROUNDS), "list")
    assert isinstance(value, list)
    return value


def _entry(value: object, size: int, what: str) -> list[Any]:
    _require(isinstance(value, list) and len(value) == size, f"{what} entry {value!r:.80}")
    assert isinstance(value, list)
    return value


def _count(value: object) -> bool:
    """An int >= 0 (bools are not counts)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _real(value: object) -> bool:
    """A finite float >= 0."""
    return isinstance(value, float) and math.isfinite(value) and value >= 0


def _require(condition: bool, what: str) -> None:
    if not condition:
        raise ProtocolError(f"invalid metrics record: {what}")
