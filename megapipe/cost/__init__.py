"""Analytical layer cost model: per-unit FLOPs, bytes and time for one microbatch on one GPU.

Pure functions of records (no torch, no I/O). Formulas and their sources are in each
module's docstring and in ``docs/cost_model.md``.
"""

from megapipe.cost.comm import Collective, collective_ms, tensor_parallel_link
from megapipe.cost.flops import (
    attention_flops,
    decoder_gemm_flops,
    matmul_parameter_count,
    model_flops_per_token,
    output_gemm_flops,
)
from megapipe.cost.kernels import attention_ms, gemm_ms, memory_ms, peak_flops
from megapipe.cost.layers import layer_costs
from megapipe.cost.memory import activation_bytes_per_layer, p2p_bytes
from megapipe.cost.params import active_parameter_count, bytes_per_parameter, parameter_count
from megapipe.cost.shapes import Shapes, padded_vocab_size, shapes_of

__all__ = [
    "layer_costs",
    "parameter_count",
    "active_parameter_count",
    "matmul_parameter_count",
    "model_flops_per_token",
    "p2p_bytes",
    "activation_bytes_per_layer",
    "bytes_per_parameter",
    "Collective",
    "collective_ms",
    "gemm_ms",
    "attention_ms",
    "memory_ms",
    "peak_flops",
    "tensor_parallel_link",
    "attention_flops",
    "decoder_gemm_flops",
    "output_gemm_flops",
    "Shapes",
    "shapes_of",
    "padded_vocab_size",
]
