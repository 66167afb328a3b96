"""The norms reducers report and members check: FP64 sums, FP32 transport, any scale."""

from __future__ import annotations

import math

import pytest
import torch

from diloco.protocol.core.norms import block_norms, check_reference, chunk_norm


def test_block_norms_per_block_of_256_values_last_one_short() -> None:
    x = torch.zeros(600)
    x[0], x[255] = 3.0, 4.0  # block 0
    x[256] = -2.0  # block 1
    x[599] = 1.5  # block 2: values 512 .. 599
    assert block_norms(x) == (5.0, 2.0, 1.5)


def test_chunk_norm_fp64_sum_and_fp64_where_fp32_squares_fail() -> None:
    assert chunk_norm(torch.tensor([3.0, 4.0])) == 5.0
    assert chunk_norm(torch.full((4,), 2.0**-100)) == 2.0**-99  # squares underflow FP32
    assert chunk_norm(torch.full((4,), 2.0**100)) == 2.0**101  # squares overflow FP32
    assert math.isnan(chunk_norm(torch.tensor([3.0, float("nan")])))
    assert chunk_norm(torch.tensor([3.0, float("-inf")])) == math.inf


def test_block_norms_agree_with_chunk_norm_block_by_block_at_any_scale() -> None:
    x = torch.randn(5 * 256 + 3, generator=torch.Generator().manual_seed(0))
    x[256:512] *= 2.0**-110  # a block whose FP32 squares underflow
    x[512:768] *= 2.0**80  # and one whose squares overflow
    norms = block_norms(x)
    for b in range(5):
        assert norms[b] == pytest.approx(chunk_norm(x[256 * b : 256 * (b + 1)]), rel=1e-12)
    assert norms[5] == pytest.approx(chunk_norm(x[1280:]), rel=1e-12)


def test_check_reference_is_the_upper_median() -> None:
    assert check_reference([1e-9, 6.0]) == 6.0  # a pair: the larger (a tiny one cannot lower it)
    assert check_reference([1e-9, 6.0, 8.0]) == 6.0
    assert check_reference([4.0, 1.0, 3.0, 2.0]) == 3.0
    assert check_reference([]) == 0.0
