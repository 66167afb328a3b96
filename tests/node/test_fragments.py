from collections import Counter

import pytest

from diloco.node.fragments import (
    fragment_blocks,
    fragment_offset,
    max_in_flight,
    model_fragments,
    send_round,
    send_step,
    sends_at,
)
from diloco.node.model import Transformer, preset


@pytest.mark.parametrize("num_fragments,sync_every", [(1, 30), (5, 30), (4, 10), (7, 5), (3, 3)])
def test_schedule_sends_every_fragment_every_h_steps(num_fragments: int, sync_every: int) -> None:
    total = 10 * sync_every + 7
    sends: dict[int, list[tuple[int, int]]] = {p: [] for p in range(num_fragments)}
    for step in range(1, total + 1):
        for p, k in sends_at(step, sync_every, num_fragments):
            sends[p].append((step, k))
    for p in range(num_fragments):
        t_p = fragment_offset(p, sync_every, num_fragments)
        expected_steps = list(range(t_p + sync_every, total + 1, sync_every))
        assert [s for s, _ in sends[p]] == expected_steps
        assert [k for _, k in sends[p]] == list(range(1, len(expected_steps) + 1))
        assert all(send_step(p, k, sync_every, num_fragments) == s for s, k in sends[p])


def test_schedule_offsets_distinct_when_fewer_fragments_than_h() -> None:
    offsets = [fragment_offset(p, 30, 5) for p in range(5)]
    assert offsets == [0, 6, 12, 18, 24]
    assert len(set(fragment_offset(p, 100, 9) for p in range(9))) == 9


def test_schedule_no_send_before_first_full_period() -> None:
    assert send_round(6, 1, 30, 5) is None  # offset 6: the first send is at 36
    assert send_round(36, 1, 30, 5) == 1
    assert send_round(30, 0, 30, 5) == 1
    assert send_round(0, 0, 30, 5) is None


def test_max_in_flight_matches_spec_bound() -> None:
    assert max_in_flight(30, 5, 1) == 1
    assert max_in_flight(100, 9, 10) == 1
    assert max_in_flight(5, 5, 4) == 5


def test_fragment_blocks_strided_and_sequential() -> None:
    assert fragment_blocks(9, 3, "strided") == [[0, 3, 6], [1, 4, 7], [2, 5, 8]]
    assert fragment_blocks(9, 3, "sequential") == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert fragment_blocks(7, 3, "sequential") == [[0, 1, 2], [3, 4, 5], [6]]
    assert fragment_blocks(7, 3, "strided") == [[0, 3, 6], [1, 4], [2, 5]]
    with pytest.raises(ValueError, match="pattern"):
        fragment_blocks(4, 1, "random")  # type: ignore[arg-type]


@pytest.mark.parametrize("pattern", ["strided", "sequential"])
@pytest.mark.parametrize("embedding", ["own", "first"])
@pytest.mark.parametrize("fragment_size", [1, 2, 3, 10])
def test_model_fragments_every_parameter_in_exactly_one(
    pattern: str, embedding: str, fragment_size: int
) -> None:
    model = Transformer(preset("tiny"))
    fragments = model_fragments(model, model.blocks, fragment_size, pattern, embedding)  # type: ignore[arg-type]
    counts = Counter(id(p) for fragment in fragments for _, p in fragment)
    assert set(counts) == {id(p) for p in model.parameters()}
    assert set(counts.values()) == {1}
    blocks = fragment_blocks(4, fragment_size, pattern)  # type: ignore[arg-type]
    assert len(fragments) == len(blocks) + (embedding == "own")
    for p, block_ids in enumerate(blocks):
        names = {n.split(".")[1] for n, _ in fragments[p] if n.startswith("blocks.")}
        assert names == {str(b) for b in block_ids}
    outside = [
        n for n, _ in fragments[-1 if embedding == "own" else 0] if not n.startswith("blocks.")
    ]
    assert sorted(outside) == ["norm.weight", "tok_emb.weight"]
