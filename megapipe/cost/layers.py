"""The analytical profile: one ``LayerCost`` per pipeline unit, built from its kernels.

Per unit and microbatch on one GPU of its stage, each time is the sum of its parts
(:data:`megapipe.records.TIME_PARTS`, reported as ``LayerCost.parts``):

- **gemm**: every linear layer's forward GEMM, and in the backward its input-gradient (dgrad) and
  weight-gradient (wgrad) GEMMs, each timed by its own shape (:func:`megapipe.cost.kernels.gemm_ms`:
  tile and wave quantization, roofline); wgrad is the zero-bubble W;
- **attention**: the flash/fused kernel forward and backward (:func:`~megapipe.cost.kernels.attention_ms`),
  or unfused attention's batched GEMMs and softmax;
- **memory_bound**: norms, RoPE, residual adds, activation, embedding lookup, cross-entropy
  (:mod:`megapipe.cost.traffic`) at the achieved HBM bandwidth, plus a fixed cost per kernel;
- **fp8_cast**: Transformer Engine's quantize(-transpose) kernels under FP8;
- **tp_comm**: the *exposed* part of the tensor-parallel collectives, see below;
- **cp_comm**: the exposed part of context parallelism's ring exchange of K and V, see below;
- **recompute**: the forward run again in the backward, all of it under full recompute, the
  attention core under selective (Korthikanti et al. 2022, Sec. 5).

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

Context parallelism (Megatron's p2p ring, Liu et al. 2023 "Ring Attention"): in each of the
``cp - 1`` steps a GPU sends its K, V block on while it computes attention on the one it holds
(twice the bytes in the backward, K, V and their gradients), so a step exposes what its transfer
takes beyond its 1/cp share of the attention kernel.
"""

from __future__ import annotations

import math

from megapipe.cost.comm import Collective, collective_ms, p2p_link, p2p_ms, tensor_parallel_link
from megapipe.cost.flops import Gemm, attention_gemms, eh_proj_gemm, mlp_gemms, output_gemms
from megapipe.cost.host import captured_scopes, exposed_host_ms, syncs_per_forward, unit_kernels
from megapipe.cost.kernels import attention_ms, gemm_ms, grouped_gemm_ms, memory_ms
from megapipe.cost.moe import moe_timing, padding_rows
from megapipe.cost.memory import (
    decoder_activation_bytes,
    embedding_activation_bytes,
    mtp_activation_bytes,
    output_activation_bytes,
)
from megapipe.cost.params import (
    decoder_params,
    embedding_params,
    expert_params,
    mtp_params,
    output_params,
    unit_static_bytes,
)
from megapipe.cost.shapes import Shapes, shapes_of
from megapipe.cost.timing import Device, Timing, part
from megapipe.cost.traffic import (
    recompute_traffic_bytes,
    attention_core_traffic_bytes,
    decoder_kernels,
    decoder_traffic_bytes,
    embedding_traffic_bytes,
    fp8_cast_kernels,
    fp8_cast_traffic_bytes,
    output_traffic_bytes,
)
from megapipe.records import (
    ClusterSpec,
    GpuSpec,
    LayerCost,
    LayerKind,
    ModelSpec,
    ParallelSpec,
    Profile,
    Recompute,
    TrainSpec,
)

__all__ = ["layer_costs", "distinct_units", "unit_runs"]

_CROSS_ENTROPY_ALL_REDUCES = 3
"""Max, target logit and sum of exp, each a [s, b] fp32 all-reduce (Megatron's vocab_parallel_cross_entropy)."""


def _gemm(m: float, n: float, k: float, shapes: Shapes, device: Device, dtype: str | None = None,
          groups: int = 1) -> float:
    dtype = dtype or shapes.gemm_dtype
    if groups > 1:
        return grouped_gemm_ms(m=m, n=n, k=k, groups=groups, dtype=dtype, gpu=device.gpu, runtime=device.runtime,
                               recipe=shapes.fp8_recipe)
    return gemm_ms(m=m, n=n, k=k, dtype=dtype, gpu=device.gpu, runtime=device.runtime, recipe=shapes.fp8_recipe)


def _tp_ms(kind: Collective, shapes: Shapes, device: Device, num_bytes: float | None = None) -> float:
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


def _linear(gemm: Gemm, shapes: Shapes, device: Device, *, dtype: str | None = None) -> Timing:
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
    fwd = _gemm(rows, gemm.n, gemm.k, shapes, device, dtype, groups)
    dgrad = _gemm(rows, gemm.k, gemm.n, shapes, device, dtype, groups)
    wgrad = _gemm(gemm.k, gemm.n, rows, shapes, device, dtype, groups)
    timing = part("gemm", fwd, dgrad + wgrad, wgrad)
    if shapes.tensor_model_parallel_size == 1 or not gemm.comm_width:
        return timing
    sp = shapes.sequence_parallel
    size = shapes.element_bytes * gemm.tokens * gemm.comm_width
    gather = _tp_ms(Collective.all_gather, shapes, device, size) if sp else 0.0
    reduce = _tp_ms(Collective.reduce_scatter if sp else Collective.all_reduce, shapes, device, size)
    if gemm.column_parallel:
        forward = _exposed(gather, fwd, shapes, device, hidden=False)
        backward = (_exposed(gather, dgrad, shapes, device, hidden=True)
                    + _exposed(reduce, wgrad, shapes, device, hidden=True))
    else:
        forward = _exposed(reduce, fwd, shapes, device, hidden=False)
        backward = _exposed(gather, dgrad, shapes, device, hidden=False)
    return timing + part("tp_comm", forward, backward)


def _memory(name: str, forward_bytes: float, backward_bytes: float, kernels: tuple[int, int], device: Device) -> Timing:
    gpu = device.gpu
    return part(name, memory_ms(num_bytes=forward_bytes, gpu=gpu, kernels=kernels[0]),
                 memory_ms(num_bytes=backward_bytes, gpu=gpu, kernels=kernels[1]))


def _attention_core(shapes: Shapes, device: Device) -> Timing:
    heads = shapes.micro_batch_size * shapes.num_attention_heads / shapes.tensor_model_parallel_size
    # Q K^T runs over the query-key width per head, P V over the value width (MLA's differ): their mean.
    head_dim = (shapes.query_size + shapes.attention_out_size) / (2 * shapes.num_attention_heads)
    if shapes.unfused_attention:
        rows, s, d = heads * shapes.local_seq_length, shapes.seq_length, shapes.head_dim
        scores = _gemm(rows, s, d, shapes, device, "bf16")
        context = _gemm(rows, d, s, shapes, device, "bf16")
        traffic = attention_core_traffic_bytes(shapes)
        return (part("attention", scores + context, 2 * (scores + context))
                + _memory("attention", traffic, 2 * traffic, (1, 1), device))
    cp = shapes.context_parallel_size
    common = dict(batch_heads=heads, q_len=shapes.local_seq_length, kv_len=shapes.seq_length,
                  head_dim=head_dim, causal=True, gpu=device.gpu, runtime=device.runtime, calls=cp)
    return part("attention", attention_ms(backward=False, **common), attention_ms(backward=True, **common))


def _ring_exchange(shapes: Shapes, core: Timing, device: Device) -> Timing:
    """Context parallelism's exposed K, V transfers, forward and backward."""
    cp = shapes.context_parallel_size
    if cp == 1:
        return Timing()
    block = shapes.element_bytes * shapes.tokens * (shapes.kv_size + shapes.value_size) / shapes.tensor_model_parallel_size
    send = p2p_ms(num_bytes=block, link=device.cp_link, efficiency_scale=device.runtime.comm_efficiency_scale)
    forward = (cp - 1) * max(0.0, send - core.fwd_ms / cp)
    backward = (cp - 1) * max(0.0, 2 * send - core.bwd_ms / cp)
    return part("cp_comm", forward, backward)


def _recompute(timing: Timing, pieces: dict[str, float], shapes: Shapes) -> Timing:
    """The forward the backward runs again: all of it under full recompute; under selective, each of
    ``recompute_modules`` (``pieces`` holds every module's forward ms): core attention by default
    (Korthikanti et al. 2022, Sec. 5), the norms, MLA's up-projections, the MoE activation, the dense MLP,
    the shared experts or the whole MoE layer (megatron-core ``TransformerLayer``'s checkpointed modules)."""
    if shapes.recompute == Recompute.full:
        return timing + part("recompute", 0.0, timing.fwd_ms)
    if shapes.recompute == Recompute.selective:
        extra = math.fsum(pieces.get(module, 0.0) for module in dict.fromkeys(shapes.features.recompute_modules))
        return timing + part("recompute", 0.0, extra)
    return timing


def _pieces(shapes: Shapes, device: Device, *, core: Timing, attention_gemms_timed: dict[str, Timing],
            mlp: dict[str, Timing], moe_extra: Timing, moe: bool) -> dict[str, float]:
    """Each recompute module's forward ms for this layer."""
    gpu = device.gpu

    def memory_of(module: str, kernels: int) -> float:
        num_bytes = recompute_traffic_bytes(shapes, module, moe=moe)
        return memory_ms(num_bytes=num_bytes, gpu=gpu, kernels=kernels) if num_bytes else 0.0

    def gemms(prefix: str) -> float:
        return math.fsum(timing.fwd_ms for name, timing in mlp.items() if name.startswith(prefix))

    pieces = {"core_attn": core.fwd_ms, "layernorm": memory_of("layernorm", 2)}
    if shapes.mla:
        pieces["mla_up_proj"] = math.fsum(timing.fwd_ms for name, timing in attention_gemms_timed.items()
                                          if name.endswith("_up_proj"))
    if moe:
        pieces["moe_act"] = memory_of("moe_act", 1)
        pieces["shared_experts"] = gemms("shared_experts.") + memory_of("shared_experts", 1)
        pieces["moe"] = sum(timing.fwd_ms for timing in mlp.values()) + moe_extra.fwd_ms + memory_of("moe", 2)
    else:
        pieces["mlp"] = gemms("linear_fc") + memory_of("mlp", 1)
    return pieces


def _decoder_timing(shapes: Shapes, device: Device, *, moe: bool = False) -> Timing:
    core = _attention_core(shapes, device)
    attention = core + _ring_exchange(shapes, core, device)
    projections = {gemm.name: _linear(gemm, shapes, device) for gemm in attention_gemms(shapes)}
    attention = attention + _sum(projections.values())
    mlp = {gemm.name: _linear(gemm, shapes, device) for gemm in mlp_gemms(shapes, moe=moe)}
    timing = attention + _sum(mlp.values())
    traffic = decoder_traffic_bytes(shapes, moe=moe)
    timing = timing + _memory("memory_bound", traffic, 2 * traffic, decoder_kernels(shapes, moe=moe), device)
    timing = timing + _memory("fp8_cast", *fp8_cast_traffic_bytes(shapes, moe=moe),
                              fp8_cast_kernels(shapes, moe=moe), device)
    extra = moe_timing(shapes, device, attention=attention, mlp=mlp) if moe else Timing()
    timing = timing + extra
    timing = timing + _host(shapes, device, timing, moe=moe)
    pieces = _pieces(shapes, device, core=core, attention_gemms_timed=projections, mlp=mlp, moe_extra=extra, moe=moe)
    return _recompute(timing, pieces, shapes)


def _sum(timings) -> Timing:
    total = Timing()
    for timing in timings:
        total = total + timing
    return total


def _host(shapes: Shapes, device: Device, timing: Timing, *, moe: bool) -> Timing:
    """What the CPU adds: launches beyond the GPU's work, and the MoE layer's token-count sync (:mod:`megapipe.cost.host`)."""
    runtime, kernels = device.runtime, unit_kernels(shapes, moe=moe)
    captured = captured_scopes(shapes)
    per_kernel = runtime.host_kernel(device.cluster.host_cpu)
    forward = exposed_host_ms(gpu_ms=timing.fwd_ms, launches=kernels.launches(captured, backward=False),
                              syncs=syncs_per_forward(shapes, moe=moe), host_kernel_us=per_kernel,
                              host_sync_us=runtime.host_sync_us)
    backward = exposed_host_ms(gpu_ms=timing.bwd_ms, launches=kernels.launches(captured, backward=True), syncs=0,
                               host_kernel_us=per_kernel, host_sync_us=runtime.host_sync_us)
    return part("host", forward, backward)


def _embedding_timing(shapes: Shapes, device: Device) -> Timing:
    """Lookup on every vocab shard, then all-reduce (reduce-scatter with SP); all of backward is wgrad."""
    forward_bytes, backward_bytes = embedding_traffic_bytes(shapes)
    if shapes.sequence_parallel:
        comm = part("tp_comm", _tp_ms(Collective.reduce_scatter, shapes, device),
                     _tp_ms(Collective.all_gather, shapes, device))
    else:
        comm = part("tp_comm", _tp_ms(Collective.all_reduce, shapes, device))
    timing = _memory("memory_bound", forward_bytes, backward_bytes, (2, 2), device) + comm
    return Timing(timing.fwd_ms, timing.bwd_ms, timing.bwd_ms, timing.parts)


def _output_timing(shapes: Shapes, device: Device) -> Timing:
    """Final norm, output GEMM (bf16 under FP8 training too) and vocab-parallel cross-entropy."""
    forward_bytes, backward_bytes = output_traffic_bytes(shapes)
    timing = _memory("memory_bound", forward_bytes, backward_bytes, (6, 6), device)
    for gemm in output_gemms(shapes):
        timing = timing + _linear(gemm, shapes, device, dtype="fp32" if shapes.gemm_dtype == "fp32" else "bf16")
    loss = _CROSS_ENTROPY_ALL_REDUCES * _tp_ms(Collective.all_reduce, shapes, device, num_bytes=4 * shapes.tokens)
    return timing + part("tp_comm", loss)


def _mtp_timing(shapes: Shapes, device: Device, *, moe: bool = False) -> Timing:
    """eh_proj GEMM, one decoder layer (with its recompute), the shared head and loss, and the input lookup."""
    return (_linear(eh_proj_gemm(shapes), shapes, device) + _decoder_timing(shapes, device, moe=moe)
            + _output_timing(shapes, device) + _embedding_timing(shapes, device))


def _unit(name: str, kind: LayerKind, timing: Timing, *, params: float, act_bytes: float,
          static_bytes: float, experts: float = 0.0) -> LayerCost:
    return LayerCost(
        name=name, kind=kind, fwd_ms=timing.fwd_ms, bwd_ms=timing.bwd_ms, wgrad_ms=timing.wgrad_ms,
        static_bytes=static_bytes, act_bytes=act_bytes, param_count=params, expert_param_count=experts,
        parts=timing.parts,
    )


def unit_runs(model: ModelSpec) -> tuple[tuple[str, int], ...]:
    """The profile's units in order as (unit key, repeat count): ``embedding``, runs of ``dense`` and
    ``moe`` decoder layers as ``moe_layer_freq`` has them, ``mtp`` (of the last decoder layer's kind) and
    ``output``."""
    runs: list[list] = [["embedding", 1]]
    for is_moe in model.moe_layers:
        key = "moe" if is_moe else "dense"
        if runs[-1][0] == key:
            runs[-1][1] += 1
        else:
            runs.append([key, 1])
    if model.mtp_num_layers:
        runs.append(["mtp", model.mtp_num_layers])
    runs.append(["output", 1])
    return tuple((key, count) for key, count in runs)


def distinct_units(*, model: ModelSpec, gpu: GpuSpec, cluster: ClusterSpec, parallel: ParallelSpec,
                   train: TrainSpec) -> dict[str, LayerCost]:
    """Each distinct unit of :func:`unit_runs`, costed once (named by its key)."""
    shapes = shapes_of(model=model, parallel=parallel, train=train)
    tp, cp = parallel.tensor_model_parallel_size, parallel.context_parallel_size
    device = Device(
        gpu=gpu, runtime=cluster.runtime, tp_comm_overlap=parallel.tp_comm_overlap and shapes.sequence_parallel,
        link=tensor_parallel_link(cluster=cluster, tensor_model_parallel_size=tp),
        cp_link=p2p_link(cluster=cluster, span=tp * cp), cluster=cluster,
    )

    def unit(key: str, kind: LayerKind, timing: Timing, params: float, act: float, experts: float = 0.0):
        static = unit_static_bytes(kind=kind, params=params, shapes=shapes, parallel=parallel, train=train,
                                   expert_params=experts)
        return _unit(key, kind, timing, params=params, act_bytes=act, static_bytes=static, experts=experts)

    keys = {key for key, _ in unit_runs(model)}
    pattern = model.moe_layers
    last_moe = bool(pattern and pattern[-1])
    units: dict[str, LayerCost] = {}
    for key, moe in (("dense", False), ("moe", True)):
        if key in keys:
            units[key] = unit(key, LayerKind.decoder, _decoder_timing(shapes, device, moe=moe),
                              decoder_params(shapes, moe=moe), decoder_activation_bytes(shapes, moe=moe),
                              expert_params(shapes, moe=moe))
    if "mtp" in keys:
        units["mtp"] = unit("mtp", LayerKind.mtp, _mtp_timing(shapes, device, moe=last_moe),
                            mtp_params(shapes, moe=last_moe), mtp_activation_bytes(shapes, moe=last_moe),
                            expert_params(shapes, moe=last_moe))
    embedding = embedding_params(shapes, max_position_embeddings=model.max_position_embeddings or model.seq_length)
    units["embedding"] = unit("embedding", LayerKind.embedding, _embedding_timing(shapes, device), embedding,
                              embedding_activation_bytes(shapes))
    holds_head = model.untie_embeddings_and_output_weights or parallel.pipeline_model_parallel_size > 1
    units["output"] = unit("output", LayerKind.loss, _output_timing(shapes, device),
                           output_params(shapes, holds_output_weight=holds_head), output_activation_bytes(shapes))
    return units


def layer_costs(*, model: ModelSpec, gpu: GpuSpec, cluster: ClusterSpec, parallel: ParallelSpec,
                train: TrainSpec) -> Profile:
    """Analytical per-unit costs for one microbatch: embedding, decoder.0..N-1, mtp.i, output.

    ``gpu`` is the device of the stage being costed (on a mixed cluster, call once per
    GPU type); ``cluster`` supplies the tensor-, context- and expert-parallel links and the runtime.
    Dense and MoE decoder layers follow ``model.moe_layers``. Raises ConfigError for shardings
    Megatron rejects.
    """
    units = distinct_units(model=model, gpu=gpu, cluster=cluster, parallel=parallel, train=train)
    layers: list[LayerCost] = []
    decoders = 0
    for key, count in unit_runs(model):
        if key in ("dense", "moe"):
            layers += _named_copies(units[key], "decoder", count, start=decoders)
            decoders += count
        elif key == "mtp":
            layers += _named_copies(units[key], "mtp", count)
        else:
            layers.append(units[key])
    return Profile(layers=tuple(layers), device=gpu.name, meta=_meta(model, cluster, parallel, train))


def _named_copies(unit: LayerCost, prefix: str, count: int, start: int = 0) -> list[LayerCost]:
    """``count`` copies of ``unit`` named prefix.start, ... (the constructor: dataclasses.replace is slower)."""
    return [
        LayerCost(name=f"{prefix}.{i}", kind=unit.kind, fwd_ms=unit.fwd_ms, bwd_ms=unit.bwd_ms, wgrad_ms=unit.wgrad_ms,
                  static_bytes=unit.static_bytes, act_bytes=unit.act_bytes, param_count=unit.param_count,
                  expert_param_count=unit.expert_param_count, parts=unit.parts)
        for i in range(start, start + count)
    ]


def _meta(model: ModelSpec, cluster: ClusterSpec, parallel: ParallelSpec, train: TrainSpec) -> tuple:
    meta = [
        ("source", "cost_model"),
        ("model", model.name),
        ("cluster", cluster.name),
        ("runtime", cluster.runtime.name),
        ("tensor_model_parallel_size", parallel.tensor_model_parallel_size),
        ("sequence_parallel", parallel.sequence_parallel),
        ("context_parallel_size", parallel.context_parallel_size),
        ("data_parallel_size", parallel.data_parallel_size),
        ("micro_batch_size", train.micro_batch_size),
        ("seq_length", train.seq_length),
        ("recompute_granularity", getattr(train.recompute_granularity, "value", train.recompute_granularity)),
        ("precision", train.precision),
    ]
    if train.fp8_recipe:
        meta.append(("fp8_recipe", train.fp8_recipe))
    if parallel.tp_comm_overlap:
        meta.append(("tp_comm_overlap", True))
    if model.is_moe:
        meta += [("expert_model_parallel_size", parallel.expert_model_parallel_size),
                 ("expert_tensor_parallel_size", parallel.expert_tp),
                 ("moe_token_dispatcher_type", parallel.features.dispatcher),
                 ("moe_load_imbalance", train.moe_load_imbalance)]
    return tuple(meta)
