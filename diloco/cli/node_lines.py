"""The lines a node prints for a person: what it trains with, its progress, its summary.

Pure functions of the node's event records (``diloco.node.swarm.node``), so the wording is
tested without a swarm.
"""

from __future__ import annotations

from typing import Any


def duration(seconds: float) -> str:
    """``3m12s``, ``1h05m``, ``42s``: short enough for a progress line."""
    s = max(0, round(seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


def progress_line(record: dict[str, Any]) -> str:
    """``step 120/600 (20%) · loss 2.3100 · 1,234 tok/s · compute 88% (of wall time) · ETA
    3m12s · sent ... · recv ... · peers N`` from a ``progress`` record."""
    step, steps = record["step"], record["steps"]
    return " · ".join(
        (
            f"step {step}/{steps} ({100 * step // max(1, steps)}%)",
            f"loss {record['loss']:.4f}",
            f"{record['tokens_per_s']:,.0f} tok/s",
            f"compute {100 * record['cu']:.0f}% (of wall time)",
            f"ETA {duration(record['eta_s'])}",
            f"sent {record['mb_sent']:.2f} MB",
            f"recv {record['mb_received']:.2f} MB",
            f"peers {record['peers_last_round']}",
        )
    )


def failed_rounds_text(causes: dict[str, int]) -> str:
    """``no failed rounds`` or ``12 failed rounds (10 no partner (alone in the swarm), 2
    timed out)``."""
    total = sum(causes.values())
    if not total:
        return "no failed rounds"
    by_cause = ", ".join(f"{n} {cause}" for cause, n in sorted(causes.items(), key=lambda c: -c[1]))
    return f"{total} failed round{'s' * (total != 1)} ({by_cause})"


def summary_line(record: dict[str, Any]) -> str:
    """The node's last line, from its ``summary`` record."""
    return (
        f"done at step {record['step']}: eval loss {record['eval_loss']:.4f} (outer), "
        f"compute {100 * record['cu']:.1f}% of wall time, sent "
        f"{record['bytes_sent'] / 1e6:.2f} MB (data-parallel: "
        f"{record['dp_bytes_estimate'] / 1e6:.0f} MB), "
        f"{failed_rounds_text(record['failed_causes'])}, {alone_text(record)}"
        f"rounds pending at end: {record['rounds_pending']}{tau_text(record.get('tau_range'))}"
    )


def alone_text(record: dict[str, Any]) -> str:
    """``30 rounds of one (alone), `` when the node applied its own outer gradient alone
    (docs/design.md "Algorithm and schedule"); empty otherwise."""
    alone = int(record.get("rounds_alone", 0))
    return f"{alone} round{'s' * (alone != 1)} of one (alone), " if alone else ""


def tau_text(span: list[int] | None) -> str:
    """``, tau 1-9`` (the taus ``--tau auto`` used; one value when it stayed), or nothing
    for a record without them."""
    if not span:
        return ""
    low, high = span
    return f", tau {low}" if low == high else f", tau {low}-{high}"


def startup_lines(
    *,
    device: str,
    precision: str,
    data: str | None,
    vocab_size: int,
    preset: str,
    num_params: int,
) -> list[str]:
    """What a node trains with, printed once at start-up."""
    return [
        f"model: preset {preset}, {num_params:,} parameters, vocabulary {vocab_size:,} tokens",
        f"device {device}, precision {precision}, data: {data or 'embedded corpus'}",
    ]
