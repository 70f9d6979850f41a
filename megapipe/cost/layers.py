"""The analytical profile: one ``LayerCost`` per pipeline unit from FLOPs, bytes and the GPU.

Per unit and microbatch on one GPU of its stage:

- ``fwd_ms`` = GEMMs on the efficiency curve + attention core + memory-bound kernels
  + tensor-parallel collectives (costed serially: Megatron overlaps some backward
  ones with GEMMs, which calibration absorbs);
- ``bwd_ms`` = dgrad + wgrad GEMMs (2x forward), attention backward, 2x the
  forward's memory traffic, the backward collectives, plus recomputation: the whole
  forward under full recompute, the attention core's forward under selective;
- ``wgrad_ms`` = the weight-gradient GEMMs (zero-bubble W); the embedding's entire
  backward is weight gradient;
- ``static_bytes`` = parameters per GPU x :func:`bytes_per_parameter`;
- ``act_bytes`` from :mod:`megapipe.cost.memory`.

Attention core time: causal flash/fused kernels skip the masked half of the square,
and their backward recomputes ``Q K^T``: five ``s x s`` matmuls against the forward's
two (Dao 2023, "FlashAttention-2", Sec. 3.1), so backward = 2.5 x forward. Unfused
attention runs both batched GEMMs on the full square plus the softmax traffic.
"""

from __future__ import annotations

from dataclasses import dataclass

from megapipe.cost.comm import Collective, collective_ms, tensor_parallel_link
from megapipe.cost.efficiency import gemm_ms, memory_ms
from megapipe.cost.flops import attention_flops, decoder_gemm_flops, output_gemm_flops
from megapipe.cost.memory import (
    decoder_activation_bytes,
    embedding_activation_bytes,
    mtp_activation_bytes,
    output_activation_bytes,
)
from megapipe.cost.params import bytes_per_parameter, decoder_params, embedding_params, mtp_params, output_params
from megapipe.cost.shapes import Shapes, shapes_of
from megapipe.cost.traffic import (
    attention_core_traffic_bytes,
    decoder_traffic_bytes,
    embedding_traffic_bytes,
    output_traffic_bytes,
)
from megapipe.records import (
    ClusterSpec,
    GpuSpec,
    LayerCost,
    LayerKind,
    LinkSpec,
    ModelSpec,
    ParallelSpec,
    Profile,
    Recompute,
    TrainSpec,
)

__all__ = ["layer_costs"]

_FLASH_BACKWARD_RATIO = 2.5
_CROSS_ENTROPY_ALL_REDUCES = 3
"""Max, target logit and sum of exp, each a [s, b] fp32 all-reduce (Megatron's vocab_parallel_cross_entropy)."""


@dataclass(frozen=True, slots=True)
class _Timing:
    fwd_ms: float = 0.0
    bwd_ms: float = 0.0
    wgrad_ms: float = 0.0

    def __add__(self, other: "_Timing") -> "_Timing":
        return _Timing(self.fwd_ms + other.fwd_ms, self.bwd_ms + other.bwd_ms, self.wgrad_ms + other.wgrad_ms)


@dataclass(frozen=True, slots=True)
class _Device:
    gpu: GpuSpec
    link: LinkSpec
    precision: str


def _gemms(flops: tuple[float, ...], device: _Device) -> _Timing:
    forward = sum(gemm_ms(flops=f, gpu=device.gpu, precision=device.precision) for f in flops)
    return _Timing(forward, 2 * forward, forward)


def _memory(forward_bytes: float, backward_bytes: float, device: _Device) -> _Timing:
    return _Timing(memory_ms(num_bytes=forward_bytes, gpu=device.gpu), memory_ms(num_bytes=backward_bytes, gpu=device.gpu))


def _attention_core(shapes: Shapes, device: _Device) -> _Timing:
    full_square = attention_flops(shapes)
    if shapes.unfused_attention:
        per_gemm = gemm_ms(flops=full_square / 2, gpu=device.gpu, precision=device.precision)
        traffic = attention_core_traffic_bytes(shapes)
        return _Timing(2 * per_gemm, 4 * per_gemm) + _memory(traffic, 2 * traffic, device)
    causal = full_square / 2
    return _Timing(
        gemm_ms(flops=causal, gpu=device.gpu, precision=device.precision),
        gemm_ms(flops=_FLASH_BACKWARD_RATIO * causal, gpu=device.gpu, precision=device.precision),
    )


def _collectives(shapes: Shapes, device: _Device, forward: tuple[Collective, ...],
                 backward: tuple[Collective, ...]) -> _Timing:
    """Collectives over the TP group on the full ``[s/cp, b, h]`` hidden state."""
    num_bytes = shapes.element_bytes * shapes.tokens * shapes.hidden_size
    group, link = shapes.tensor_model_parallel_size, device.link

    def total(kinds: tuple[Collective, ...]) -> float:
        return sum(collective_ms(kind=k, num_bytes=num_bytes, group_size=group, link=link) for k in kinds)

    return _Timing(total(forward), total(backward))


def _decoder_collectives(shapes: Shapes, device: _Device) -> _Timing:
    """Two per pass (after attention and after the MLP): all-reduce, or all-gather + reduce-scatter with SP."""
    if shapes.sequence_parallel:
        pair = (Collective.all_gather, Collective.reduce_scatter) * 2
        return _collectives(shapes, device, pair, pair)
    pair = (Collective.all_reduce,) * 2
    return _collectives(shapes, device, pair, pair)


def _with_recompute(timing: _Timing, core: _Timing, shapes: Shapes) -> _Timing:
    if shapes.recompute == Recompute.full:
        return _Timing(timing.fwd_ms, timing.bwd_ms + timing.fwd_ms, timing.wgrad_ms)
    if shapes.recompute == Recompute.selective:
        return _Timing(timing.fwd_ms, timing.bwd_ms + core.fwd_ms, timing.wgrad_ms)
    return timing


def _decoder_timing(shapes: Shapes, device: _Device) -> _Timing:
    core = _attention_core(shapes, device)
    traffic = decoder_traffic_bytes(shapes)
    timing = (
        _gemms(decoder_gemm_flops(shapes), device) + core + _memory(traffic, 2 * traffic, device)
        + _decoder_collectives(shapes, device)
    )
    return _with_recompute(timing, core, shapes)


def _embedding_timing(shapes: Shapes, device: _Device) -> _Timing:
    """Lookup on every vocab shard, then all-reduce (reduce-scatter with SP); all of backward is wgrad."""
    forward_bytes, backward_bytes = embedding_traffic_bytes(shapes)
    if shapes.sequence_parallel:
        comm = _collectives(shapes, device, (Collective.reduce_scatter,), (Collective.all_gather,))
    else:
        comm = _collectives(shapes, device, (Collective.all_reduce,), ())
    timing = _memory(forward_bytes, backward_bytes, device) + comm
    return _Timing(timing.fwd_ms, timing.bwd_ms, timing.bwd_ms)


def _output_timing(shapes: Shapes, device: _Device) -> _Timing:
    """Final norm, output GEMM and vocab-parallel cross-entropy with its small all-reduces."""
    forward_bytes, backward_bytes = output_traffic_bytes(shapes)
    if shapes.sequence_parallel:
        comm = _collectives(shapes, device, (Collective.all_gather,), (Collective.reduce_scatter,))
    else:
        comm = _collectives(shapes, device, (), (Collective.all_reduce,))
    loss_bytes = 4 * shapes.tokens
    loss_comm = _CROSS_ENTROPY_ALL_REDUCES * collective_ms(
        kind=Collective.all_reduce, num_bytes=loss_bytes, group_size=shapes.tensor_model_parallel_size,
        link=device.link,
    )
    return (
        _gemms(output_gemm_flops(shapes), device) + _memory(forward_bytes, backward_bytes, device) + comm
        + _Timing(loss_comm, 0.0, 0.0)
    )


def _mtp_timing(shapes: Shapes, device: _Device) -> _Timing:
    """eh_proj GEMM, one decoder layer (with its recompute), the shared head and loss, and the input lookup."""
    eh_proj = 2.0 * shapes.tokens * 2 * shapes.hidden_size * shapes.hidden_size / shapes.tensor_model_parallel_size
    lookup = _embedding_timing(shapes, device)
    return _gemms((eh_proj,), device) + _decoder_timing(shapes, device) + _output_timing(shapes, device) + lookup


def _unit(name: str, kind: LayerKind, timing: _Timing, *, params: float, act_bytes: float,
          bytes_per_param: float) -> LayerCost:
    return LayerCost(
        name=name, kind=kind, fwd_ms=timing.fwd_ms, bwd_ms=timing.bwd_ms, wgrad_ms=timing.wgrad_ms,
        static_bytes=params * bytes_per_param, act_bytes=act_bytes, param_count=params,
    )


def layer_costs(*, model: ModelSpec, gpu: GpuSpec, cluster: ClusterSpec, parallel: ParallelSpec,
                train: TrainSpec) -> Profile:
    """Analytical per-unit costs for one microbatch: embedding, decoder.0..N-1, mtp.i, output.

    ``gpu`` is the device of the stage being costed (on a mixed cluster, call once per
    GPU type); ``cluster`` supplies the tensor-parallel link. Raises ConfigError for
    shardings Megatron rejects.
    """
    shapes = shapes_of(model=model, parallel=parallel, train=train)
    device = _Device(
        gpu=gpu, precision=train.precision,
        link=tensor_parallel_link(cluster=cluster, tensor_model_parallel_size=parallel.tensor_model_parallel_size),
    )
    per_param = bytes_per_parameter(precision=train.precision, parallel=parallel)
    holds_head = model.untie_embeddings_and_output_weights or parallel.pipeline_model_parallel_size > 1
    decoder = _unit("decoder.0", LayerKind.decoder, _decoder_timing(shapes, device), params=decoder_params(shapes),
                    act_bytes=decoder_activation_bytes(shapes), bytes_per_param=per_param)
    mtp = _unit("mtp.0", LayerKind.mtp, _mtp_timing(shapes, device), params=mtp_params(shapes),
                act_bytes=mtp_activation_bytes(shapes), bytes_per_param=per_param)
    layers = [
        _unit("embedding", LayerKind.embedding, _embedding_timing(shapes, device),
              params=embedding_params(shapes, max_position_embeddings=model.max_position_embeddings or model.seq_length),
              act_bytes=embedding_activation_bytes(shapes), bytes_per_param=per_param),
        *_named_copies(decoder, "decoder", model.num_layers),
        *_named_copies(mtp, "mtp", model.mtp_num_layers),
        _unit("output", LayerKind.loss, _output_timing(shapes, device),
              params=output_params(shapes, holds_output_weight=holds_head),
              act_bytes=output_activation_bytes(shapes), bytes_per_param=per_param),
    ]
    return Profile(layers=tuple(layers), device=gpu.name, meta=_meta(model, cluster, parallel, train))


def _named_copies(unit: LayerCost, prefix: str, count: int) -> list[LayerCost]:
    """``count`` copies of ``unit`` named prefix.0, prefix.1, ... (the constructor: dataclasses.replace is slower)."""
    return [
        LayerCost(name=f"{prefix}.{i}", kind=unit.kind, fwd_ms=unit.fwd_ms, bwd_ms=unit.bwd_ms, wgrad_ms=unit.wgrad_ms,
                  static_bytes=unit.static_bytes, act_bytes=unit.act_bytes, param_count=unit.param_count)
        for i in range(count)
    ]


def _meta(model: ModelSpec, cluster: ClusterSpec, parallel: ParallelSpec, train: TrainSpec) -> tuple:
    return (
        ("source", "cost_model"),
        ("model", model.name),
        ("cluster", cluster.name),
        ("tensor_model_parallel_size", parallel.tensor_model_parallel_size),
        ("sequence_parallel", parallel.sequence_parallel),
        ("context_parallel_size", parallel.context_parallel_size),
        ("data_parallel_size", parallel.data_parallel_size),
        ("micro_batch_size", train.micro_batch_size),
        ("seq_length", train.seq_length),
        ("recompute_granularity", getattr(train.recompute_granularity, "value", train.recompute_granularity)),
        ("precision", train.precision),
    )
