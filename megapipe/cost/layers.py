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
- **tp_comm**: the *exposed* part of the tensor-parallel collectives (:mod:`megapipe.cost.linear`);
- **cp_comm**: the exposed part of context parallelism's ring exchange of K and V (:mod:`megapipe.cost.decoder`);
- **recompute**: the forward run again in the backward, all of it under full recompute, the
  attention core under selective (Korthikanti et al. 2022, Sec. 5).

The linear layers and their tensor-parallel collectives are :mod:`megapipe.cost.linear`'s, a decoder
layer's time :mod:`megapipe.cost.decoder`'s (attention, MLP, context parallelism's ring, recompute).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from megapipe.cost.comm import Collective, p2p_link, tensor_parallel_link
from megapipe.cost.decoder import FixedParts, decoder_parts, decoder_timing, fixed_shapes, shapes_of_key
from megapipe.cost.flops import eh_proj_gemm, output_gemms
from megapipe.cost.linear import linear_timing, memory_timing, tp_ms
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
from megapipe.cost.traffic import embedding_traffic_bytes, output_traffic_bytes
from megapipe.records import (
    ClusterSpec,
    GpuSpec,
    LayerCost,
    LayerKind,
    ModelSpec,
    ParallelSpec,
    Profile,
    RuntimeFeatures,
    TrainSpec,
)

__all__ = ["layer_costs", "distinct_units", "unit_runs", "unit_times", "unit_kinds", "UnitKinds", "unit_device",
           "unit_bytes", "profile_of_units", "unit_cost", "unit_kind",
           "UnitBytes", "UnitSizes", "unit_sizes", "BYTES_FEATURES",
           "bytes_features"]

_FIXED_CACHE = 4096
"""Unit shapes whose fixed times stay cached (a search meets a few hundred)."""
_CROSS_ENTROPY_ALL_REDUCES = 3
"""Max, target logit and sum of exp, each a [s, b] fp32 all-reduce (Megatron's vocab_parallel_cross_entropy)."""


def _embedding_timing(shapes: Shapes, device: Device) -> Timing:
    """Lookup on every vocab shard, then all-reduce (reduce-scatter with SP); all of backward is wgrad."""
    forward_bytes, backward_bytes = embedding_traffic_bytes(shapes)
    if shapes.sequence_parallel:
        comm = part("tp_comm", tp_ms(Collective.reduce_scatter, shapes, device),
                     tp_ms(Collective.all_gather, shapes, device))
    else:
        comm = part("tp_comm", tp_ms(Collective.all_reduce, shapes, device))
    timing = memory_timing("memory_bound", forward_bytes, backward_bytes, (2, 2), device) + comm
    return Timing(timing.fwd_ms, timing.bwd_ms, timing.bwd_ms, timing.parts)


def _output_timing(shapes: Shapes, device: Device) -> Timing:
    """Final norm, output GEMM (bf16 under FP8 training too) and vocab-parallel cross-entropy."""
    forward_bytes, backward_bytes = output_traffic_bytes(shapes)
    timing = memory_timing("memory_bound", forward_bytes, backward_bytes, (6, 6), device)
    for gemm in output_gemms(shapes):
        timing = timing + linear_timing(gemm, shapes, device, dtype="fp32" if shapes.gemm_dtype == "fp32" else "bf16")
    loss = _CROSS_ENTROPY_ALL_REDUCES * tp_ms(Collective.all_reduce, shapes, device, num_bytes=4 * shapes.tokens)
    return timing + part("tp_comm", loss)


@functools.lru_cache(maxsize=64)
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


BYTES_FEATURES = ("recompute_modules", "fine_grained_activation_offloading", "offload_modules",
                  "moe_router_padding_for_quantization", "moe_router_force_load_balancing")
"""The runtime features a unit's bytes and parameters read (:mod:`megapipe.cost.memory`: what selective recompute
and activation offloading keep; FP8's routing-map padding; forced balancing sets the busiest rank's tokens); every
other feature changes only times. tests/test_cost.py holds the memory model to it."""


@functools.lru_cache(maxsize=256)
def bytes_features(features: RuntimeFeatures) -> RuntimeFeatures:
    """``features`` as a unit's bytes see them: :data:`BYTES_FEATURES` kept, the others at their defaults (cached: a
    search asks for a dozen feature sets' thousands of times)."""
    return RuntimeFeatures(**{name: getattr(features, name) for name in BYTES_FEATURES})


@dataclass(frozen=True, slots=True)
class UnitBytes:
    """What a unit holds on one GPU: its parameters (and the routed experts' share), its weights, gradients and
    optimizer state, and its activations per in-flight microbatch."""

    param_count: float
    expert_param_count: float
    static_bytes: float
    act_bytes: float


@dataclass(frozen=True, slots=True)
class UnitSizes:
    """Each distinct unit's parameters, routed-expert parameters and activation bytes (by unit key): what a unit
    holds before the data-parallel size shards its optimizer state."""

    shapes: Shapes
    """The shapes they were read from (with :func:`bytes_features` only)."""
    units: tuple[tuple[str, float, float, float], ...]
    """(unit key, parameters, expert parameters, activation bytes), in :data:`_UNIT_ORDER`."""


def _bytes_parallel(parallel: ParallelSpec) -> ParallelSpec:
    features = bytes_features(parallel.features)
    return parallel if features == parallel.features else dataclasses.replace(parallel, features=features)


def unit_sizes(*, model: ModelSpec, parallel: ParallelSpec, train: TrainSpec) -> UnitSizes:
    """:class:`UnitSizes`, read with :func:`bytes_features` only: they read neither the data-parallel size nor PP,
    save whether the last stage holds the output weight (PP > 1)."""
    parallel = _bytes_parallel(parallel)
    shapes = shapes_of(model=model, parallel=parallel, train=train)
    kinds = unit_kinds(model)
    keys, last_moe = kinds.keys, kinds.last_moe
    out = []
    for key, moe in (("dense", False), ("moe", True)):
        if key in keys:
            out.append((key, decoder_params(shapes, moe=moe), expert_params(shapes, moe=moe),
                        decoder_activation_bytes(shapes, moe=moe)))
    if "mtp" in keys:
        out.append(("mtp", mtp_params(shapes, moe=last_moe), expert_params(shapes, moe=last_moe),
                    mtp_activation_bytes(shapes, moe=last_moe)))
    embedding = embedding_params(shapes, max_position_embeddings=model.max_position_embeddings or model.seq_length)
    out.append(("embedding", embedding, 0.0, embedding_activation_bytes(shapes)))
    holds_head = model.untie_embeddings_and_output_weights or parallel.pipeline_model_parallel_size > 1
    out.append(("output", output_params(shapes, holds_output_weight=holds_head), 0.0, output_activation_bytes(shapes)))
    return UnitSizes(shapes=shapes, units=tuple(out))


def unit_bytes(*, model: ModelSpec, parallel: ParallelSpec, train: TrainSpec,
               sizes: UnitSizes | None = None) -> dict[str, UnitBytes]:
    """Each distinct unit's parameters and bytes (by unit key), read with :func:`bytes_features` only: equal for
    every feature set that agrees there. ``sizes``: the candidate's :func:`unit_sizes` (at any DP), when known."""
    sizes = sizes or unit_sizes(model=model, parallel=parallel, train=train)
    parallel = _bytes_parallel(parallel)
    return {key: UnitBytes(param_count=params, expert_param_count=experts, act_bytes=act,
                           static_bytes=unit_static_bytes(kind=_KINDS[key], params=params, shapes=sizes.shapes,
                                                          parallel=parallel, train=train, expert_params=experts))
            for key, params, experts, act in sizes.units}


@dataclass(frozen=True, slots=True)
class UnitKinds:
    """Which distinct units a model's profile holds (:func:`unit_runs`' keys) and which decoders they cost."""

    keys: frozenset[str]
    decoders: tuple[bool, ...]
    """The decoder layers to cost, MoE or not (an MTP block's decoder is the last decoder layer's kind)."""
    last_moe: bool
    """Whether the last decoder layer is a MoE layer."""


@functools.lru_cache(maxsize=64)
def unit_kinds(model: ModelSpec) -> UnitKinds:
    keys = frozenset(key for key, _ in unit_runs(model))
    last_moe = _last_moe(model)
    return UnitKinds(keys=keys, last_moe=last_moe, decoders=tuple(
        moe for key, moe in (("dense", False), ("moe", True)) if key in keys or ("mtp" in keys and moe == last_moe)))


def unit_device(*, gpu: GpuSpec, cluster: ClusterSpec, parallel: ParallelSpec) -> Device:
    """The device a candidate's units are costed on: the GPU, the runtime, and its tensor- and context-parallel
    links."""
    tp, cp = parallel.tensor_model_parallel_size, parallel.context_parallel_size
    return Device(
        gpu=gpu, runtime=cluster.runtime, tp_comm_overlap=parallel.tp_comm_overlap and parallel.sequence_parallel
        and tp > 1, link=tensor_parallel_link(cluster=cluster, tensor_model_parallel_size=tp),
        cp_link=p2p_link(cluster=cluster, span=tp * cp), cluster=cluster,
    )


def unit_times(*, model: ModelSpec, gpu: GpuSpec, cluster: ClusterSpec, parallel: ParallelSpec,
               train: TrainSpec, kinds: UnitKinds | None = None, device: Device | None = None) -> dict[str, Timing]:
    """Each distinct unit's time (by unit key) on ``gpu``; it does not read the pipeline or data-parallel size.
    ``kinds`` and ``device``: the model's :func:`unit_kinds` and the candidate's :func:`unit_device`, when a caller
    that costs many candidates keeps them."""
    shapes = shapes_of(model=model, parallel=parallel, train=train)
    device = device or unit_device(gpu=gpu, cluster=cluster, parallel=parallel)
    kinds = kinds or unit_kinds(model)
    keys = kinds.keys
    decoders, (embedding, output, eh_proj) = _fixed_times(fixed_shapes(shapes), device, kinds.decoders)
    out: dict[str, Timing] = {}
    for moe, fixed in zip(kinds.decoders, decoders):
        out["moe" if moe else "dense"] = decoder_timing(shapes, device, moe=moe, fixed=fixed)
    if "mtp" in keys:
        # eh_proj GEMM, one decoder layer (with its recompute), the shared head and loss, and the input lookup
        out["mtp"] = eh_proj + out["moe" if kinds.last_moe else "dense"] + output + embedding
    out["embedding"], out["output"] = embedding, output
    return {key: out[key] for key in _UNIT_ORDER if key in keys}


@functools.lru_cache(maxsize=_FIXED_CACHE)
def _fixed_times(key: tuple, device: Device, kinds: tuple[bool, ...]
                 ) -> tuple[tuple[FixedParts, ...], tuple[Timing, Timing, Timing]]:
    """:func:`fixed_unit_times` of the shapes ``key`` stands for (:func:`~megapipe.cost.decoder.fixed_shapes`),
    cached."""
    return fixed_unit_times(shapes_of_key(key), device, kinds)


def fixed_unit_times(shapes: Shapes, device: Device, kinds: tuple[bool, ...]
                     ) -> tuple[tuple[FixedParts, ...], tuple[Timing, Timing, Timing]]:
    """What no runtime feature and no recompute setting changes: the decoders' fixed parts (MoE or not, by
    ``kinds``), and the embedding's, the output's and an MTP block's eh_proj times."""
    return (tuple(decoder_parts(shapes, device, moe) for moe in kinds),
            (_embedding_timing(shapes, device), _output_timing(shapes, device),
             linear_timing(eh_proj_gemm(shapes), shapes, device)))


_UNIT_ORDER = ("dense", "moe", "mtp", "embedding", "output")
_KINDS = {"dense": LayerKind.decoder, "moe": LayerKind.decoder, "mtp": LayerKind.mtp,
          "embedding": LayerKind.embedding, "output": LayerKind.loss}


def _last_moe(model: ModelSpec) -> bool:
    """Whether the last decoder layer (the kind of the MTP blocks' decoder) is a MoE layer."""
    decoders = [key for key, _ in unit_runs(model) if key in ("dense", "moe")]
    return bool(decoders) and decoders[-1] == "moe"


def unit_kind(key: str) -> LayerKind:
    """The pipeline unit kind of unit ``key`` (:func:`unit_runs`' keys)."""
    return _KINDS[key]


def unit_cost(key: str, timing: Timing, sizes: UnitBytes) -> LayerCost:
    """The unit ``key`` with its time and bytes."""
    return LayerCost(
        name=key, kind=_KINDS[key], fwd_ms=timing.fwd_ms, bwd_ms=timing.bwd_ms, wgrad_ms=timing.wgrad_ms,
        static_bytes=sizes.static_bytes, act_bytes=sizes.act_bytes, param_count=sizes.param_count,
        expert_param_count=sizes.expert_param_count, parts=timing.parts,
    )


def distinct_units(*, model: ModelSpec, gpu: GpuSpec, cluster: ClusterSpec, parallel: ParallelSpec,
                   train: TrainSpec) -> dict[str, LayerCost]:
    """Each distinct unit of :func:`unit_runs`, costed once (named by its key)."""
    times = unit_times(model=model, gpu=gpu, cluster=cluster, parallel=parallel, train=train)
    sizes = unit_bytes(model=model, parallel=parallel, train=train)
    return {key: unit_cost(key, timing, sizes[key]) for key, timing in times.items()}


def layer_costs(*, model: ModelSpec, gpu: GpuSpec, cluster: ClusterSpec, parallel: ParallelSpec,
                train: TrainSpec) -> Profile:
    """Analytical per-unit costs for one microbatch: embedding, decoder.0..N-1, mtp.i, output.

    ``gpu`` is the device of the stage being costed (on a mixed cluster, call once per
    GPU type); ``cluster`` supplies the tensor-, context- and expert-parallel links and the runtime.
    Dense and MoE decoder layers follow ``model.moe_layers``. Raises ConfigError for shardings
    Megatron rejects.
    """
    units = distinct_units(model=model, gpu=gpu, cluster=cluster, parallel=parallel, train=train)
    return profile_of_units(units, model=model, gpu=gpu, cluster=cluster, parallel=parallel, train=train)


def profile_of_units(units: dict[str, LayerCost], *, model: ModelSpec, gpu: GpuSpec, cluster: ClusterSpec,
                     parallel: ParallelSpec, train: TrainSpec) -> Profile:
    """The profile :func:`layer_costs` gives, from the candidate's :func:`distinct_units` (by unit key) already
    costed: each unit repeated as :func:`unit_runs` has it, named by its place."""
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
