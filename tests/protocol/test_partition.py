"""The butterfly split against spans computed by hand (docs/design.md "The round")."""

from __future__ import annotations

import itertools

import pytest

from diloco.codecs import CODEC_NAMES, get_codec
from diloco.protocol.core.partition import PART_ALIGN, butterfly_parts, substitute


def test_butterfly_parts_equal_split_by_hand() -> None:
    # 1000 values are 4 blocks of 256 (the last one short): one block per part.
    assert butterfly_parts(1000, 4) == [(0, 256), (256, 512), (512, 768), (768, 1000)]
    # 3 parts of 4 blocks: cuts at round(4/3) = 1 and round(8/3) = 3 blocks.
    assert butterfly_parts(1000, 3) == [(0, 256), (256, 768), (768, 1000)]
    assert butterfly_parts(1024, 2) == [(0, 512), (512, 1024)]


def test_butterfly_parts_one_part_is_the_whole_vector() -> None:
    assert butterfly_parts(70_001, 1) == [(0, 70_001)]


def test_butterfly_parts_weighted_split_by_hand() -> None:
    # 8 blocks in proportion 1 : 3 -> 2 and 6 blocks.
    assert butterfly_parts(2048, 2, weights=[1.0, 3.0]) == [(0, 512), (512, 2048)]
    # 10 blocks in proportion 2 : 1 : 2 -> cuts at 4 and round(6) = 6 blocks.
    assert butterfly_parts(2560, 3, weights=[2.0, 1.0, 2.0]) == [
        (0, 1024),
        (1024, 1536),
        (1536, 2560),
    ]


def test_butterfly_parts_other_alignment_by_hand() -> None:
    # align 32: 100 values are 4 blocks (the last holds 4 values), 2 each; in three parts
    # the cuts are at round(4/3) = 1 and round(8/3) = 3 blocks.
    assert butterfly_parts(100, 2, align=32) == [(0, 64), (64, 100)]
    assert butterfly_parts(100, 3, align=32) == [(0, 32), (32, 96), (96, 100)]


def test_butterfly_parts_small_vector_leaves_parts_empty() -> None:
    # One block for four parts: cuts at round(0.25) = 0, round(0.5) = 0 (half to even),
    # round(0.75) = 1: only the third part reduces anything.
    assert butterfly_parts(100, 4) == [(0, 0), (0, 0), (0, 100), (100, 100)]
    assert butterfly_parts(0, 3) == [(0, 0), (0, 0), (0, 0)]


@pytest.mark.parametrize("numel", [1, 255, 256, 257, 5_000, 70_001])
@pytest.mark.parametrize(
    "weights", [[1.0] * 5, [1.0, 2.0, 3.0, 4.0, 5.0], [9.0, 1.0, 1.0, 1.0, 1.0]]
)
def test_butterfly_parts_cover_the_vector_in_aligned_order(
    numel: int, weights: list[float]
) -> None:
    spans = butterfly_parts(numel, len(weights), weights=weights)
    assert spans[0][0] == 0 and spans[-1][1] == numel
    for (_, end), (start, _) in itertools.pairwise(spans):
        assert end == start
    for start, end in spans:
        assert start <= end
        assert start % PART_ALIGN == 0 or start == numel


def test_butterfly_parts_zero_weight_gives_a_client_an_empty_part() -> None:
    # 4 blocks of 256 shared by the two members of weight 1: 2 blocks each; the client
    # (weight 0) in the middle gets the empty span at the boundary.
    assert butterfly_parts(1024, 3, weights=[1.0, 0.0, 1.0]) == [(0, 512), (512, 512), (512, 1024)]
    assert butterfly_parts(1000, 3, weights=[0.0, 0.0, 1.0]) == [(0, 0), (0, 0), (0, 1000)]


def test_part_align_is_a_multiple_of_every_codec_block() -> None:
    # Why parts encode to the bytes of the whole: no codec block straddles a part boundary.
    assert all(PART_ALIGN % get_codec(name).block_size == 0 for name in CODEC_NAMES)


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        ((100, 0), {}, "num_parts must be >= 1"),
        ((-1, 2), {}, "numel must be >= 0"),
        ((100, 2), {"weights": [1.0]}, "need 2 weights >= 0, one positive"),
        ((100, 2), {"weights": [0.0, 0.0]}, "need 2 weights >= 0, one positive"),
        ((100, 2), {"weights": [1.0, -1.0]}, "need 2 weights >= 0, one positive"),
        ((100, 2), {"weights": [1.0, float("nan")]}, "need 2 weights >= 0, one positive"),
    ],
)
def test_butterfly_parts_bad_arguments_raise(
    args: tuple[int, int], kwargs: dict[str, list[float]], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        butterfly_parts(*args, **kwargs)  # type: ignore[arg-type]


def test_substitute_is_the_next_member_in_group_order() -> None:
    assert [substitute(j, 4) for j in range(4)] == [1, 2, 3, 0]
    assert [substitute(j, 2) for j in range(2)] == [1, 0]
    for bad in [(0, 1), (4, 4), (-1, 3)]:
        with pytest.raises(ValueError):
            substitute(*bad)


def test_substitute_skips_clients_and_is_none_when_only_clients_are_left() -> None:
    clients = (False, True, False, False)
    assert [substitute(j, 4, clients) for j in range(4)] == [2, 2, 3, 0]
    # a pair of one reducer and one client: nobody else may re-reduce the reducer's part
    assert [substitute(j, 2, (False, True)) for j in range(2)] == [None, 0]
