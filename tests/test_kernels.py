"""Kernel time models against their closed forms: GEMM roofline with tile and wave quantization, flash
attention, memory-bound kernels, FP8 peaks; and the runtime's in-training scales."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megapipe.cost.kernels import FLASH_BACKWARD_FLOPS, attention_ms, gemm_ms, memory_ms, peak_flops
from megapipe.errors import ConfigError
from megapipe.records import GpuSpec, RuntimeSpec

H100 = GpuSpec(name="h100", bf16_tflops=989.4, hbm_gbytes_per_s=3350, memory_gib=79.6, fp8_tflops=1978.9,
               num_sms=132, matmul_efficiency=0.8, fp8_matmul_efficiency=0.7, attention_efficiency=0.54,
               attention_backward_efficiency=0.47, bandwidth_efficiency=0.8, kernel_overhead_us=4.0,
               architecture="hopper")
A100 = GpuSpec(name="a100", bf16_tflops=312, hbm_gbytes_per_s=2039, memory_gib=80, num_sms=108,
               architecture="ampere")


def test_large_gemm_runs_at_the_sustained_efficiency():
    """8192^3 fills 128x256 tiles exactly (32 x 64 = 2048 tiles = 15.5 waves of 132): the time is the FLOPs
    at efficiency x peak, over the useful share of the last wave, plus one kernel's overhead."""
    m = n = k = 8192
    tiles = (m // 128) * (n // 128)  # the 128 x 128 tile wins: 4096 tiles in 32 waves, 0.97 useful
    useful = tiles / (math.ceil(tiles / 132) * 132)
    expected = 2 * m * n * k / (0.8 * 989.4e12 * useful) * 1e3 + 4e-3
    assert gemm_ms(m=m, n=n, k=k, dtype="bf16", gpu=H100) == pytest.approx(expected)


def test_tile_and_wave_quantization_penalise_ragged_shapes():
    """One row more than a tile multiple pads a whole tile row; a few tiles leave most SMs idle."""
    def rate(m, n, k):
        return 2 * m * n * k / (gemm_ms(m=m, n=n, k=k, dtype="bf16", gpu=H100) - 4e-3) / 1e9  # TFLOP/s

    # 132 tiles of 128 x 128 fill the 132 SMs once; one row more needs a second wave for one tile row.
    assert rate(128 * 11 + 1, 128 * 12, 65536) < 0.55 * rate(128 * 11, 128 * 12, 65536)
    assert rate(256, 256, 65536) < 0.1 * rate(8192, 8192, 8192)  # 2-8 tiles on 132 SMs
    # Tensor parallelism splits n: the per-GPU GEMM gets relatively less efficient, never faster per FLOP.
    whole = rate(8192, 28672, 8192)
    for tp in (2, 4, 8):
        assert rate(8192, 28672 // tp, 8192) <= whole * (1 + 1e-9)


def test_skinny_gemm_is_memory_bound():
    """m = 16 tokens against a 8192 x 8192 weight: 134 MB to read at 0.8 x 3.35 TB/s beats 2 TFLOP of math."""
    m, n, k = 16, 8192, 8192
    memory = (2 * (m * k + k * n) + 2 * m * n) / (0.8 * 3350e9) * 1e3
    assert gemm_ms(m=m, n=n, k=k, dtype="bf16", gpu=H100) == pytest.approx(memory + 4e-3)


def test_fp8_gemms_use_the_fp8_peak_and_refuse_gpus_without_it():
    m = n = k = 8192
    bf16 = gemm_ms(m=m, n=n, k=k, dtype="bf16", gpu=H100) - 4e-3
    fp8 = gemm_ms(m=m, n=n, k=k, dtype="fp8", gpu=H100) - 4e-3
    assert bf16 / fp8 == pytest.approx((1978.9 * 0.7) / (989.4 * 0.8))
    assert peak_flops(H100, "fp32") == pytest.approx(989.4e12 / 2)
    with pytest.raises(ConfigError, match="no FP8 tensor cores"):
        gemm_ms(m=m, n=n, k=k, dtype="fp8", gpu=A100)


def test_runtime_scales_the_architecture_it_names():
    runtime = RuntimeSpec(gemm_efficiency_by_architecture=(("hopper", 0.5),), gemm_efficiency_scale=0.9,
                          attention_efficiency_by_architecture=(("hopper", 0.25),))
    base = gemm_ms(m=8192, n=8192, k=8192, dtype="bf16", gpu=H100) - 4e-3
    assert gemm_ms(m=8192, n=8192, k=8192, dtype="bf16", gpu=H100, runtime=runtime) - 4e-3 == pytest.approx(2 * base)
    a100 = gemm_ms(m=8192, n=8192, k=8192, dtype="bf16", gpu=A100) - A100.kernel_overhead_us * 1e-3
    scaled = gemm_ms(m=8192, n=8192, k=8192, dtype="bf16", gpu=A100, runtime=runtime) - A100.kernel_overhead_us * 1e-3
    assert scaled == pytest.approx(a100 / 0.9)  # ampere is not listed: the default scale
    common = dict(batch_heads=8, q_len=8192, kv_len=8192, head_dim=128, causal=True, backward=False, gpu=H100)
    assert attention_ms(runtime=runtime, **common) - 4e-3 == pytest.approx(4 * (attention_ms(**common) - 4e-3))


def test_causal_flash_attention_counts_the_triangle_and_its_diagonal_blocks():
    """4 b a s^2 d / 2 plus the 128-row diagonal blocks, at the forward efficiency; backward 2.5x the FLOPs."""
    heads, s, d = 8, 8192, 128
    pairs = s * s / 2 + s * 128 / 2
    blocks = heads * (s // 128)
    useful = blocks / (math.ceil(blocks / 132) * 132)
    forward = attention_ms(batch_heads=heads, q_len=s, kv_len=s, head_dim=d, causal=True, backward=False, gpu=H100)
    assert forward == pytest.approx(4 * heads * pairs * d / (0.54 * 989.4e12 * useful) * 1e3 + 4e-3)
    backward = attention_ms(batch_heads=heads, q_len=s, kv_len=s, head_dim=d, causal=True, backward=True, gpu=H100)
    assert backward == pytest.approx(FLASH_BACKWARD_FLOPS * 4 * heads * pairs * d / (0.47 * 989.4e12 * useful) * 1e3
                                     + 4e-3)
    full = attention_ms(batch_heads=heads, q_len=s, kv_len=s, head_dim=d, causal=False, backward=False, gpu=H100)
    assert 1.9 < (full - 4e-3) / (forward - 4e-3) < 2.0


def test_memory_bound_kernels_move_bytes_at_the_achieved_bandwidth():
    assert memory_ms(num_bytes=2.68e9, gpu=H100) == pytest.approx(1.0)
    assert memory_ms(num_bytes=0.0, gpu=H100, kernels=10) == pytest.approx(0.04)


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 20000), st.integers(1, 20000), st.integers(1, 20000))
def test_gemm_time_grows_with_every_side(m, n, k):
    """More rows, columns or reduction never take less time (within the tile choice)."""
    base = gemm_ms(m=m, n=n, k=k, dtype="bf16", gpu=H100)
    assert gemm_ms(m=m, n=n, k=2 * k, dtype="bf16", gpu=H100) >= base
    assert gemm_ms(m=2 * m, n=n, k=k, dtype="bf16", gpu=H100) >= base * (1 - 1e-12)
    assert gemm_ms(m=m, n=2 * n, k=k, dtype="bf16", gpu=H100) >= base * (1 - 1e-12)
    floor = 2 * m * n * k / (0.8 * 989.4e12) * 1e3
    assert base >= floor  # never faster than the sustained peak
