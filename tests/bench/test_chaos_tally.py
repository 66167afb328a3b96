"""The chaos run's tally (the run itself: tests/node/test_chaos.py)."""

from __future__ import annotations

from diloco.bench.chaos import shared_rounds

X, Y = "a" * 64, "b" * 64


def _round(p: int, k: int, outer: str, prior: str | None = None) -> dict[str, object]:
    event: dict[str, object] = {"event": "round", "fragment": p, "round": k, "outer_sha256": outer}
    return event if prior is None else event | {"prior_sha256": prior}


def test_shared_rounds_group_members_by_prior() -> None:
    """Round 0/3 ran as two groups from two priors: two shared rounds, each with one result;
    round 1/3 split members that started from one prior: a mismatch."""
    rounds = {
        "a": [_round(0, 3, "s", X), _round(1, 3, "u", X)],
        "b": [_round(0, 3, "s", X), _round(1, 3, "v", X)],
        "c": [_round(0, 3, "t", Y)],
        "d": [_round(0, 3, "t", Y), _round(1, 4, "w", X)],
    }
    assert shared_rounds(rounds) == (3, {f"1/3/{X[:16]}": {"a": ["u"], "b": ["v"]}})


def test_shared_rounds_without_priors_are_one_group() -> None:
    rounds = {"a": [_round(2, 1, "s")], "b": [_round(2, 1, "t")]}
    assert shared_rounds(rounds) == (1, {"2/1": {"a": ["s"], "b": ["t"]}})
