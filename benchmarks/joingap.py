"""How soon the joiners of the healing-attack swarm share a round with the others.

Run the swarm test with its files kept, then read them::

    python -m pytest -q tests/node/test_healing_attacks.py --basetemp=DIR -p no:randomly
    python benchmarks/joingap.py DIR [DIR ...]

For each joiner (b, c): the step it joined at, the step of its first round with others,
and the rounds it failed in between (from its metrics JSONL). Results in
benchmarks/RESULTS.md "A joiner out of step with the creator".
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def join_gap(records: list[dict[str, Any]]) -> tuple[int, int | None, int]:
    """(joined step, first step of a round with others or None, rounds failed before it)."""
    joined = next(r["step"] for r in records if r["event"] == "joined")
    first = next((r["step"] for r in records if r["event"] == "round" and r["members"] >= 2), None)
    failed = sum(
        1 for r in records if r["event"] == "round_failed" and (first is None or r["step"] < first)
    )
    return joined, first, failed


def main(folders: list[str]) -> None:
    for folder in folders:
        parts = []
        for name in ("b", "c"):
            path = Path(folder) / "attacks0" / f"{name}.jsonl"
            records = [json.loads(line) for line in path.read_text().splitlines()]
            joined, first, failed = join_gap(records)
            parts.append(f"{name}: joined {joined}, first round {first}, {failed} failed before")
        print(folder, " | ".join(parts))


if __name__ == "__main__":
    main(sys.argv[1:])
