"""FragmentState: the one outer-state record and its hash."""

from __future__ import annotations

import hashlib
import struct

import pytest
import torch

from diloco.errors import ProtocolError
from diloco.protocol.state.fragment import FragmentState


def test_sha256_is_the_hash_of_outer_then_momentum_as_le_fp32() -> None:
    state = FragmentState(torch.tensor([1.0, -2.5]), torch.tensor([0.25, 0.0]), 7)
    expected = hashlib.sha256(struct.pack("<4f", 1.0, -2.5, 0.25, 0.0)).hexdigest()
    assert state.sha256() == expected


def test_sha256_changes_with_any_byte_and_with_the_split() -> None:
    state = FragmentState(torch.zeros(8), torch.zeros(8))
    before = state.sha256()
    state.momentum[7] = 1e-30
    assert state.sha256() != before
    swapped = FragmentState(state.momentum.clone(), state.outer.clone())
    assert swapped.sha256() != state.sha256()


def test_check_rejects_non_finite_mismatch_dtype_shape_and_version() -> None:
    with pytest.raises(ProtocolError, match="non-finite"):
        FragmentState(torch.tensor([float("inf")]), torch.zeros(1), 1).check()
    with pytest.raises(ProtocolError, match="non-finite"):
        FragmentState(torch.zeros(1), torch.tensor([float("nan")]), 1).check()
    with pytest.raises(ProtocolError, match="length"):
        FragmentState(torch.zeros(2), torch.zeros(3), 1).check()
    with pytest.raises(ProtocolError, match="float32"):
        FragmentState(torch.zeros(2, dtype=torch.float64), torch.zeros(2), 1).check()
    with pytest.raises(ProtocolError, match="1-D"):
        FragmentState(torch.zeros(2, 2), torch.zeros(2, 2), 1).check()
    with pytest.raises(ProtocolError, match="version"):
        FragmentState(torch.zeros(2), torch.zeros(2), -1).check()
    FragmentState(torch.zeros(2), torch.zeros(2), 0).check()


def test_clone_does_not_follow_in_place_updates() -> None:
    state = FragmentState(torch.zeros(3), torch.ones(3), 4)
    copy = state.clone()
    state.outer.add_(1.0)
    state.momentum.mul_(2.0)
    state.version = 5
    assert torch.equal(copy.outer, torch.zeros(3)) and torch.equal(copy.momentum, torch.ones(3))
    assert copy.version == 4
