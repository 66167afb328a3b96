"""The one data-parallel byte estimate, against numbers computed by hand."""

from __future__ import annotations

import pytest

from diloco.node.observe.traffic import all_reduce_bytes, all_reduce_factor, data_parallel_bytes


def test_all_reduce_factor_is_two_m_minus_one_over_m() -> None:
    assert all_reduce_factor(1) == 0.0
    assert all_reduce_factor(2) == 1.0
    assert all_reduce_factor(3) == pytest.approx(4 / 3)
    assert all_reduce_factor(8) == pytest.approx(1.75)
    with pytest.raises(ValueError, match="at least 1"):
        all_reduce_factor(0)


def test_all_reduce_bytes_by_hand() -> None:
    # 1,000 values of 4.25 bits among 4 members: 1000 * 4.25 / 8 * 1.5 = 796.875 bytes
    assert all_reduce_bytes(1000, 4.25, 4) == pytest.approx(796.875)


def test_data_parallel_bytes_by_hand() -> None:
    # the demo: tiny preset (853,376 parameters), 600 steps, 3 nodes, bf16 gradients:
    # 853,376 * 2 bytes * 4/3 * 600 = 1,365,401,600 bytes (the old 2 * 4 * N * steps: 4,096 MB)
    dp = data_parallel_bytes(num_params=853_376, steps=600, num_replicas=3)
    assert dp.bytes_sent == pytest.approx(1_365_401_600)
    for part in ("853376 parameters", "16 bits", "M = 3", "1.333", "600 steps"):
        assert part in dp.assumption, part


def test_data_parallel_bytes_bits_and_replicas() -> None:
    # 1e6 parameters, 10 steps, 2 replicas (factor 1), FP32: 4e6 bytes per step
    assert data_parallel_bytes(
        num_params=1e6, steps=10, num_replicas=2, bits=32
    ).bytes_sent == pytest.approx(4e7)
    with pytest.raises(ValueError, match="bits > 0"):
        data_parallel_bytes(num_params=1e6, steps=10, num_replicas=2, bits=0)
