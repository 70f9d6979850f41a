"""Kernel times on one GPU: GEMMs by shape, flash attention, memory-bound kernels.

**GEMM** (``m x k`` by ``k x n``, ``2 m n k`` FLOPs) -- the roofline (Williams et al. 2009) with the
quantization effects of a tiled GPU GEMM (NVIDIA, "Matrix Multiplication Background User's
Guide", Deep Learning Performance docs: tile and wave quantization):

    time = max(2 m n k / (eta * peak * u),  bytes / (eta_hbm * hbm)) + kernel overhead
    u    = m n / (waves * SMs * tile_m * tile_n),  waves = ceil(tiles / SMs)

``u`` is the share of issued tile work that is useful: the output is padded to whole tiles, and
the tiles run in waves of one tile per SM. cuBLAS picks the tile shape per problem; the best of
128x256, 256x128 and 128x128 is taken. ``eta`` is the GPU's sustained large-GEMM efficiency
(maximum achievable matmul FLOPS, measured per GPU and cited in its cluster file) times the
runtime's in-training scale. The bytes are both inputs and the output, once each. This is how
tensor parallelism changes a GEMM's efficiency: splitting ``n`` or ``k`` by t shrinks the tile
count and the work per byte.

**Attention** (flash/fused kernels; Dao 2023, "FlashAttention-2"; Shah et al. 2024,
"FlashAttention-3"): ``4 b a s_q s_k d`` FLOPs for the full square, of which a causal kernel
computes the lower triangle plus the diagonal blocks it cannot skip; the backward runs five
``s x s`` matmuls against the forward's two (2.5x the FLOPs). Query blocks of 128 rows per head
are the kernel's thread blocks, quantized in waves over the SMs like GEMM tiles.

**Grouped GEMM** (a MoE layer's routed experts; Transformer Engine's ``GroupedLinear``, which runs one
cuBLAS GEMM per local expert over :data:`GEMM_STREAMS` CUDA streams, ``nvte_multi_stream_cublas_gemm``):
the GEMMs of one round of streams share the SMs' waves. Each expert streams its own weights, which a
small token count per expert cannot hide under its MMAs: ``time = max(c, m) + beta min(c, m)`` for
compute ``c`` and operand traffic ``m``, with ``beta`` = :data:`GROUPED_LOAD_SHARE` fitted to DeepGEMM's
published table (H800 FP8, 256 to 8,192 rows per expert). With the tile and wave quantization it gives the
small-M roll-off of grouped GEMMs.

**Memory-bound kernels** move ``bytes`` at ``bandwidth_efficiency * hbm`` plus a fixed overhead
per kernel.
"""

from __future__ import annotations

import math

from megapipe.cost.precision import recipe_gemm_share
from megapipe.errors import ConfigError
from megapipe.records import GpuSpec, RuntimeSpec

__all__ = ["peak_flops", "gemm_ms", "grouped_gemm_ms", "attention_ms", "memory_ms", "kernel_overhead_ms",
           "FLASH_BACKWARD_FLOPS", "GEMM_STREAMS", "GROUPED_LOAD_SHARE"]

_TF32_FRACTION = 0.5
"""TF32 tensor-core peak / bf16 peak on A100, H100, H200 and B200 datasheets."""
_TILES = ((128, 256), (256, 128), (128, 128))
_ATTENTION_BLOCK = 128
"""Query (and key) rows per flash-attention thread block (FlashAttention-2/3 and cuDNN use 128 for d = 128)."""
FLASH_BACKWARD_FLOPS = 2.5
"""Backward / forward FLOPs of flash attention: Q K^T recomputed, dV, dP, dQ, dK (Dao 2023, Sec. 3.1)."""
_BYTES = {"fp8": 1, "bf16": 2, "fp32": 4}
GEMM_STREAMS = 4
"""CUDA streams Transformer Engine spreads a grouped GEMM's per-expert GEMMs over
(``transformer_engine/common/gemm/cublaslt_gemm.cu``, ``num_streams = 4``)."""
GROUPED_LOAD_SHARE = 0.3
"""Share of the smaller of compute and operand-load time a grouped GEMM does not overlap: the least-squares fit
of this module's grouped-GEMM time (tile and wave quantization included) to DeepGEMM's published H800 FP8 table
(README at 327ec92f, its 10 rows with 256 to 8,192 rows per expert; 6.7% rms, against 15% for the plain
roofline)."""


def peak_flops(gpu: GpuSpec, dtype: str = "bf16") -> float:
    """Dense tensor-core peak, FLOP/s, for GEMMs in ``dtype`` (fp8, bf16, fp32 as TF32)."""
    if dtype == "fp8":
        if gpu.fp8_tflops <= 0:
            raise ConfigError(f"GPU {gpu.name!r} has no FP8 tensor cores (fp8_tflops=0); train in bf16")
        return gpu.fp8_tflops * 1e12
    return gpu.bf16_tflops * 1e12 * (_TF32_FRACTION if dtype == "fp32" else 1.0)


def kernel_overhead_ms(gpu: GpuSpec, kernels: float = 1.0) -> float:
    return kernels * gpu.kernel_overhead_us * 1e-3


def _waves_utilization(blocks: int, num_sms: int) -> float:
    if num_sms <= 0 or blocks <= 0:
        return 1.0
    return blocks / (math.ceil(blocks / num_sms) * num_sms)


def _tile_utilization(m: int, n: int, num_sms: int, groups: int = 1) -> float:
    if num_sms <= 0:
        return 1.0
    best = 0.0
    for tile_m, tile_n in _TILES:
        rows, cols = math.ceil(m / tile_m), math.ceil(n / tile_n)
        padded = (m * n) / (rows * tile_m * cols * tile_n)
        best = max(best, padded * _waves_utilization(groups * rows * cols, num_sms))
    return best


def _gemm_rate(gpu: GpuSpec, dtype: str, runtime: RuntimeSpec, recipe: str = "") -> float:
    efficiency = (gpu.fp8_matmul_efficiency or gpu.matmul_efficiency) if dtype == "fp8" else gpu.matmul_efficiency
    share = recipe_gemm_share(recipe) if dtype == "fp8" else 1.0
    return efficiency * share * runtime.gemm_scale(gpu.architecture) * peak_flops(gpu, dtype)


def memory_ms(*, num_bytes: float, gpu: GpuSpec, kernels: float = 0.0) -> float:
    """Memory-bound kernels moving ``num_bytes`` (read + written), plus their fixed overhead."""
    return num_bytes / (gpu.bandwidth_efficiency * gpu.hbm_gbytes_per_s * 1e9) * 1e3 + kernel_overhead_ms(gpu, kernels)


def gemm_ms(*, m: float, n: float, k: float, dtype: str, gpu: GpuSpec, runtime: RuntimeSpec = RuntimeSpec(),
            out_bytes: int = 2, groups: int = 1, recipe: str = "") -> float:
    """One GEMM producing an ``m x n`` output over a reduction of ``k``; 0 when any side is 0.

    With ``groups`` it is one grouped GEMM (the routed experts, CUTLASS/cuBLAS grouped GEMM) of that many
    independent ``m x n`` products, each with its own weight: their tiles share the waves of one launch.
    """
    if m <= 0 or n <= 0 or k <= 0:
        return 0.0
    m, n = int(math.ceil(m)), int(math.ceil(n))
    utilization = _tile_utilization(m, n, gpu.num_sms, groups)
    compute = 2.0 * groups * m * n * k / (_gemm_rate(gpu, dtype, runtime, recipe) * utilization)
    traffic = groups * (_BYTES[dtype] * (m * k + k * n) + out_bytes * m * n)
    memory = traffic / (gpu.bandwidth_efficiency * gpu.hbm_gbytes_per_s * 1e9)
    return max(compute, memory) * 1e3 + kernel_overhead_ms(gpu)


def attention_ms(*, batch_heads: float, q_len: int, kv_len: int, head_dim: int, causal: bool, backward: bool,
                 gpu: GpuSpec, runtime: RuntimeSpec = RuntimeSpec(), calls: int = 1) -> float:
    """Flash attention over ``batch_heads`` (micro-batch x local heads) of ``q_len`` queries against ``kv_len``
    keys, in ``calls`` kernel launches (context parallelism's ring steps, each over all local queries against
    one block of keys); forward or backward."""
    if batch_heads <= 0 or q_len <= 0:
        return 0.0
    pairs = q_len * kv_len
    if causal:
        # The lower triangle, and the diagonal blocks computed whole.
        pairs = q_len * kv_len / 2 + q_len * min(_ATTENTION_BLOCK, kv_len) / 2
    flops = 4.0 * batch_heads * pairs * head_dim * (FLASH_BACKWARD_FLOPS if backward else 1.0)
    efficiency = gpu.attention_backward_efficiency if backward else gpu.attention_efficiency
    rate = efficiency * runtime.attention_scale(gpu.architecture) * peak_flops(gpu, "bf16")
    blocks = int(math.ceil(batch_heads)) * math.ceil(q_len / _ATTENTION_BLOCK)
    return flops / (rate * _waves_utilization(blocks, gpu.num_sms)) * 1e3 + kernel_overhead_ms(gpu, calls)


def grouped_gemm_ms(*, m: float, n: float, k: float, groups: int, dtype: str, gpu: GpuSpec,
                    runtime: RuntimeSpec = RuntimeSpec(), out_bytes: int = 2, recipe: str = "") -> float:
    """``groups`` GEMMs of ``m x n`` over ``k`` each (the local experts, ``m`` the busiest expert's rows), as
    Transformer Engine runs them: one cuBLAS GEMM per expert over :data:`GEMM_STREAMS` streams; 0 when empty."""
    if m <= 0 or n <= 0 or k <= 0 or groups <= 0:
        return 0.0
    m, n = int(math.ceil(m)), int(math.ceil(n))
    concurrent = min(GEMM_STREAMS, groups)
    utilization = _tile_utilization(m, n, gpu.num_sms, concurrent)
    compute = 2.0 * groups * m * n * k / (_gemm_rate(gpu, dtype, runtime, recipe) * utilization)
    traffic = groups * (_BYTES[dtype] * (m * k + k * n) + out_bytes * m * n)
    memory = traffic / (gpu.bandwidth_efficiency * gpu.hbm_gbytes_per_s * 1e9)
    seconds = max(compute, memory) + GROUPED_LOAD_SHARE * min(compute, memory)
    return seconds * 1e3 + kernel_overhead_ms(gpu, math.ceil(groups / GEMM_STREAMS))
