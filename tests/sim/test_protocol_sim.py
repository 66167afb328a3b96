"""The protocol simulator on cases small enough to compute by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from diloco.sim.protocol_sim import (
    LinkModel,
    Peers,
    SwarmSpec,
    matchmaking_seconds,
    run_round,
    summarise,
)

# 8 Mbit/s = 1e6 bytes/s both ways, 20 ms one way (RTT 80 ms between two peers), one RTT to
# open streams; 250,000 FP32 values = 1e6 bytes.
LINKS = LinkModel(sigma=0.0, latency_ms=(20.0, 20.0), setup_rtts=1.0)


def _spec(n: int, **kw: object) -> SwarmSpec:
    return SwarmSpec(num_peers=n, num_values=250_000, bits=32, links=LINKS, **kw)  # type: ignore[arg-type]


def _peers(n: int, death: dict[int, float] | None = None) -> Peers:
    deaths = np.full(n, math.inf)
    for i, t in (death or {}).items():
        deaths[i] = t
    return Peers(up=np.full(n, 1e6), down=np.full(n, 1e6), latency=np.full(n, 0.02), death=deaths)


def test_run_round_two_peers_duration_by_hand() -> None:
    # Streams open in 1 RTT = 0.08 s; each sends its other half (5e5 bytes at 1e6 B/s)
    # after 0.04 s of delay: parts in at 0.08 + 0.04 + 0.5 = 0.62; the averaged halves
    # come back 0.04 + 0.5 later: 1.16 s.
    out = run_round(_spec(2), _peers(2), np.random.default_rng(0))
    assert out.success and out.applied == 1.0 and out.counted == 1.0
    assert out.seconds == pytest.approx(1.16)
    assert out.stage_seconds == pytest.approx((1.16,))


def test_matchmaking_two_peers_by_hand() -> None:
    # Window 2 s, no DHT round trip after the send step (declared ahead), a round trip to
    # the leader 0.08 s, GROUP of 2 x 48 bytes to 2 peers.
    assert matchmaking_seconds(_spec(2), _peers(2)) == pytest.approx(2.08 + 4 * 48 / 1e6)
    # Declaring at the send step: 3 DHT round trips of 0.08 s more.
    at_send = _spec(2, dht_round_trips=3)
    assert matchmaking_seconds(at_send, _peers(2)) == pytest.approx(2.32 + 4 * 48 / 1e6)


def test_run_round_four_in_twos_two_stages_by_hand() -> None:
    # Two stages of the two-peer round: 2 x 1.16 s.
    out = run_round(_spec(4, max_group_size=2), _peers(4), np.random.default_rng(0))
    assert out.success
    assert out.stage_seconds == pytest.approx((1.16, 2.32))


@pytest.mark.parametrize("size", [None, 4, 8])
def test_summarise_without_churn_always_succeeds(size: int | None) -> None:
    spec = SwarmSpec(num_peers=40, max_group_size=size, num_values=1 << 16)
    summary = summarise(spec, num_rounds=5, seed=1)
    assert summary.success_rate == 1.0 and summary.applied == 1.0


def test_run_round_flat_reducer_death_fails_the_round_without_rereduction() -> None:
    out = run_round(_spec(4, rule="fail"), _peers(4, {2: 0.05}), np.random.default_rng(0))
    assert not out.success and out.applied == 0.0 and math.isnan(out.seconds)


def test_run_round_flat_reducer_death_is_rereduced_by_survivors() -> None:
    out = run_round(_spec(4, rule="rereduce"), _peers(4, {2: 0.05}), np.random.default_rng(0))
    assert out.success and out.applied == 1.0
    assert out.counted == pytest.approx(0.75)
    # Parts of 2.5e5 bytes; each live member sends 3 (0.75 s) from 0.08 s: in at 0.87.
    # Reducers see the dead sender's broken stream at 0.05 + 0.08 and close at 0.87; the
    # averages go back in 0.04 + 0.75 s: 1.66. The dead part, re-reduced from 0.13 by
    # member 0 (the other two send it 2.5e5 bytes each, 0.04 + 0.5 s, and get the average
    # back as fast), is back at 1.21 < 1.66.
    assert out.seconds == pytest.approx(1.66)


def test_run_round_every_stream_lost_fails() -> None:
    links = LinkModel(sigma=0.0, latency_ms=(20.0, 20.0), stream_loss=1.0)
    spec = SwarmSpec(num_peers=4, num_values=1000, links=links)
    assert not run_round(spec, _peers(4), np.random.default_rng(0)).success


@pytest.mark.parametrize(
    "kw",
    [
        {"num_peers": 1},
        {"num_peers": 4, "rule": "maybe"},
        {"num_peers": 4, "lifetime_s": 0},
        {"num_peers": 4, "dht_round_trips": -1},
    ],
)
def test_swarm_spec_rejects_bad_values(kw: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        SwarmSpec(**kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(("rule", "success"), [("fail", False), ("rereduce", True)])
def test_run_round_staged_death_cascades_unless_rereduced(rule: str, success: bool) -> None:
    # 2x2: the dead member fails its stage-0 pair, whose survivor then holds no value for
    # the stage-1 group of the dead one; under rereduce the survivor re-reduces the dead
    # part and stands in for the dead member in stage 1 (same bytes).
    spec = _spec(4, max_group_size=2, rule=rule)
    out = run_round(spec, _peers(4, {1: 0.01}), np.random.default_rng(0))
    assert out.success is success
    assert out.counted == (0.75 if success else 0.0)


@pytest.mark.parametrize(("rule", "success"), [("fail", False), ("rereduce", True)])
def test_run_round_stage_one_death_mid_send(rule: str, success: bool) -> None:
    # 2x2: stage 0 ends at 1.16 s for everyone; stage-1 parts would arrive at 1.78 s. A
    # member dying at 1.5 s fails its stage-1 group under fail; under rereduce its
    # stage-0 partner (same bytes) sends that part again and its part is re-reduced, and
    # its tokens still count (stage 0 had them).
    spec = _spec(4, max_group_size=2, rule=rule)
    out = run_round(spec, _peers(4, {1: 1.5}), np.random.default_rng(0))
    assert out.success is success
    if success:
        assert out.counted == 1.0 and out.stage_seconds[0] == pytest.approx(1.16)
