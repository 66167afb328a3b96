"""Offences, bans and releases on a hand-driven clock."""

from __future__ import annotations

import asyncio
import logging

import pytest
from hivemind.p2p import PeerID

import diloco.protocol.trust.stalls
from diloco.protocol.trust.bans import BanList
from diloco.protocol.trust.stalls import MEMORY_S, STALL_S, TICK_S, StallWatch
from diloco.protocol.wire.frames import RejectCode

LIAR, OTHER = PeerID(b"\x00\x24liar"), PeerID(b"\x00\x24other")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _bans(clock: Clock) -> BanList:
    return BanList(max_offences=3, window=60.0, duration=600.0, clock=clock)


def test_third_offence_within_the_window_bans() -> None:
    clock = Clock()
    bans = _bans(clock)
    assert not bans.offend(LIAR, "a")
    clock.now += 20
    assert not bans.offend(LIAR, "b")
    assert not bans.banned(LIAR)
    clock.now += 20
    assert bans.offend(LIAR, "c")
    assert bans.banned(LIAR) and not bans.banned(OTHER)


def test_offences_older_than_the_window_do_not_count() -> None:
    clock = Clock()
    bans = _bans(clock)
    bans.offend(LIAR, "a")
    clock.now += 30
    bans.offend(LIAR, "b")
    clock.now += 31  # the first is 61 s old now
    assert not bans.offend(LIAR, "c")
    clock.now += 1
    assert bans.offend(LIAR, "d")


def test_ban_runs_out_and_the_peer_starts_clean() -> None:
    clock = Clock()
    bans = _bans(clock)
    for reason in "abc":
        bans.offend(LIAR, reason)
    clock.now += 599
    assert bans.banned(LIAR)
    clock.now += 1
    assert not bans.banned(LIAR)
    assert not bans.offend(LIAR, "again")  # one offence after release: not banned


def test_offences_while_banned_do_not_extend_the_ban() -> None:
    clock = Clock()
    bans = _bans(clock)
    for reason in "abc":
        bans.offend(LIAR, reason)
    clock.now += 500
    assert bans.offend(LIAR, "more")
    clock.now += 100
    assert not bans.banned(LIAR)


def test_admit_refuses_only_banned_peers() -> None:
    clock = Clock()
    bans = _bans(clock)
    for reason in "abc":
        bans.offend(LIAR, reason)
    refusal = bans.admit(LIAR)
    assert refusal is not None and refusal.code == RejectCode.BANNED
    assert bans.admit(OTHER) is None


def test_ban_and_release_are_logged_with_peer_and_offence(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    bans = _bans(clock)
    with caplog.at_level(logging.WARNING, logger="diloco.protocol.trust.bans"):
        for reason in ("bad PART", "bad REPORT", "reported another result"):
            bans.offend(LIAR, reason)
        clock.now += 600
        bans.banned(LIAR)
    text = caplog.text
    assert f"banning {LIAR} for 600 s after 3 offences, the last: reported another result" in text
    assert f"releasing {LIAR}: its ban (for reported another result) ran out" in text


@pytest.mark.parametrize(
    "kwargs", [{"max_offences": 0}, {"window": 0.0}, {"duration": -1.0}], ids=str
)
def test_ban_list_refuses_rules_that_cannot_work(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        BanList(**kwargs)  # type: ignore[arg-type]


def test_proven_lie_bans_at_once_for_the_ban_duration(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    bans = _bans(clock)
    with caplog.at_level(logging.WARNING, logger="diloco.protocol.trust.bans"):
        bans.ban(LIAR, "block 3 is not the average of the signed chunks")
    assert bans.banned(LIAR) and not bans.banned(OTHER)
    assert f"banning {LIAR} for 600 s: block 3 is not the average" in caplog.text
    bans.ban(LIAR, "again")  # banned already: the ban is not extended
    clock.now += 600
    assert not bans.banned(LIAR)
    assert not bans.offend(LIAR, "a")  # a clean slate after the ban


def test_silences_within_the_span_count_once_and_a_silent_peer_is_still_banned() -> None:
    clock = Clock()
    bans = BanList(max_offences=3, window=600.0, duration=600.0, silence_span=60.0, clock=clock)
    for seconds in (0, 10, 59):  # one stop of the peer: silent in three rounds
        clock.now = 1000.0 + seconds
        assert not bans.offend(LIAR, "no PART", silence=True)
    clock.now = 1060.0  # a span after the first: counts again (2)
    assert not bans.offend(LIAR, "no PART", silence=True)
    clock.now = 1119.0
    assert not bans.offend(LIAR, "no PART", silence=True)
    clock.now = 1120.0  # the third span: banned
    assert bans.offend(LIAR, "no PART", silence=True)
    assert bans.banned(LIAR)


def test_offences_other_than_silence_count_each_beside_a_silence() -> None:
    clock = Clock()
    bans = BanList(max_offences=3, window=600.0, duration=600.0, silence_span=60.0, clock=clock)
    assert not bans.offend(LIAR, "no PART", silence=True)
    assert not bans.offend(LIAR, "invalid PART")
    assert bans.offend(LIAR, "invalid GROUP")


def _ticking(clock: Clock, stalls: StallWatch, seconds: float) -> None:
    """The loop runs on time for ``seconds``: a tick every ``TICK_S``."""
    end = clock.now + seconds
    while clock.now < end:
        clock.now = min(end, clock.now + TICK_S)
        stalls.tick()


def test_no_silence_is_charged_while_or_soon_after_this_node_stood() -> None:
    clock = Clock()
    stalls = StallWatch(clock)
    bans = BanList(max_offences=1, window=600.0, duration=600.0, clock=clock, stalls=stalls)
    clock.now += 10  # stopped for 10 s: the loop has not ticked since
    assert not bans.offend(LIAR, "no PART", silence=True)
    stalls.tick()  # running again: the stall is recorded
    _ticking(clock, stalls, MEMORY_S - 1)
    assert not bans.offend(LIAR, "no answer to a JOIN", silence=True)
    assert bans.offend(OTHER, "invalid PART")  # a lie is charged all the same
    assert not bans.banned(LIAR)
    _ticking(clock, stalls, 2)  # past the stall's memory
    assert bans.offend(LIAR, "no PART", silence=True)


def test_ticks_on_time_are_no_stall_and_a_late_one_is(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    stalls = StallWatch(clock)
    for _ in range(20):  # ticks late by up to STALL_S each: a loaded loop, not a stop
        clock.now += STALL_S
        stalls.tick()
        assert not stalls.stalled()
    clock.now += STALL_S + 0.1
    assert stalls.stalled()  # not ticked yet: late now
    with caplog.at_level(logging.WARNING):
        stalls.tick()
    assert stalls.stalled()
    assert f"this node stood for {STALL_S + 0.1:.1f} s" in caplog.text


def test_the_watch_ticks_on_its_loop(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = Clock()
    stalls = StallWatch(clock)
    monkeypatch.setattr(diloco.protocol.trust.stalls, "TICK_S", 0.01)

    async def main() -> None:
        watch = asyncio.create_task(stalls.run())
        await asyncio.sleep(0.02)  # the watch runs
        clock.now += 2 * STALL_S  # the clock jumps as a stop would make it
        await asyncio.sleep(0.05)  # real time: the watch ticks meanwhile
        watch.cancel()

    with caplog.at_level(logging.WARNING):
        asyncio.run(main())
    assert f"this node stood for {2 * STALL_S:.1f} s" in caplog.text


def test_the_seconds_before_the_watch_runs_are_no_stall(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The swarm makes its watch, then starts its DHT (seconds on a loaded machine), then
    its loop: the watch counts from its loop's start."""
    clock = Clock()
    stalls = StallWatch(clock)
    monkeypatch.setattr(diloco.protocol.trust.stalls, "TICK_S", 0.01)
    clock.now += 2 * STALL_S  # the DHT's start

    async def main() -> None:
        watch = asyncio.create_task(stalls.run())
        await asyncio.sleep(0.05)
        watch.cancel()

    with caplog.at_level(logging.WARNING):
        asyncio.run(main())
    assert "stood" not in caplog.text and not stalls.stalled()
