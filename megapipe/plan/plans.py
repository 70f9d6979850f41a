"""Frozen records of the planner: one candidate, one evaluated plan, a search result (its options are
:mod:`megapipe.options`'s)."""

from __future__ import annotations

from dataclasses import dataclass, field

from megapipe.records import (PARALLEL_MEMORY_FIELDS, TRAIN_MEMORY_FIELDS, ParallelSpec, Partition, RuntimeFeatures,
                              TrainSpec)

__all__ = ["Candidate", "LAYER_KEY_FEATURES", "StageUsage", "Plan", "SearchStats", "SearchResult",
           "features_dict"]

@dataclass(frozen=True, slots=True, kw_only=True)
class Candidate:
    """One point of the search space."""

    parallel: ParallelSpec
    train: TrainSpec
    schedule: str
    per_stage_recompute: bool = False
    """Each pipeline rank picks its own recompute setting with the split; train's setting is then unused."""

    @property
    def num_microbatches(self) -> int:
        return self.train.num_microbatches(self.parallel.data_parallel_size)

    layer_key: tuple = field(init=False, repr=False, compare=False)
    """What per-layer costs depend on (not pp, vp, dp or the schedule; the expert data-parallel size follows from
    TP, CP, DP, EP and ETP); set once here, since every cache of the search looks it up."""

    def __post_init__(self) -> None:
        par, train = self.parallel, self.train
        object.__setattr__(self, "layer_key", (
            par.tensor_model_parallel_size,
            par.sequence_parallel,
            par.context_parallel_size,
            train.micro_batch_size,
            train.recompute_granularity,
            train.seq_length,
            train.precision,
            train.fp8_recipe,
            train.fp8_param_gather,
            par.tp_comm_overlap,
            par.expert_model_parallel_size,
            par.expert_tensor_parallel_size,
            par.features,  # at LAYER_KEY_FEATURES
            train.moe_load_imbalance,
            _memory_settings(par, train),
        ))


LAYER_KEY_FEATURES = 12
"""The position of the runtime features in :attr:`Candidate.layer_key`."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StageUsage:
    """One pipeline rank (all its virtual stages): time per microbatch and peak memory."""

    time_ms: float
    """Forward + backward of one microbatch over the rank's layers."""
    static_bytes: float
    activation_bytes: float
    """Peak in-flight activations."""
    total_bytes: float
    gpu_name: str = ""

    def to_dict(self) -> dict:
        out = {
            "time_ms": round(self.time_ms, 6),
            "static_bytes": float(round(self.static_bytes)),
            "activation_bytes": float(round(self.activation_bytes)),
            "total_bytes": float(round(self.total_bytes)),
        }
        if self.gpu_name:
            out["gpu"] = self.gpu_name
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """An evaluated candidate: timing, throughput, memory, money and warnings."""

    parallel: ParallelSpec
    train: TrainSpec
    schedule: str
    num_microbatches: int
    decoder_layers_per_stage: tuple[int, ...]
    """Decoder layers per layout stage (vp-major)."""
    layout: str
    method: str
    """optimal, equal or parameters: how the layers were split."""
    pipeline_ms: float
    """Simulated pipeline time of one step (forward + backward of all microbatches)."""
    dp_sync_ms: float
    """Exposed (not overlapped) data-parallel gradient/parameter communication."""
    optimizer_ms: float
    step_time_s: float
    """pipeline_ms + dp_sync_ms + optimizer_ms + step_overhead_ms, in seconds."""
    tokens_per_s: float
    tokens_per_s_per_gpu: float
    mfu: float
    bubble_fraction: float
    stages: tuple[StageUsage, ...]
    memory_spread: float
    """(max - min) / mean of the per-rank peak memory."""
    memory_cv: float
    """Coefficient of variation (population std / mean) of the per-rank peak memory."""
    cost_per_million_tokens: float
    total_cost: float
    """Dollars for SearchOptions.total_tokens at the cluster's price."""
    what_if: bool = False
    """True when megatron-core cannot run this schedule as simulated (pipelined ZB-H1/H2, ZB-V, DualPipeV)."""
    feasible: bool = True
    memory_over_gib: float = 0.0
    """How far the fullest rank exceeds its usable memory (0 when it fits)."""
    warnings: tuple[str, ...] = ()
    stage_gpus: tuple[str, ...] = ()
    """GPU type per pipeline rank (mixed clusters)."""
    stage_recompute: tuple[str, ...] = ()
    """Recompute setting per pipeline rank when it was searched per stage; train then holds the strongest one."""
    step_overhead_ms: float = 0.0
    """The runtime's fixed time per step (RuntimeSpec.step_overhead_ms)."""
    step_time_interval: tuple[float, float] | None = None
    """(low, high): the measured step over step_time_s minus 1, for 80% of held-out published runs of this kind
    (megapipe.plan.interval); None without validated intervals."""
    breakdown: tuple[tuple[str, float], ...] = ()
    """Where one step's time goes, ms, summing to step_time_s: the slowest pipeline rank's kernels and exposed
    communication by part (megapipe.records.TIME_PARTS, times its microbatches), the framework's per-microbatch
    time, the pipeline bubble (that rank's idle time, p2p waits included), DP sync, optimizer, step overhead."""
    partition: Partition | None = field(default=None, compare=False, repr=False)
    """The solver's record, for the emitters."""
    simulation: object = field(default=None, compare=False, repr=False)
    """The megapipe.simulate.SimResult of the step, for the Gantt chart."""

    @property
    def key(self) -> tuple:
        par, train = self.parallel, self.train
        return (
            par.tensor_model_parallel_size,
            par.pipeline_model_parallel_size,
            par.data_parallel_size,
            par.context_parallel_size,
            par.virtual_pipeline_model_parallel_size,
            par.sequence_parallel,
            train.micro_batch_size,
            "per_stage:" + "/".join(self.stage_recompute) if self.stage_recompute else train.recompute_granularity.value,
            self.schedule,
        )

    def to_dict(self, *, moe: bool = False) -> dict:
        """The plan's record; ``moe`` adds the expert-parallel sizes and the dispatcher."""
        out = {
            "parallel": _parallel_dict(self.parallel, moe=moe),
            "train": _train_dict(self.train, num_microbatches=self.num_microbatches),
            "schedule": str(self.schedule),
            "method": self.method,
            "decoder_layers_per_stage": list(self.decoder_layers_per_stage),
            "layout": self.layout,
            **self._figures_dict(),
        }
        if self.stage_gpus:
            out["stage_gpus"] = list(self.stage_gpus)
        if self.stage_recompute:
            out["stage_recompute"] = list(self.stage_recompute)
        return out

    def _figures_dict(self) -> dict:
        """The plan's times, throughput, memory, cost and verdicts, rounded as plan.yaml records them."""
        return {
            "step_time_s": _round(self.step_time_s),
            **({"step_time_interval": [_round(v) for v in self.step_time_interval]}
               if self.step_time_interval else {}),
            "pipeline_ms": _round(self.pipeline_ms),
            "dp_sync_ms": _round(self.dp_sync_ms),
            "optimizer_ms": _round(self.optimizer_ms),
            "step_overhead_ms": _round(self.step_overhead_ms),
            "breakdown_ms": {name: _round(value) for name, value in self.breakdown},
            "tokens_per_s": _round(self.tokens_per_s),
            "tokens_per_s_per_gpu": _round(self.tokens_per_s_per_gpu),
            "mfu": _round(self.mfu),
            "bubble_fraction": _round(self.bubble_fraction),
            "stages": [stage.to_dict() for stage in self.stages],
            "memory_spread": _round(self.memory_spread),
            "memory_cv": _round(self.memory_cv),
            "cost_per_million_tokens": _round(self.cost_per_million_tokens),
            "total_cost": _round(self.total_cost),
            "what_if": self.what_if,
            "feasible": self.feasible,
            "memory_over_gib": _round(self.memory_over_gib),
            "warnings": list(self.warnings),
        }


def _parallel_dict(par: ParallelSpec, *, moe: bool) -> dict:
    """A plan's parallel section in Megatron's names; ``moe`` adds the expert-parallel sizes and the features."""
    return {
        "tensor_model_parallel_size": par.tensor_model_parallel_size,
        "pipeline_model_parallel_size": par.pipeline_model_parallel_size,
        "virtual_pipeline_model_parallel_size": par.virtual_pipeline_model_parallel_size,
        "context_parallel_size": par.context_parallel_size,
        "data_parallel_size": par.data_parallel_size,
        "sequence_parallel": par.sequence_parallel,
        "use_distributed_optimizer": par.use_distributed_optimizer,
        **({"tp_comm_overlap": True} if par.tp_comm_overlap and par.sequence_parallel else {}),
        **({"microbatch_group_size_per_vp_stage": par.microbatch_group_size_per_vp_stage}
           if par.microbatch_group_size_per_vp_stage and par.virtual_pipeline_model_parallel_size > 1 else {}),
        **({"use_megatron_fsdp": True, "data_parallel_sharding_strategy": par.data_parallel_sharding_strategy}
           if par.use_megatron_fsdp else {}),
        **({"fine_grained_activation_offloading": True, "offload_modules": list(par.features.offload_modules)}
           if par.features.fine_grained_activation_offloading and not moe else {}),
        **({"expert_model_parallel_size": par.expert_model_parallel_size,
            "expert_tensor_parallel_size": par.expert_tp,
            "expert_data_parallel_size": par.expert_data_parallel_size,
            **features_dict(par.features)}
           if moe else {}),
    }


def _train_dict(train: TrainSpec, *, num_microbatches: int) -> dict:
    """A plan's train section in Megatron's names; the FP8 recipe only for an fp8 plan."""
    return {
        "micro_batch_size": train.micro_batch_size,
        "global_batch_size": train.global_batch_size,
        "seq_length": train.seq_length,
        "recompute_granularity": train.recompute_granularity.value,
        "num_microbatches": num_microbatches,
        "precision": train.precision,
        **({"fp8_recipe": train.fp8_recipe, "fp8_param_gather": train.fp8_param_gather}
           if train.precision == "fp8" else {}),
        **{name: value for name, value in _memory_settings(None, train) if value != getattr(TrainSpec(), name)},
    }


def _memory_settings(par: ParallelSpec | None, train: TrainSpec | None) -> tuple[tuple[str, object], ...]:
    """(name, value) of the memory settings (:data:`megapipe.records.PARALLEL_MEMORY_FIELDS` and
    ``TRAIN_MEMORY_FIELDS``): what the per-unit static bytes read beyond the sizes and precision, and what plan.yaml
    records when they are not the default."""
    return (tuple((name, getattr(par, name)) for name in PARALLEL_MEMORY_FIELDS if par is not None)
            + tuple((name, getattr(train, name)) for name in TRAIN_MEMORY_FIELDS if train is not None))


@dataclass(frozen=True, slots=True, kw_only=True)
class SearchStats:
    enumerated: int = 0
    """Candidates generated, pruned ones included."""
    evaluated: int = 0
    """Candidates that reached a step-time figure (bound or exact)."""
    partitioned: int = 0
    """Exact partition solves (one per candidate and placement that passed the memory check)."""
    simulated: int = 0
    """Candidates partitioned and simulated exactly."""
    pruned: tuple[tuple[str, int], ...] = ()
    """(reason, count): divisibility, microbatches, memory, bound, ..."""
    seconds: float = 0.0
    virtual_sizes: tuple[int, ...] = ()
    """The VP values of the candidates that passed the shape rules (1 without interleaving)."""

    def to_dict(self) -> dict:
        return {
            "enumerated": self.enumerated,
            "evaluated": self.evaluated,
            "partitioned": self.partitioned,
            "simulated": self.simulated,
            "pruned": dict(self.pruned),
            "seconds": round(self.seconds, 4),
            "virtual_pipeline_model_parallel_sizes": list(self.virtual_sizes),
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class SearchResult:
    plans: tuple[Plan, ...]
    """Best first; what-if plans (schedules megatron-core cannot run) only when asked for."""
    chosen: Plan | None = None
    """The plan to run: the best one megatron-core runs (the first plan unless what-if plans outrank it);
    what the plan dir's files are written for. None means the first plan."""
    baseline: Plan | None = None
    """The best plan's configuration with layers split equally (Megatron's default)."""
    reference: Plan | None = None
    """A fixed comparison configuration (e.g. a published TP/PP/DP), when it fits the cluster."""
    stats: SearchStats = field(default_factory=SearchStats)
    profile: object = field(default=None, compare=False, repr=False)
    """The megapipe.profile.format.Profile the best plan was costed with."""
    hetero_gain: float | None = None
    """Mixed clusters: best plan's throughput over the equal split on the same stages, minus 1."""

    @property
    def best(self) -> Plan:
        """The plan to run (:attr:`chosen`)."""
        return self.chosen or self.plans[0]


def features_dict(features: RuntimeFeatures) -> dict:
    """The runtime features in Megatron's names, as plan.yaml records them."""
    out = {"moe_token_dispatcher_type": features.moe_token_dispatcher_type}
    if features.moe_token_dispatcher_type == "flex":
        out["moe_flex_dispatcher_backend"] = features.moe_flex_dispatcher_backend
    out.update(overlap_moe_expert_parallel_comm=features.overlap_moe_expert_parallel_comm,
               delay_wgrad_compute=features.delay_wgrad_compute,
               moe_shared_expert_overlap=features.moe_shared_expert_overlap,
               moe_permute_fusion=features.moe_permute_fusion, moe_router_fusion=features.moe_router_fusion,
               cuda_graph_impl=features.cuda_graph_impl, cuda_graph_scope=list(features.cuda_graph_scope),
               moe_router_force_load_balancing=features.moe_router_force_load_balancing,
               moe_router_padding_for_quantization=features.moe_router_padding_for_quantization)
    if features.fine_grained_activation_offloading:
        out.update(fine_grained_activation_offloading=True, offload_modules=list(features.offload_modules))
    return out


def _round(value: float) -> float:
    """12 significant digits: stable text across platforms for byte-identical plan files."""
    return float(f"{value:.12g}")

