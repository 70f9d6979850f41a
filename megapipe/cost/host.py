"""The host's side of a unit: the kernels the CPU launches, the syncs it waits on, and when that shows.

PyTorch runs eagerly: Python, the dispatcher and Transformer Engine's modules issue every kernel from
the CPU, which normally runs ahead of the GPU and hides that work. It shows when the CPU is the slower
side, and after every device-to-host sync, which empties the queue: the GPU then waits until the CPU has
issued the next kernels. A dropless MoE layer syncs once per forward to learn its token counts
(:mod:`megapipe.cost.moe`). So, per unit and direction, the time is ``max(GPU work, host work)`` plus one
``host_sync_us`` per sync, with host work = launched kernels x ``host_kernel_us`` (the runtime's fields,
:class:`megapipe.records.RuntimeSpec`). CUDA graphs replace a captured scope's launches by one graph launch.

Kernel counts per forward (Transformer Engine layers; a GEMM's backward launches two, the others about as
many as forward) follow megatron-core's modules: :func:`unit_kernels`.
"""

from __future__ import annotations

from dataclasses import dataclass

from megapipe.cost.moe import FUSED_ROUTER_KERNELS, ROUTER_KERNELS
from megapipe.cost.shapes import Shapes

__all__ = ["Kernels", "unit_kernels", "captured_scopes", "exposed_host_ms", "syncs_per_forward"]

_GQA_ATTENTION = 7
"""Input norm, linear_qkv, RoPE on q and k, the attention kernel, linear_proj, bias-dropout-add."""
_MLA_ATTENTION = 15
"""Norm, q down/norm/up, kv down/norm/up, RoPE on both, split and concatenations, attention, proj, add."""
_DENSE_MLP = 5
"""Pre-MLP norm, linear_fc1, activation, linear_fc2, bias-dropout-add."""
_MOE_FIXED = 12
"""A MoE layer's own launches besides router, permute and experts: norm, router GEMM, token counts and
splits (8), bias-dropout-add."""
_SHARED = 4
"""Shared experts: fc1, activation, fc2, and their gate or add."""


@dataclass(frozen=True, slots=True)
class Kernels:
    """Host launches of one unit, forward and backward, by the CUDA-graph scope that would capture them
    (``attn``, ``mlp``, ``moe_router``, ``moe_preprocess``, ``moe``; ``expert_path`` no scope of a dropless
    MoE layer captures: permute, dispatch, experts, combine)."""

    scopes: tuple[tuple[str, float, float], ...]
    """(scope, forward launches, backward launches)."""

    def launches(self, captured: frozenset[str], *, backward: bool) -> float:
        """Launches with every captured scope replaced by one graph launch."""
        total = 0.0
        for scope, forward, back in self.scopes:
            count = back if backward else forward
            total += (1.0 if count else 0.0) if scope in captured else count
        return total


def _quantize(shapes: Shapes, linears: int) -> int:
    """FP8 casts of the linear layers not fed by a norm (Transformer Engine quantizes their input)."""
    return linears if shapes.gemm_dtype == "fp8" else 0


def unit_kernels(shapes: Shapes, *, moe: bool) -> Kernels:
    """Launches per microbatch of one decoder layer, forward and backward, by scope."""
    tp_collectives = 2 if shapes.tensor_model_parallel_size > 1 else 0
    cp = 2 * (shapes.context_parallel_size - 1)
    attention = (_MLA_ATTENTION if shapes.mla else _GQA_ATTENTION) + tp_collectives + cp + _quantize(shapes, 1)
    attention_scope = ("attn", attention, attention + (4 if shapes.mla else 2))  # dgrad and wgrad per GEMM
    if not moe:
        mlp = _DENSE_MLP + tp_collectives + _quantize(shapes, 1)
        return Kernels(scopes=(attention_scope, ("mlp", mlp, mlp + 2)))
    features = shapes.features
    router = FUSED_ROUTER_KERNELS if features.moe_router_fusion else ROUTER_KERNELS
    flex = shapes.dispatcher in ("deepep", "hybridep")
    permute = 2 if flex else (5 if features.moe_permute_fusion else 15)
    dispatch = 6 if flex else 4 + (2 if shapes.expert_tensor_parallel_size > 1 else 0)
    local_sort = 2 if shapes.dispatcher == "alltoall" and shapes.local_experts > 1 else 0
    experts = 2 * shapes.local_experts + 3 + 2 * _quantize(shapes, shapes.local_experts)
    path = permute + dispatch + local_sort + experts
    shared = (_SHARED + tp_collectives) if shapes.shared_ffn_hidden_size else 0
    return Kernels(scopes=(attention_scope, ("moe_router", router, router), ("moe_preprocess", _MOE_FIXED, _MOE_FIXED),
                           ("moe", shared, shared + 2 * (shared > 0)),
                           ("expert_path", path, path + 2 * shapes.local_experts)))


def captured_scopes(shapes: Shapes) -> frozenset[str]:
    """The scopes the plan's CUDA graphs capture: its ``cuda_graph_scope`` (an empty list is the whole layer,
    which in a dropless MoE layer is its attention: megatron-core captures no dynamic shapes), or every scope
    with ``full_iteration``."""
    features = shapes.features
    if not features.cuda_graphs:
        return frozenset()
    scopes = frozenset(features.cuda_graph_scope)
    if "full_iteration" in scopes:
        return frozenset(("attn", "mlp", "moe_router", "moe_preprocess", "moe", "expert_path"))
    return scopes or frozenset(("attn", "mlp"))


def syncs_per_forward(shapes: Shapes, *, moe: bool) -> int:
    """Device-to-host syncs a unit's forward waits on: one per dropless MoE layer (its token counts; the
    alltoall dispatcher's before the all-to-all, DeepEP's and HybridEP's inside their dispatch), none when a
    full-iteration graph runs with static shapes."""
    if not moe or "full_iteration" in shapes.features.cuda_graph_scope:
        return 0
    return 1


def exposed_host_ms(*, gpu_ms: float, launches: float, syncs: int, host_kernel_us: float, host_sync_us: float) -> float:
    """What the host adds to ``gpu_ms`` of GPU work: its launches beyond the GPU's time, and each sync's wait."""
    return max(0.0, launches * host_kernel_us * 1e-3 - gpu_ms) + syncs * host_sync_us * 1e-3
