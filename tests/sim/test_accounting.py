"""The bandwidth accountant against a run computed by hand."""

from __future__ import annotations

import dataclasses

import pytest

from diloco.codecs import get_codec
from diloco.sim.accounting import CODEC_BITS, RunSpec, Traffic, account

# 4 layers of 0.6e6 parameters; 2 replicas x 4 sequences x 10 tokens = 80 tokens per step,
# so 80,000 tokens are 1,000 steps of 0.5 s. Fragments of one layer: offsets 0, 25, 50, 75.
# Outer gradients in FP32 here (the default is 16 bits, as in the paper's simulation).
RUN = RunSpec(
    num_params=2.4e6,
    num_layers=4,
    num_tokens=80_000,
    batch_size=4,
    seq_len=10,
    num_replicas=2,
    sync_every=100,
    fragment_size=1,
    tau=1,
    codec="e3m0",
    step_seconds=0.5,
    outer_bits=32.0,
)


def test_account_matches_hand_computation() -> None:
    assert RUN.num_steps == 1000
    traffic: dict[str, Traffic] = {t.method: t for t in account(RUN)}
    # (rounds, bytes per replica, peak Gbit/s); the all-reduce factor 2(M-1)/M is 1
    expected = {
        "dp": (1000, 1000 * 2.4e6 * 2, 2.4e6 * 16 / 0.5 / 1e9),
        "diloco": (10, 10 * 2.4e6 * 4, 2.4e6 * 32 / 0.5 / 1e9),
        # fragment rounds: 1000 // 100, 975 // 100, 950 // 100, 925 // 100 = 10 + 9 + 9 + 9
        "streaming": (37, 37 * 0.6e6 * 4, 0.6e6 * 32 / 0.5 / 1e9),
        "streaming-overlap": (37, 37 * 0.6e6 * 4, 0.6e6 * 32 / (2 * 0.5) / 1e9),
        "streaming-overlap-fp4": (37, 37 * 0.6e6 * 4.25 / 8, 0.6e6 * 4.25 / (2 * 0.5) / 1e9),
    }
    assert list(traffic) == list(expected)
    for method, (rounds, per_replica, peak) in expected.items():
        t = traffic[method]
        assert t.num_rounds == rounds, method
        assert t.bytes_per_replica == pytest.approx(per_replica), method
        assert t.bytes_total == pytest.approx(2 * per_replica), method
        assert t.peak_gbps == pytest.approx(peak), method
        assert t.mean_gbps == pytest.approx(per_replica * 8 / (1000 * 0.5) / 1e9), method
        assert t.bytes_vs_dp == pytest.approx(2.4e6 * 2 * 1000 / per_replica), method
    assert traffic["diloco"].bytes_vs_dp == pytest.approx(50)
    assert traffic["diloco"].peak_vs_dp == pytest.approx(0.5)  # FP32 at once: twice DP's peak


def test_account_scales_with_all_reduce_factor() -> None:
    run = dataclasses.replace(RUN, num_replicas=4, num_tokens=160_000)
    four = {t.method: t for t in account(run)}
    two = {t.method: t for t in account(RUN)}
    for method, t in four.items():
        # same number of steps, 2(M-1)/M = 1.5 instead of 1
        assert t.bytes_per_replica == pytest.approx(1.5 * two[method].bytes_per_replica)
        assert t.bytes_total == pytest.approx(4 * t.bytes_per_replica)


@pytest.mark.parametrize("codec", sorted(CODEC_BITS))
def test_account_codec_bits_are_what_the_codec_puts_on_the_wire(codec: str) -> None:
    fp4 = account(dataclasses.replace(RUN, codec=codec))[-1]
    assert fp4.method == "streaming-overlap-fp4"
    n = 2**20  # a whole number of every codec's blocks; the 5-byte header left out
    assert fp4.bits_per_value == 8 * (get_codec(codec).encoded_size(n) - 5) / n


def test_account_default_widths_are_the_papers() -> None:
    widths = {"dp_bits", "outer_bits"}
    fields = {f.name: getattr(RUN, f.name) for f in dataclasses.fields(RUN) if f.name not in widths}
    traffic = {t.method: t for t in account(RunSpec(**fields))}
    # bf16 gradients, 16-bit outer gradients, the codec's 4.25 bits
    assert {m: t.bits_per_value for m, t in traffic.items()} == {
        "dp": 16,
        "diloco": 16,
        "streaming": 16,
        "streaming-overlap": 16,
        "streaming-overlap-fp4": 4.25,
    }
    assert traffic["diloco"].bytes_per_replica == pytest.approx(10 * 2.4e6 * 2)
    assert traffic["diloco"].bytes_vs_dp == pytest.approx(100)


def test_account_dp_bits_sets_data_parallel_row() -> None:
    dp = account(dataclasses.replace(RUN, dp_bits=32.0))[0]
    assert dp.bits_per_value == 32
    assert dp.bytes_per_replica == pytest.approx(1000 * 2.4e6 * 4)
    assert dp.peak_gbps == pytest.approx(2.4e6 * 32 / 0.5 / 1e9)


def test_run_spec_bad_values_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown codec"):
        dataclasses.replace(RUN, codec="fp3")
    with pytest.raises(ValueError, match="tau < H"):
        dataclasses.replace(RUN, tau=100)
    with pytest.raises(ValueError, match="2 replicas"):
        dataclasses.replace(RUN, num_replicas=1)
    with pytest.raises(ValueError, match="bits"):
        dataclasses.replace(RUN, outer_bits=0.0)


def test_account_staged_rounds_cost_two_stages_of_four() -> None:
    # 16 replicas in groups of 4: two stages of 2 * 3/4 = 3.0 values sent per value, flat
    # 2 * 15/16 = 1.875; data-parallel stays one flat ring.
    run = dataclasses.replace(RUN, num_replicas=16, num_tokens=8 * 160_000)
    flat = {t.method: t for t in account(run)}
    staged = {t.method: t for t in account(dataclasses.replace(run, max_group_size=4))}
    assert staged["dp"].bytes_per_replica == flat["dp"].bytes_per_replica
    for method in ("diloco", "streaming", "streaming-overlap-fp4"):
        ratio = staged[method].bytes_per_replica / flat[method].bytes_per_replica
        assert ratio == pytest.approx(3.0 / 1.875), method
        assert staged[method].peak_gbps / flat[method].peak_gbps == pytest.approx(1.6), method


def test_run_spec_refuses_group_size_one() -> None:
    with pytest.raises(ValueError):
        dataclasses.replace(RUN, max_group_size=1)
