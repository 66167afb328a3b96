from collections import Counter

import pytest

from diloco.node.model.fragments import (
    fragment_blocks,
    fragment_offset,
    last_send,
    last_sent_round,
    max_in_flight,
    model_fragments,
    next_send_step,
    send_round,
    send_step,
    sends_at,
)
from diloco.node.model.transformer import Transformer, preset


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


def test_last_sent_round_and_next_send_step_by_hand() -> None:
    # H 10, 5 fragments: fragment 1 has offset 2 and sends rounds 1, 2 at steps 12, 22.
    last = {0: 0, 1: 0, 11: 0, 12: 1, 21: 1, 22: 2, 31: 2}
    assert {t: last_sent_round(t, 1, 10, 5) for t in last} == last
    following = {0: 12, 1: 12, 12: 12, 13: 22, 22: 22, 23: 32}
    assert {t: next_send_step(t, 1, 10, 5) for t in following} == following
    assert {t: next_send_step(t, 0, 10, 5) for t in (1, 10, 11)} == {1: 10, 10: 10, 11: 20}


def test_last_send_of_each_fragment_by_hand() -> None:
    # H 30, 5 fragments, 150 steps (the healing-attack swarm): fragment p sends at 6p + 30k.
    last = {(0, 120): False, (0, 150): True, (1, 96): False, (1, 126): True, (4, 144): True}
    assert {(p, t): last_send(t, p, 30, 5, 150) for p, t in last} == last


@pytest.mark.parametrize("num_fragments,sync_every", [(5, 10), (7, 5), (3, 3)])
def test_last_and_next_agree_with_the_sends(num_fragments: int, sync_every: int) -> None:
    sends: dict[int, list[tuple[int, int]]] = {p: [] for p in range(num_fragments)}
    total = 6 * sync_every
    for step in range(1, total + 1):
        for p, k in sends_at(step, sync_every, num_fragments):
            sends[p].append((step, k))
    for p, sent in sends.items():
        for step in range(0, total - sync_every):
            last = max((k for s, k in sent if s <= step), default=0)
            assert last_sent_round(step, p, sync_every, num_fragments) == last
            first = min(s for s, _ in sent if s >= step)
            assert next_send_step(step, p, sync_every, num_fragments) == first
