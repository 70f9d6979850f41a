"""A decoder layer's time on one GPU, per microbatch: attention, the dense or MoE MLP, the memory-bound
kernels, FP8 casts, then what the runtime features change (the MoE layer's dispatch and overlaps, the host's
launches under CUDA graphs, what selective recompute runs again).

The first parts read the layer's shapes and the device but no runtime feature (bar FP8's routing-map padding)
and not the recompute setting, so they are costed once per such shape (:func:`fixed_parts`, a cache on a pure
function of frozen records) and each feature set and recompute setting adds its own parts to the same numbers:
a search that tries a dozen feature sets at every size prices the GEMMs once.

Context parallelism (Megatron's p2p ring, Liu et al. 2023 "Ring Attention"): in each of the
``cp - 1`` steps a GPU sends its K, V block on while it computes attention on the one it holds
(twice the bytes in the backward, K, V and their gradients), so a step exposes what its transfer
takes beyond its 1/cp share of the attention kernel.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
from dataclasses import dataclass

from megapipe.cost.comm import p2p_ms
from megapipe.cost.flops import attention_gemms, mlp_gemms
from megapipe.cost.host import captured_scopes, exposed_host_ms, syncs_per_forward, unit_kernels
from megapipe.cost.kernels import attention_ms, memory_ms
from megapipe.cost.linear import gemm_time, linear_timing, memory_timing
from megapipe.cost.moe import MOE_PARTS_FEATURES, MoeParts, moe_parts, moe_timing
from megapipe.cost.shapes import Shapes
from megapipe.cost.timing import Device, Timing, part
from megapipe.cost.traffic import (
    attention_core_traffic_bytes,
    decoder_kernels,
    decoder_traffic_bytes,
    fp8_cast_kernels,
    fp8_cast_traffic_bytes,
    recompute_traffic_bytes,
)
from megapipe.records import Recompute, RuntimeFeatures

__all__ = ["FixedParts", "decoder_timing", "DENSE_FEATURES", "decoder_parts", "fixed_parts", "fixed_shapes",
           "shapes_of_key", "timing_sum"]

_FIXED_CACHE = 4096
"""Decoder shapes whose fixed parts stay cached (a search meets a few hundred)."""


@dataclass(frozen=True, slots=True)
class FixedParts:
    """What no runtime feature and no recompute setting changes in a decoder layer's time."""

    core: Timing
    """The attention kernel."""
    attention: Timing
    """The attention core, the ring exchange and the attention block's linear layers."""
    projections: tuple[tuple[str, Timing], ...]
    """The attention block's linear layers by GEMM name."""
    mlp: tuple[tuple[str, Timing], ...]
    """The MLP's linear layers by GEMM name (:func:`megapipe.cost.flops.mlp_gemms`)."""
    timing: Timing
    """Attention, the MLP's linear layers, the memory-bound kernels and the FP8 casts."""


def timing_sum(timings) -> Timing:
    """The timings added in order."""
    total = Timing()
    for timing in timings:
        total = total + timing
    return total


def _attention_core(shapes: Shapes, device: Device) -> Timing:
    heads = shapes.micro_batch_size * shapes.num_attention_heads / shapes.tensor_model_parallel_size
    # Q K^T runs over the query-key width per head, P V over the value width (MLA's differ): their mean.
    head_dim = (shapes.query_size + shapes.attention_out_size) / (2 * shapes.num_attention_heads)
    if shapes.unfused_attention:
        rows, s, d = heads * shapes.local_seq_length, shapes.seq_length, shapes.head_dim
        scores = gemm_time(rows, s, d, shapes, device, "bf16")
        context = gemm_time(rows, d, s, shapes, device, "bf16")
        traffic = attention_core_traffic_bytes(shapes)
        return (part("attention", scores + context, 2 * (scores + context))
                + memory_timing("attention", traffic, 2 * traffic, (1, 1), device))
    cp = shapes.context_parallel_size
    common = dict(batch_heads=heads, q_len=shapes.local_seq_length, kv_len=shapes.seq_length,
                  head_dim=head_dim, causal=True, gpu=device.gpu, runtime=device.runtime, calls=cp)
    return part("attention", attention_ms(backward=False, **common), attention_ms(backward=True, **common))


def _ring_exchange(shapes: Shapes, core: Timing, device: Device) -> Timing:
    """Context parallelism's exposed K, V transfers, forward and backward."""
    cp = shapes.context_parallel_size
    if cp == 1:
        return Timing()
    tp = shapes.tensor_model_parallel_size
    block = shapes.element_bytes * shapes.tokens * (shapes.kv_size + shapes.value_size) / tp
    send = p2p_ms(num_bytes=block, link=device.cp_link, efficiency_scale=device.runtime.comm_efficiency_scale)
    forward = (cp - 1) * max(0.0, send - core.fwd_ms / cp)
    backward = (cp - 1) * max(0.0, 2 * send - core.bwd_ms / cp)
    return part("cp_comm", forward, backward)


_KEY_FIELDS = tuple(field.name for field in dataclasses.fields(Shapes) if field.name not in ("features", "recompute"))
_key_values = operator.attrgetter(*_KEY_FIELDS)


def fixed_shapes(shapes: Shapes) -> tuple:
    """The shapes as the fixed parts of a unit's time read them, a plain tuple (:func:`fixed_parts`): every field
    but the runtime features (save FP8's routing-map padding, which sets the experts' rows) and the recompute
    setting."""
    return _key_values(shapes) + (shapes.features.moe_router_padding_for_quantization,)


def shapes_of_key(key: tuple) -> Shapes:
    """The shapes a :func:`fixed_shapes` key stands for: no feature but the padding, no recompute."""
    *values, padding = key
    return Shapes(**dict(zip(_KEY_FIELDS, values)), features=_PADDED if padding else _PLAIN, recompute=Recompute.none)


_PLAIN = RuntimeFeatures()
_PADDED = RuntimeFeatures(moe_router_padding_for_quantization=True)


@functools.lru_cache(maxsize=_FIXED_CACHE)
def fixed_parts(key: tuple, device: Device, moe: bool) -> FixedParts:
    """:func:`decoder_parts` of the shapes ``key`` stands for (:func:`fixed_shapes`), cached."""
    return decoder_parts(shapes_of_key(key), device, moe)


def decoder_parts(shapes: Shapes, device: Device, moe: bool) -> FixedParts:
    """The parts of :func:`decoder_timing` that read neither the features nor the recompute setting."""
    core = _attention_core(shapes, device)
    attention = core + _ring_exchange(shapes, core, device)
    projections = {gemm.name: linear_timing(gemm, shapes, device) for gemm in attention_gemms(shapes)}
    attention = attention + timing_sum(projections.values())
    mlp = {gemm.name: linear_timing(gemm, shapes, device) for gemm in mlp_gemms(shapes, moe=moe)}
    timing = attention + timing_sum(mlp.values())
    traffic = decoder_traffic_bytes(shapes, moe=moe)
    timing = timing + memory_timing("memory_bound", traffic, 2 * traffic, decoder_kernels(shapes, moe=moe), device)
    timing = timing + memory_timing("fp8_cast", *fp8_cast_traffic_bytes(shapes, moe=moe),
                                    fp8_cast_kernels(shapes, moe=moe), device)
    return FixedParts(core=core, attention=attention, projections=tuple(projections.items()),
                      mlp=tuple(mlp.items()), timing=timing)


DENSE_FEATURES = ("cuda_graph_impl", "cuda_graph_scope", "recompute_modules")
"""The runtime features a dense decoder layer's time reads besides FP8's routing-map padding (tests/test_cost.py
checks it reads no other): a MoE model's dense layers are timed once per these, not once per feature set."""
_dense_features = operator.attrgetter(*DENSE_FEATURES)
_DENSE: dict[tuple, Timing] = {}
"""Dense decoder layers' times by their :func:`fixed_shapes`, recompute setting, :data:`DENSE_FEATURES` and device
(bounded: cleared when full)."""


def decoder_timing(shapes: Shapes, device: Device, *, moe: bool = False, fixed: FixedParts | None = None) -> Timing:
    """One decoder layer's forward, backward and weight-gradient time, by part; ``fixed``: its
    :func:`fixed_parts`, when the caller has them."""
    if moe:
        return _decoder_timing(shapes, device, moe=True, fixed=fixed)
    return _remembered(_DENSE, (fixed_shapes(shapes), shapes.recompute, _dense_features(shapes.features), device),
                       lambda: _decoder_timing(shapes, device, moe=False, fixed=fixed))


def _remembered(cache: dict, key: tuple, make):
    """``cache[key]``, made by ``make()`` the first time (the cache is cleared when it holds :data:`_FIXED_CACHE`)."""
    found = cache.get(key)
    if found is None:
        if len(cache) >= _FIXED_CACHE:
            cache.clear()
        found = cache[key] = make()
    return found


def _decoder_timing(shapes: Shapes, device: Device, *, moe: bool, fixed: FixedParts | None) -> Timing:
    fixed = fixed or fixed_parts(fixed_shapes(shapes), device, moe)
    mlp = dict(fixed.mlp)
    extra = moe_timing(shapes, device, attention=fixed.attention, mlp=mlp,
                       parts=_moe_parts(shapes, device)) if moe else Timing()
    timing = fixed.timing + extra
    timing = timing + _host(shapes, device, timing, moe=moe)
    if shapes.recompute == Recompute.full:
        return timing + part("recompute", 0.0, timing.fwd_ms)
    if shapes.recompute == Recompute.selective:
        pieces = _pieces(shapes, device, fixed=fixed, mlp=mlp, moe_extra=extra, moe=moe)
        extra_ms = math.fsum(pieces.get(module, 0.0) for module in dict.fromkeys(shapes.features.recompute_modules))
        return timing + part("recompute", 0.0, extra_ms)
    return timing


_MOE_PARTS: dict[tuple, MoeParts] = {}
""":func:`~megapipe.cost.moe.moe_parts` by the shapes but their features, the features it reads and the device: a
search's dozen feature sets of one size share a few (bounded: cleared when full)."""
_moe_parts_features = operator.attrgetter(*MOE_PARTS_FEATURES)


def _moe_parts(shapes: Shapes, device: Device) -> MoeParts:
    return _remembered(_MOE_PARTS, (_key_values(shapes), _moe_parts_features(shapes.features), device),
                       lambda: moe_parts(shapes, device))


def _pieces(shapes: Shapes, device: Device, *, fixed: FixedParts, mlp: dict[str, Timing], moe_extra: Timing,
            moe: bool) -> dict[str, float]:
    """Each recompute module's forward ms for this layer: what selective recompute runs again in the backward,
    all of it under full recompute (Korthikanti et al. 2022, Sec. 5): core attention by default, the norms,
    MLA's up-projections, the MoE activation, the dense MLP, the shared experts or the whole MoE layer
    (megatron-core ``TransformerLayer``'s checkpointed modules)."""
    gpu = device.gpu

    def memory_of(module: str, kernels: int) -> float:
        num_bytes = recompute_traffic_bytes(shapes, module, moe=moe)
        return memory_ms(num_bytes=num_bytes, gpu=gpu, kernels=kernels) if num_bytes else 0.0

    def gemms(prefix: str) -> float:
        return math.fsum(timing.fwd_ms for name, timing in mlp.items() if name.startswith(prefix))

    pieces = {"core_attn": fixed.core.fwd_ms, "layernorm": memory_of("layernorm", 2)}
    if shapes.mla:
        pieces["mla_up_proj"] = math.fsum(timing.fwd_ms for name, timing in fixed.projections
                                          if name.endswith("_up_proj"))
    if moe:
        pieces["moe_act"] = memory_of("moe_act", 1)
        pieces["shared_experts"] = gemms("shared_experts.") + memory_of("shared_experts", 1)
        pieces["moe"] = sum(timing.fwd_ms for timing in mlp.values()) + moe_extra.fwd_ms + memory_of("moe", 2)
    else:
        pieces["mlp"] = gemms("linear_fc") + memory_of("mlp", 1)
    return pieces


def _host(shapes: Shapes, device: Device, timing: Timing, *, moe: bool) -> Timing:
    """What the CPU adds: launches beyond the GPU's work, and the MoE layer's token-count sync
    (:mod:`megapipe.cost.host`)."""
    runtime, kernels = device.runtime, unit_kernels(shapes, moe=moe)
    captured = captured_scopes(shapes)
    per_kernel = runtime.host_kernel(device.cluster.host_cpu)
    forward = exposed_host_ms(gpu_ms=timing.fwd_ms, launches=kernels.launches(captured, backward=False),
                              syncs=syncs_per_forward(shapes, moe=moe), host_kernel_us=per_kernel,
                              host_sync_us=runtime.host_sync_us)
    backward = exposed_host_ms(gpu_ms=timing.bwd_ms, launches=kernels.launches(captured, backward=True), syncs=0,
                               host_kernel_us=per_kernel, host_sync_us=runtime.host_sync_us)
    return part("host", forward, backward)
