"""The grid placement and stage plan against hand-made member sets."""

from __future__ import annotations

import itertools
import random

import pytest

from diloco.protocol.staged.grid import num_stages, plan_grid, split_even


def _peers(n: int) -> list[bytes]:
    return [f"peer-{i}".encode() for i in range(n)]


@pytest.mark.parametrize(
    ("n", "size", "stages"),
    [
        (1, 4, 1),
        (4, 4, 1),
        (5, 4, 2),
        (12, 4, 2),
        (16, 4, 2),
        (17, 4, 3),
        (4096, 64, 2),
        (4096, 8, 4),
    ],
)
def test_num_stages_by_hand(n: int, size: int, stages: int) -> None:
    assert num_stages(n, size) == stages


def test_split_even_by_hand() -> None:
    assert split_even((0, 10), 3) == [(0, 4), (4, 7), (7, 10)]
    assert split_even((5, 13), 2) == [(5, 9), (9, 13)]


def test_plan_grid_twelve_in_fours_is_three_by_four() -> None:
    plan = plan_grid("run/frag0/round1", _peers(12), [1.0] * 12, 4)
    assert plan.shape == (4, 3)
    assert [len(g.contributors) for g in plan.stages[0]] == [4, 4, 4]
    assert [len(g.contributors) for g in plan.stages[1]] == [3, 3, 3, 3]
    assert all(not g.receivers for groups in plan.stages for g in groups)
    assert all(g.weights == (4.0, 4.0, 4.0) for g in plan.stages[1])
    # Stage 1 group j holds the j-th member of each stage-0 group, in group order.
    for j, group in enumerate(plan.stages[1]):
        assert group.contributors == tuple(g.contributors[j] for g in plan.stages[0])


def test_plan_grid_ten_in_fours_has_one_receiver() -> None:
    weights = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0]
    plan = plan_grid("k", _peers(10), weights, 4)
    # Cells of 4, 3 and 3 members; stage 1 has 3 groups, the first cell's 4th member
    # (position 3) receives in group (0 + 3) % 3 = 0.
    assert [len(g.contributors) for g in plan.stages[0]] == [4, 3, 3]
    order = plan.order
    assert [g.contributors for g in plan.stages[1]] == [
        (order[0], order[4], order[7]),
        (order[1], order[5], order[8]),
        (order[2], order[6], order[9]),
    ]
    assert [g.receivers for g in plan.stages[1]] == [(order[3],), (), ()]
    cells = [sum(weights[order[p]] for p in range(a, b)) for a, b in ((0, 4), (4, 7), (7, 10))]
    assert plan.stages[1][0].weights == tuple(cells)


def test_plan_grid_flat_when_small() -> None:
    plan = plan_grid("k", _peers(5), [1.0, 2.0, 3.0, 4.0, 5.0], 8)
    assert plan.num_stages == 1
    (group,) = plan.stages[0]
    assert sorted(group.contributors) == [0, 1, 2, 3, 4]
    assert group.weights == tuple(float(i + 1) for i in group.contributors)


def test_plan_grid_full_grid_groups_share_all_coordinates_but_one() -> None:
    plan = plan_grid("k", _peers(27), [1.0] * 27, 3)
    assert plan.shape == (3, 3, 3)
    assert len(set(plan.coordinates)) == 27
    for s, groups in enumerate(plan.stages):
        for group in groups:
            rest = {c[:s] + c[s + 1 :] for c in (plan.coordinates[i] for i in group.members)}
            assert len(rest) == 1 and len(group.members) == 3


@pytest.mark.parametrize(("n", "size"), list(itertools.product(range(1, 70), range(2, 9))))
def test_plan_grid_every_contribution_reaches_everyone_once(n: int, size: int) -> None:
    rng = random.Random(n * 100 + size)
    weights = [float(rng.randint(1, 9)) for _ in range(n)]
    plan = plan_grid(f"round{n}", _peers(n), weights, size)
    cover = [frozenset([i]) for i in range(n)]
    for groups in plan.stages:
        members = sorted(i for g in groups for i in g.members)
        assert members == list(range(n)), "every member in exactly one group per stage"
        after = list(cover)
        for g in groups:
            assert 1 <= len(g.contributors) <= size
            covers = [cover[i] for i in g.contributors]
            assert sum(map(len, covers)) == len(frozenset().union(*covers)), "no double count"
            # A receiver already holds what one contributor brings.
            assert all(cover[r] in covers for r in g.receivers)
            assert g.weights == tuple(sum(weights[j] for j in c) for c in covers)
            for i in g.members:
                after[i] = frozenset().union(*covers)
        cover = after
    assert all(c == frozenset(range(n)) for c in cover)
    assert sum(plan.stages[-1][0].weights) == sum(weights)


def test_plan_grid_same_for_every_member_whatever_the_order() -> None:
    peers, weights = _peers(20), [float(i + 1) for i in range(20)]
    plan = plan_grid("k", peers, weights, 4)
    perm = list(range(20))
    random.Random(1).shuffle(perm)
    other = plan_grid("k", [peers[i] for i in perm], [weights[i] for i in perm], 4)
    for groups, other_groups in zip(plan.stages, other.stages, strict=True):
        for g, h in zip(groups, other_groups, strict=True):
            assert [peers[i] for i in g.contributors] == [peers[perm[i]] for i in h.contributors]
            assert g.weights == h.weights


def test_plan_grid_placement_depends_on_round_key() -> None:
    peers = _peers(16)
    assert plan_grid("a", peers, [1.0] * 16, 4).order != plan_grid("b", peers, [1.0] * 16, 4).order


@pytest.mark.parametrize(
    ("peers", "weights", "size"),
    [
        ([b"a", b"a"], [1.0, 1.0], 4),
        ([b"a", b"b"], [1.0], 4),
        ([b"a", b"b"], [1.0, 0.0], 4),
        ([b"a", b"b"], [1.0, float("nan")], 4),
        ([b"a", b"b"], [1.0, 1.0], 1),
        ([], [], 4),
    ],
)
def test_plan_grid_rejects_bad_input(peers: list[bytes], weights: list[float], size: int) -> None:
    with pytest.raises(ValueError):
        plan_grid("k", peers, weights, size)
