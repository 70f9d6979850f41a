"""Turning FLOPs and bytes into milliseconds on one GPU and one network link.

GEMMs follow a saturating efficiency curve (fields of ``GpuSpec``, fitted by
``megapipe calibrate``):

    efficiency(F) = matmul_efficiency * F / (F + matmul_half_flops)
    time(F)       = F / (efficiency(F) * peak) = (F + matmul_half_flops) / (matmul_efficiency * peak)

so a GEMM costs a fixed ``matmul_half_flops / (matmul_efficiency * peak)`` (launch,
wave quantisation, tail) plus its FLOPs at the large-GEMM rate; a GEMM of
``matmul_half_flops`` FLOPs runs at half the large-GEMM efficiency. This is the
roofline's compute side with a first-order small-problem penalty (cf. Williams et
al. 2009, "Roofline"; Calculon, Isaev et al. SC23, uses per-size efficiency tables).

Memory-bound kernels (norms, elementwise, softmax, embedding lookup, cross-entropy)
move bytes at ``bandwidth_efficiency * hbm_gbytes_per_s``.

Communication is costed in :mod:`megapipe.cost.comm`.
"""

from __future__ import annotations

from megapipe.records import GpuSpec

__all__ = ["gemm_ms", "memory_ms", "peak_flops"]

_FP32_TENSOR_FRACTION = 0.5
"""TF32 tensor-core peak / bf16 peak on A100, H100, H200 and B200 datasheets."""


def peak_flops(gpu: GpuSpec, precision: str = "bf16") -> float:
    """Dense peak FLOP/s for the training precision (fp32 runs as TF32 at half the bf16 rate)."""
    scale = _FP32_TENSOR_FRACTION if precision == "fp32" else 1.0
    return gpu.bf16_tflops * 1e12 * scale


def gemm_ms(*, flops: float, gpu: GpuSpec, precision: str = "bf16") -> float:
    """One GEMM of ``flops`` FLOPs: ``(F + matmul_half_flops) / (matmul_efficiency * peak)``; 0 for F = 0."""
    if flops <= 0:
        return 0.0
    return (flops + gpu.matmul_half_flops) / (gpu.matmul_efficiency * peak_flops(gpu, precision)) * 1e3


def memory_ms(*, num_bytes: float, gpu: GpuSpec) -> float:
    """Bytes read plus written by memory-bound kernels, at ``bandwidth_efficiency * hbm_gbytes_per_s``."""
    return num_bytes / (gpu.bandwidth_efficiency * gpu.hbm_gbytes_per_s * 1e9) * 1e3
