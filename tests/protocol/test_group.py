"""Round timeouts: relations checked at construction, one scaled time unit."""

from __future__ import annotations

import pytest

from diloco.errors import ConfigError
from diloco.protocol.core.group import RoundTimeouts


def test_timeouts_scaled_and_total_bounds_every_phase() -> None:
    t = RoundTimeouts().scaled(0.5)
    assert t.sender_timeout == RoundTimeouts().sender_timeout * 0.5
    assert t.verify_timeout == RoundTimeouts().verify_timeout * 0.5
    assert t.total > t.matchmaking + t.allreduce + 2 * t.verify_timeout


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"sender_timeout": 0.0}, "sender_timeout"), ({"connect_timeout": 20.0}, "connect_timeout")],
)
def test_timeouts_invalid_rejected(kwargs: dict[str, float], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        RoundTimeouts(**kwargs)


def test_matchmaking_bound_leaves_a_takeover_after_a_silent_leaders_due_time() -> None:
    t = RoundTimeouts(matchmaking_window=2.0, join_timeout=3.0)
    assert t.group_timeout == 6.0  # the leader's last read and its wait for joiners
    # window, GROUP due two join timeouts after it, and one more for the next in line
    assert t.matchmaking == 11.0
