"""A linear layer on one GPU: its forward, dgrad and wgrad GEMMs and its exposed tensor-parallel collectives; the
memory-bound kernels beside them.

Tensor-parallel collectives (Shoeybi et al. 2019; Korthikanti et al. 2022 Sec. 4.2.2): per linear
layer, an all-gather of the input before a column-parallel GEMM and a reduce-scatter after a
row-parallel one under sequence parallelism, an all-reduce after the row-parallel one otherwise;
the backward mirrors them. What Megatron hides without ``--tp-comm-overlap``: a column-parallel
layer's backward all-gathers its input again under the dgrad GEMM and reduces its input gradient
under the wgrad GEMM (megatron-core ``LinearWithGradAccumulationAndAsyncCommunication``, and the
same in Transformer Engine's layers), so only the excess shows; the forward collectives and the
row-parallel layer's backward all-gather are exposed. With ``--tp-comm-overlap`` (Transformer
Engine userbuffers; Wang et al. 2022, "Overlap Communication with Dependent Computation") every
collective is split into ``t`` chunks pipelined with its GEMM: the first chunk and any excess over
the GEMM are exposed.
"""

from __future__ import annotations

from megapipe.cost.comm import Collective, collective_ms
from megapipe.cost.flops import Gemm
from megapipe.cost.kernels import gemm_ms, grouped_gemm_ms, memory_ms
from megapipe.cost.moe import padding_rows
from megapipe.cost.shapes import Shapes
from megapipe.cost.timing import Device, Timing, part

__all__ = ["gemm_time", "linear_timing", "tp_ms", "memory_timing"]


def gemm_time(m: float, n: float, k: float, shapes: Shapes, device: Device, dtype: str | None = None,
              groups: int = 1) -> float:
    """One GEMM (or a grouped GEMM of ``groups`` experts) in ``dtype`` (the training's GEMM dtype by default), ms."""
    dtype = dtype or shapes.gemm_dtype
    if groups > 1:
        return grouped_gemm_ms(m=m, n=n, k=k, groups=groups, dtype=dtype, gpu=device.gpu, runtime=device.runtime,
                               recipe=shapes.fp8_recipe)
    return gemm_ms(m=m, n=n, k=k, dtype=dtype, gpu=device.gpu, runtime=device.runtime, recipe=shapes.fp8_recipe)


def tp_ms(kind: Collective, shapes: Shapes, device: Device, num_bytes: float | None = None) -> float:
    """One collective over the TP group on the full ``[s/cp, b, h]`` hidden state (or ``num_bytes``)."""
    if num_bytes is None:
        num_bytes = shapes.element_bytes * shapes.tokens * shapes.hidden_size
    return collective_ms(kind=kind, num_bytes=num_bytes, group_size=shapes.tensor_model_parallel_size,
                         link=device.link, efficiency_scale=device.runtime.comm_efficiency_scale)


def _exposed(comm_ms: float, under_ms: float, shapes: Shapes, device: Device, *, hidden: bool) -> float:
    """What a collective shows beside the GEMM ``under_ms`` it may overlap with."""
    if device.tp_comm_overlap:
        return max(0.0, comm_ms - under_ms) + min(comm_ms, under_ms) / shapes.tensor_model_parallel_size
    return max(0.0, comm_ms - under_ms) if hidden else comm_ms


def linear_timing(gemm: Gemm, shapes: Shapes, device: Device, *, dtype: str | None = None) -> Timing:
    """One linear layer: forward, dgrad and wgrad GEMMs and its exposed TP collectives.

    A grouped GEMM (the routed experts) runs ``groups`` products of the busiest rank's tokens per expert
    (the stated load imbalance times the mean); the router stays in bf16 under FP8 training.
    """
    if not gemm.quantized and (dtype or shapes.gemm_dtype) == "fp8":
        dtype = "bf16"
    groups = gemm.groups
    rows = gemm.tokens * (shapes.moe_load_imbalance if groups > 1 else 1.0) / groups
    if groups > 1:
        rows += padding_rows(shapes)
    fwd = gemm_time(rows, gemm.n, gemm.k, shapes, device, dtype, groups)
    dgrad = gemm_time(rows, gemm.k, gemm.n, shapes, device, dtype, groups)
    wgrad = gemm_time(gemm.k, gemm.n, rows, shapes, device, dtype, groups)
    timing = part("gemm", fwd, dgrad + wgrad, wgrad)
    if shapes.tensor_model_parallel_size == 1 or not gemm.comm_width:
        return timing
    sp = shapes.sequence_parallel
    size = shapes.element_bytes * gemm.tokens * gemm.comm_width
    gather = tp_ms(Collective.all_gather, shapes, device, size) if sp else 0.0
    reduce = tp_ms(Collective.reduce_scatter if sp else Collective.all_reduce, shapes, device, size)
    if gemm.column_parallel:
        forward = _exposed(gather, fwd, shapes, device, hidden=False)
        backward = (_exposed(gather, dgrad, shapes, device, hidden=True)
                    + _exposed(reduce, wgrad, shapes, device, hidden=True))
    else:
        forward = _exposed(reduce, fwd, shapes, device, hidden=False)
        backward = _exposed(gather, dgrad, shapes, device, hidden=False)
    return timing + part("tp_comm", forward, backward)


def memory_timing(name: str, forward_bytes: float, backward_bytes: float, kernels: tuple[int, int],
                  device: Device) -> Timing:
    """Memory-bound kernels moving ``forward_bytes`` and ``backward_bytes``, as the part ``name``."""
    gpu = device.gpu
    return part(name, memory_ms(num_bytes=forward_bytes, gpu=gpu, kernels=kernels[0]),
                memory_ms(num_bytes=backward_bytes, gpu=gpu, kernels=kernels[1]))
