"""``InProcessReducer`` against means, clipping and byte counts worked by hand."""

from __future__ import annotations

import torch

from diloco.codecs import get_codec
from diloco.protocol.core.reducer import Contribution, InProcessReducer, RoundKey
from diloco.protocol.core.round import CHUNK_VALUES

KEY = RoundKey(0, 1)


def test_in_process_reducer_weighted_mean_by_hand() -> None:
    contributions = [
        Contribution("a", torch.tensor([1.0, 2.0]), 1.0),
        Contribution("b", torch.tensor([3.0, 6.0]), 3.0),
    ]
    # norms sqrt(5) and 3 sqrt(5): the plain mean (clipping off)
    reducer = InProcessReducer(get_codec("none"), clip_factor=0)
    result = reducer.reduce(KEY, contributions).result()
    assert result.delta.tolist() == [2.5, 5.0]
    assert result.members == ("a", "b")
    assert (reducer.clipped, reducer.combined) == (0, 2)


def test_in_process_reducer_caps_weights_and_clips_per_chunk() -> None:
    # Member b claims weight 1e30 (capped to 3, then to the lower median of 1 and 3: 1) and
    # sends 8x a's values: norm ratio 8 > C = 2, so b enters at 2x a's values:
    # mean = 1/2 * [1, 2] + 1/2 * [2, 4] = [1.5, 3].
    contributions = [
        Contribution("a", torch.tensor([1.0, 2.0]), 1.0),
        Contribution("b", torch.tensor([8.0, 16.0]), 1e30),
    ]
    reducer = InProcessReducer(get_codec("none"), max_weight=3.0, clip_factor=2.0)
    result = reducer.reduce(KEY, contributions).result()
    assert result.delta.tolist() == [1.5, 3.0]
    assert (reducer.clipped, reducer.combined) == (1, 2)


def test_in_process_reducer_clips_each_chunk_against_its_own_median() -> None:
    # Two parts of CHUNK_VALUES + 256 values each: chunks [0, C), [C, C+256), and so on.
    # Member b is 10x a in the first chunk of each part only: those two chunks are clipped.
    n = 2 * (CHUNK_VALUES + 256)
    a = torch.ones(n)
    b = torch.ones(n)
    for lo, hi in [(0, CHUNK_VALUES), (CHUNK_VALUES + 256, 2 * CHUNK_VALUES + 256)]:
        b[lo:hi] = 10.0
    contributions = [Contribution("a", a, 1.0), Contribution("b", b, 1.0)]
    reducer = InProcessReducer(get_codec("none"), clip_factor=2.0)
    result = reducer.reduce(KEY, contributions).result()
    expected = torch.ones(n)
    expected[0:CHUNK_VALUES] = 1.5  # (1 + 2) / 2: b clipped to twice a's norm
    expected[CHUNK_VALUES + 256 : 2 * CHUNK_VALUES + 256] = 1.5
    assert torch.equal(result.delta, expected)
    assert (reducer.clipped, reducer.combined) == (2, 8)


def test_in_process_reducer_uses_decoded_values_both_ways() -> None:
    # E3M0, scale 1 (levels 2**-6 .. 1): members send 0.3 -> 0.25, 0.5 and 0.25 exactly;
    # the mean [1, 0.25, 0.375] is encoded again and 0.375, a tie, goes away from zero to 0.5.
    contributions = [
        Contribution("a", torch.tensor([1.0, 0.3, 0.5]), 1.0),
        Contribution("b", torch.tensor([1.0, 0.3, 0.25]), 1.0),
    ]
    reducer = InProcessReducer(get_codec("e3m0"), clip_factor=0)  # clipped: a's norm > b's
    result = reducer.reduce(KEY, contributions).result()
    assert result.delta.tolist() == [1.0, 0.25, 0.5]


def test_in_process_reducer_single_member_gets_its_own_decoded_delta() -> None:
    # docs/design.md "Algorithm and schedule": 0.3 -> 0.25 and -0.6 -> -0.5 (nearer than -1);
    # nothing goes on the wire.
    alone = [Contribution("me", torch.tensor([1.0, 0.3, -0.6, 0.0]), 5.0)]
    result = InProcessReducer(get_codec("e3m0")).reduce(KEY, alone).result()
    assert result.delta.tolist() == [1.0, 0.25, -0.5, 0.0]
    assert result.members == ("me",)
    assert (result.bytes_sent, result.bytes_received) == (0, 0)


def _equal(num_members: int, numel: int) -> list[Contribution]:
    return [Contribution(f"m{i}", torch.full((numel,), float(i)), 1.0) for i in range(num_members)]


def test_in_process_reducer_byte_counts_two_members_by_hand() -> None:
    # Parts [0, 256) and [256, 300); raw FP32 payloads are 5 + 4n bytes: 1029 and 181.
    # Each member sends the other's part (scatter) and its averaged part (gather).
    result = InProcessReducer(get_codec("none")).reduce(KEY, _equal(2, 300)).result()
    assert (result.bytes_sent, result.bytes_received) == (181 + 1029, 1029 + 181)
    assert result.delta.tolist() == [0.5] * 300


def test_in_process_reducer_byte_counts_three_members_e3m0_by_hand() -> None:
    # Parts of 256, 256 and 88 values; E3M0 payloads are 5 + 17 * ceil(n / 32): 141 and 56.
    # Member 0 and 1 each send 141 + 56 + 2 * 141 = 479, member 2 sends 2 * 141 + 2 * 56
    # = 394, and receive as much; the result reports the mean per member, 1352 // 3.
    result = InProcessReducer(get_codec("e3m0")).reduce(KEY, _equal(3, 600)).result()
    assert (result.bytes_sent, result.bytes_received) == (450, 450)


def test_in_process_reducer_return_codec_sizes_the_gather_phase() -> None:
    # Scatter in E3M0 (141 bytes a part of 256), gather in raw FP32 (1029 bytes).
    reducer = InProcessReducer(get_codec("e3m0"), return_codec=get_codec("none"))
    result = reducer.reduce(KEY, _equal(2, 512)).result()
    assert (result.bytes_sent, result.bytes_received) == (141 + 1029, 141 + 1029)
