"""The pure core of the all-reduce: who counts, the average, the member-side assembly.

No streams, no loop: events are fed by hand, as ``AllReduceRunner`` feeds them.
"""

from __future__ import annotations

import dataclasses
import hashlib

import pytest
import torch

from diloco.codecs import get_codec
from diloco.errors import ProtocolError
from diloco.protocol.core.assembly import Assembly, AveragedPart
from diloco.protocol.core.round import (
    CHUNK_VALUES,
    Chunk,
    PartReducer,
    RoundPlan,
    check_values,
    chunk_spans,
    part_digest,
)
from diloco.protocol.wire.frames import RoundTag
from diloco.protocol.wire.part import Averaged, PartHead

NONE = get_codec("none")
TAG = RoundTag(bytes(range(16)), 2, 5)
GID = b"g" * 16


def _plan(
    index: int = 0, weights: tuple[float, ...] = (1.0, 3.0, 1.0), clip_factor: float = 0.0
) -> RoundPlan:
    """Three members; part 0 is two chunks of 4 values, parts 1 and 2 one chunk each."""
    return RoundPlan(
        tag=TAG,
        group_id=GID,
        index=index,
        weights=weights,
        spans=((0, 8), (8, 12), (12, 16)),
        chunks=(((0, 4), (4, 8)), ((8, 12),), ((12, 16),)),
        chunk_norms=((2.0, 2.0), (2.0,), (2.0,)),
        codec=NONE,
        return_codec=NONE,
        max_norm_ratio=10.0,
        clip_factor=clip_factor,
    )


def _full(value: float, n: int = 4) -> torch.Tensor:
    return torch.full((n,), value)


def _chunk(value: float) -> Chunk:
    """A checked chunk of four values ``value`` (norm ``2 * |value|``)."""
    payload = NONE.encode(_full(value))
    return Chunk(_full(value), 2 * abs(value), payload, hashlib.sha256(payload).digest())


def test_check_values_nan_rejected() -> None:
    with pytest.raises(ProtocolError, match="finite"):
        check_values(torch.tensor([1.0, float("nan")]), 1.0, 10.0)


def test_check_values_norm_over_bound_rejected() -> None:
    check_values(torch.full((4,), 4.0), 1.0, 8.0)  # norm 8: at the bound
    with pytest.raises(ProtocolError, match="norm"):
        check_values(torch.full((4,), 4.01), 1.0, 8.0)


def test_check_values_zero_reference_checks_only_finiteness() -> None:
    check_values(torch.full((4,), 1e30), 0.0, 8.0)


def test_chunk_spans_cover_part_and_keep_alignment() -> None:
    spans = chunk_spans(512, 512 + 2 * 1024 + 7, chunk_values=1024)
    assert spans == [(512, 1536), (1536, 2560), (2560, 2567)]
    assert chunk_spans(256, 256) == [(256, 256)]
    with pytest.raises(ValueError, match="multiple"):
        chunk_spans(0, 10, chunk_values=100)


def test_round_plan_build_cuts_parts_into_chunks_with_own_norms() -> None:
    delta = torch.zeros(2 * CHUNK_VALUES + 512)
    delta[0] = 3.0
    delta[1] = 4.0
    plan = RoundPlan.build(
        tag=TAG,
        group_id=GID,
        index=1,
        weights=[1.0, 1e30],
        delta=delta,
        codec=NONE,
        return_codec=NONE,
        max_norm_ratio=10.0,
        max_weight=5.0,
        clip_factor=2.0,
    )
    half = CHUNK_VALUES + 256
    assert plan.spans == ((0, half), (half, 2 * CHUNK_VALUES + 512))
    assert plan.chunks[0] == ((0, CHUNK_VALUES), (CHUNK_VALUES, half))
    assert plan.chunk_norms[0] == (5.0, 0.0)
    assert plan.numel == delta.numel() and plan.num_members == 2
    assert plan.weights == (1.0, 5.0)  # clamped to the cap, whatever the group says


def test_part_reducer_counts_only_first_chunks_in_before_the_gather_closed() -> None:
    reducer = PartReducer(_plan())
    assert reducer.counting(1, 0) and not reducer.counting(1, 1)
    assert reducer.add_chunk(1, 0, _chunk(1.0))
    assert not reducer.gather_complete()  # member 2 has not sent
    assert reducer.close_gather() == {2: "nothing sent"}
    assert reducer.mask == (True, True, False) and reducer.counted == [0, 1]
    assert not reducer.counting(2, 0) and not reducer.add_chunk(2, 0, _chunk(1.0))
    assert reducer.counting(1, 1) and not reducer.counting(2, 1)


def test_part_reducer_excluded_member_stops_counting_and_is_not_awaited() -> None:
    reducer = PartReducer(_plan())
    reducer.add_chunk(1, 0, _chunk(1.0))
    assert reducer.exclude(2, "garbage") and not reducer.exclude(2, "again")
    assert not reducer.wants(2, 0)
    assert reducer.gather_complete()
    assert reducer.close_gather() == {2: "garbage"}


def test_part_reducer_skips_chunks_held_before_a_cut() -> None:
    reducer = PartReducer(_plan())
    reducer.add_chunk(1, 0, _chunk(1.0))
    assert not reducer.wants(1, 0) and reducer.wants(1, 1)
    reducer.add_chunk(1, 1, _chunk(1.0))
    assert not reducer.wants(1, 1)


def test_part_reducer_counted_member_that_stops_fails_the_chunk() -> None:
    reducer = PartReducer(_plan())
    reducer.add_chunk(1, 0, _chunk(1.0))
    reducer.add_chunk(2, 0, _chunk(1.0))
    reducer.close_gather()
    reducer.add_chunk(2, 1, _chunk(1.0))
    assert reducer.chunk_ready(0) and not reducer.chunk_ready(1)
    assert reducer.stopped(0) == [] and reducer.stopped(1) == [1]
    reducer.exclude(1, "invalid chunk 1")
    assert reducer.chunk_ready(1) and reducer.stopped(1) == [1]


def test_part_reducer_average_weights_counted_members_in_group_order() -> None:
    reducer = PartReducer(_plan(weights=(1.0, 3.0, 4.0)))
    reducer.add_chunk(1, 0, _chunk(3.0))
    reducer.close_gather()  # member 2 absent: weights renormalised over 1 + 3
    msg, decoded, clipped = reducer.average(0, own=_full(-1.0))
    assert torch.equal(decoded, _full(2.0))  # 1/4 * -1 + 3/4 * 3
    assert clipped == []  # clip factor 0: off
    assert bytes(msg.payload) == NONE.encode(_full(2.0))
    assert msg.head == PartHead(TAG, GID, 0, 0) and msg.mask == (True, True, False)
    # every member's chunk norm (own: 2, member 1's as checked: 6, absent: 0); one block;
    # the seal's head counts the part's chunks
    assert msg.norms == (2.0, 6.0, 0.0) and msg.block_norms == (2.0,)
    assert reducer.plan.seal_head(0) == PartHead(TAG, GID, 0, 2)
    assert not reducer.averaged_ready(0)
    reducer.add_average(0, msg)
    assert reducer.averaged_ready(0) and reducer.averaged[0] is msg


def test_part_reducer_average_clips_against_the_lower_median() -> None:
    reducer = PartReducer(_plan(weights=(2.0, 3.0, 4.0), clip_factor=2.0))
    reducer.add_chunk(1, 0, _chunk(3.0))
    reducer.add_chunk(2, 0, _chunk(-24.0))
    reducer.close_gather()
    # norms 2, 6, 48; lower median 6, bound 12: member 2 scaled by 12 / 48 to -6 per value;
    # weights capped at their lower median 3: mean = 2/8 * 1 + 3/8 * 3 + 3/8 * -6 = -0.875
    # (every factor exact in binary)
    msg, decoded, clipped = reducer.average(0, own=_full(1.0))
    assert clipped == [2]
    assert torch.equal(decoded, _full(-0.875))
    assert msg.norms == (2.0, 6.0, 48.0)  # the norms it clipped by, for the checkers


def test_part_reducer_failed_part_releases_the_senders() -> None:
    reducer = PartReducer(_plan())
    reducer.fail("members [1] stopped sending mid-part")
    assert reducer.averaged_ready(0) and reducer.failed


def test_part_reducer_digest_is_the_averaged_bodies_in_order() -> None:
    reducer = PartReducer(_plan())
    reducer.add_chunk(1, 0, _chunk(1.0))
    reducer.close_gather()
    mask = (True, True, False)
    first, second = _averaged(0, 0, mask, 1.0), _averaged(0, 1, mask, 2.0)
    reducer.add_average(0, first)
    reducer.add_average(1, second)
    bodies = first.serialize() + second.serialize()
    assert reducer.digest() == hashlib.sha256(bodies).digest()


@pytest.mark.parametrize(
    ("payload", "match"),
    [
        (get_codec("bf16").encode(_full(1.0)), "codec id"),
        (b"\x00" + b"\xff" * 20, "does not decode"),
        (NONE.encode(_full(1.0, 5)), "5 values, expected 4"),
        (NONE.encode(_full(0.0))[:5] + _full(float("nan")).numpy().tobytes(), "finite"),
    ],
)
def test_part_reducer_invalid_chunk_rejected(payload: bytes, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        PartReducer(_plan()).check_chunk(0, payload)


def test_part_reducer_excludes_first_chunks_over_the_groups_median_norm() -> None:
    reducer = PartReducer(_plan())  # own norm 2, ratio 10
    reducer.add_chunk(1, 0, reducer.check_chunk(0, NONE.encode(_full(3.0))))  # norm 6
    reducer.add_chunk(2, 0, reducer.check_chunk(0, NONE.encode(_full(31.0))))  # norm 62
    # norms 2, 6, 62: upper median 6, bound 60
    excluded = reducer.exclude_oversized()
    assert list(excluded) == [2] and "norm 62 > 10 x the group's median norm 6" in excluded[2]
    assert reducer.close_gather() == {2: excluded[2]}


def test_part_reducer_with_a_tiny_own_norm_excludes_no_honest_chunk() -> None:
    # Own norm 2e-9: 6 and 8 are a billion times it, within 10x of the group's median (6).
    plan = dataclasses.replace(_plan(), chunk_norms=((2e-9, 2e-9), (2e-9,), (2e-9,)))
    reducer = PartReducer(plan)
    reducer.add_chunk(1, 0, reducer.check_chunk(0, NONE.encode(_full(3.0))))
    reducer.add_chunk(2, 0, reducer.check_chunk(0, NONE.encode(_full(4.0))))
    assert reducer.exclude_oversized() == {}
    assert reducer.close_gather() == {} and reducer.counted == [0, 1, 2]


def test_part_reducer_valid_chunk_decoded_and_kept_with_its_hash() -> None:
    values = torch.tensor([1.0, -2.0, 0.0, 2.0])
    payload = NONE.encode(values)
    reducer = PartReducer(_plan())
    chunk = reducer.check_chunk(1, payload)
    assert torch.equal(chunk.values, values) and chunk.norm == 3.0
    assert (chunk.payload, chunk.sha256) == (payload, hashlib.sha256(payload).digest())
    reducer.add_chunk(2, 0, _chunk(1.0))
    reducer.add_chunk(2, 1, chunk)
    assert reducer.hashes(2) == [_chunk(1.0).sha256, chunk.sha256] and reducer.hashes(1) == []


def _averaged(part: int, chunk: int, mask: tuple[bool, ...], value: float) -> Averaged:
    norms = tuple(1.0 if counted else 0.0 for counted in mask)
    head = PartHead(TAG, GID, part, chunk)
    return Averaged(head, mask, norms, (2 * abs(value),), NONE.encode(_full(value)))


def test_averaged_part_assembles_chunks_and_digest_matches_the_reducer() -> None:
    part = AveragedPart(_plan(index=1), 0)
    mask = (True, True, False)
    assert part.body_size(0) == len(_averaged(0, 0, mask, 1.0).serialize())
    for c, value in enumerate((1.0, 2.0)):
        msg = _averaged(0, c, mask, value)
        part.check(c, msg)
        part.add(c, msg, part.decode(c, msg.payload), msg.serialize())
    assert part.complete and part.mask == mask
    assert torch.equal(torch.cat(part.values), torch.tensor([1.0] * 4 + [2.0] * 4))
    assert part.norms == [(1.0, 1.0, 0.0)] * 2 and part.block_norms == [(2.0,), (4.0,)]
    bodies = [_averaged(0, c, mask, value).serialize() for c, value in enumerate((1.0, 2.0))]
    assert part.digest() == part_digest(bodies)
    assert part.digest() == hashlib.sha256(b"".join(bodies)).digest()


@pytest.mark.parametrize(
    ("msg", "match"),
    [
        (_averaged(0, 1, (True, True, True), 1.0), "another round, group, part or chunk"),
        (_averaged(1, 0, (True, True, True), 1.0), "another round, group, part or chunk"),
        (_averaged(0, 0, (True, True), 1.0), "mask of 2 members"),
        (dataclasses.replace(_averaged(0, 0, (True,) * 3, 1.0), block_norms=()), "0 block norms"),
    ],
)
def test_averaged_part_wrong_chunk_rejected(msg: Averaged, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        AveragedPart(_plan(index=1), 0).check(0, msg)


def test_averaged_part_must_count_whoever_averaged_it() -> None:
    msg = _averaged(0, 0, (False, True, True), 1.0)  # part 0 without its reducer, member 0
    with pytest.raises(ProtocolError, match="without the reducer"):
        AveragedPart(_plan(index=1), 0).check(0, msg)
    AveragedPart(_plan(index=1), 0, reducer=1).check(0, msg)  # re-reduced by member 1
    with pytest.raises(ProtocolError, match="without the reducer"):
        AveragedPart(_plan(index=2), 0, reducer=1).check(
            0, _averaged(0, 0, (False, False, True), 1.0)
        )


def test_averaged_part_mask_changed_mid_part_rejected() -> None:
    part = AveragedPart(_plan(index=1), 0)
    first = _averaged(0, 0, (True, True, True), 1.0)
    part.check(0, first)
    part.add(0, first, part.decode(0, first.payload), first.serialize())
    with pytest.raises(ProtocolError, match="changed"):
        part.check(1, _averaged(0, 1, (True, False, True), 1.0))


def test_averaged_part_values_over_the_norm_bound_rejected() -> None:
    # Own norm 2e-9: no reference. The reducer reports norms 1, 4 and 3 (upper median 3),
    # ratio 10: norm 30 at most.
    plan = dataclasses.replace(_plan(index=1), chunk_norms=((2e-9, 2e-9), (2e-9,), (2e-9,)))
    part = AveragedPart(plan, 0)
    part.check(0, dataclasses.replace(_averaged(0, 0, (True,) * 3, 1.0), norms=(1.0, 4.0, 3.0)))
    part.decode(0, NONE.encode(_full(15.0)))  # norm 30
    with pytest.raises(ProtocolError, match="norm"):
        part.decode(0, NONE.encode(_full(15.01)))
    with pytest.raises(ProtocolError, match="does not decode"):
        part.decode(0, b"\x00\x01")


def test_assembly_result_zero_where_missing_and_full_contributors() -> None:
    assembly = Assembly(_plan())
    assembly.add(0, (True, True, False), torch.arange(8.0), b"d0")
    assembly.add(2, (True, True, True), torch.full((4,), 7.0), b"d2")
    result = assembly.result()
    assert result.held == (True, False, True)
    assert torch.equal(result.delta, torch.tensor([*range(8), 0, 0, 0, 0, 7, 7, 7, 7.0]))
    assert result.full == (True, True, False)
    assert result.digest == hashlib.sha256(b"d0d2").digest()
    with pytest.raises(ValueError, match="values"):
        assembly.add(1, (True, True, True), torch.zeros(5), b"d1")
