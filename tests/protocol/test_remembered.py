"""A process's memory of checks that passed: bounded, the least recently met forgotten first
(a fork while its lock is held: ``test_identity_keys.py``)."""

from __future__ import annotations

from diloco.protocol.trust.remembered import Remembered


def test_the_least_recently_met_key_is_forgotten_first() -> None:
    memory = Remembered(2)
    memory.add("a")
    memory.add("b")
    assert "a" in memory  # met again: now the most recent
    memory.add("c")
    assert "b" not in memory and "a" in memory and "c" in memory
    assert len(memory) == 2
