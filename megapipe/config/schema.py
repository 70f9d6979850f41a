"""Hydra structured-config schemas, registered in ConfigStore by :func:`register_configs`.

These are mutable, Hydra-owned dataclasses holding only OmegaConf types. The
YAML files in ``hydra_conf/`` extend them through their defaults list
(``defaults: [base_model, _self_]``), so a mistyped key is Hydra's error.
A parallel or train field left ``None`` is searched by ``megapipe plan`` and
takes a documented default elsewhere (``megapipe.config.build``).
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from megapipe.options import PackOptions
from megapipe.records import GpuSpec, LinkSpec, ModelSpec, ParallelSpec, RuntimeFeatures, RuntimeSpec, TrainSpec

__all__ = [
    "ModelConfig",
    "GpuConfig",
    "LinkConfig",
    "NodeGroupConfig",
    "ClusterConfig",
    "RuntimeConfig",
    "ParallelConfig",
    "TrainConfig",
    "ScheduleConfig",
    "SearchConfig",
    "OutputConfig",
    "ValidateConfig",
    "Config",
    "register_configs",
]


def _schema_type(hint):
    """A record's annotation as OmegaConf types: X | None -> Optional[X], tuple[X, ...] -> List[X], a (key, value)
    table tuple[tuple[str, V], ...] -> Dict[str, V], (key, low, high) -> Dict[str, List[float]]."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        inner = [arg for arg in args if arg is not type(None)]
        return Optional[_schema_type(inner[0])] if len(inner) == 1 else Any
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        item = args[0]
        if typing.get_origin(item) is tuple:
            values = typing.get_args(item)[1:]
            return Dict[str, values[0]] if len(values) == 1 else Dict[str, List[values[0]]]
        return List[_schema_type(item)]
    return hint


def _is_table(hint) -> bool:
    return typing.get_origin(_schema_type(hint)) is dict


def record_schema(name: str, sources: Sequence[tuple[type, Sequence[str] | None]], *, nullable: Sequence[str] = (),
                  nullable_required: bool = False, replace: dict | None = None, extra: dict | None = None) -> type:
    """A Hydra schema made from the records' fields, so each setting is declared (and documented) once.

    ``sources`` lists (record, field names or None for all); ``nullable`` fields become Optional with default
    null (searched, or derived at the boundary); ``nullable_required`` makes the record's required fields
    nullable too (filled from a file), else they are MISSING; ``replace`` gives a field another (type, default)
    and, where the setting means more than the record's field, its doc; ``extra`` adds settings no record holds,
    as (type, default, doc). Each field's metadata names the record whose docstring documents it (``record``),
    or holds its ``doc``: ``megapipe COMMAND --help`` reads them (:mod:`megapipe.config.keys`).
    """
    replace, extra, nullable = dict(replace or {}), dict(extra or {}), set(nullable)
    specs = []
    for record, names in sources:
        hints = typing.get_type_hints(record)
        wanted = {f.name: f for f in dataclasses.fields(record)}
        for key in (names if names is not None else list(wanted)):
            item = wanted[key]
            kind = _schema_type(hints[key])
            metadata = {"record": record}
            if key in replace:
                kind, default, *doc = replace.pop(key)
                metadata.update({"doc": doc[0]} if doc else {})
            elif item.default is not dataclasses.MISSING:
                default = item.default
            elif item.default_factory is not dataclasses.MISSING:
                default = item.default_factory()
            else:
                default = None if nullable_required and key != "name" else MISSING
            if key in nullable or (default is None and typing.get_origin(kind) is not typing.Union):
                kind, default = (kind if typing.get_origin(kind) is typing.Union else Optional[kind]), None
            if isinstance(default, tuple):  # tuples become lists; (key, value) tables become maps
                default = ({k: (list(v) if len(v) > 1 else v[0]) for k, *v in default} if _is_table(hints[key])
                           else list(default))
            specs.append((key, kind, _field(default, metadata)))
    if replace:
        raise TypeError(f"{name}: replace names no record field: {sorted(replace)}")
    for key, (kind, default, doc) in extra.items():
        specs.append((key, kind, _field(default, {"doc": doc})))
    schema = dataclasses.make_dataclass(name, specs)
    schema.__module__ = __name__
    return schema


def _field(default, metadata: dict):
    """A schema field; a list or dict default is copied for each instance."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=metadata)
    return field(default=default, metadata=metadata)


class Objective(str, enum.Enum):
    throughput = "throughput"
    cost = "cost"


class OutputFormat(str, enum.Enum):
    table = "table"
    json = "json"


ModelConfig = record_schema(
    "ModelConfig", [(ModelSpec, None)], nullable_required=True,
    replace={"moe_layer_freq": (Any, 1, "Megatron's --moe-layer-freq: an int N (layer i is MoE when i % N == 0) "
                                        "or a 0/1 list per layer.")},
    extra={"source": (str, "", "Where the model's numbers come from (a paper, a config.json)."),
           "config_path": (Optional[str], None, "A Hugging Face config.json to read the model from (model=hf).")},
)
"""model/: ModelSpec's fields. A required field may be null when model.config_path (a Hugging Face
config.json) fills it."""

GpuConfig = record_schema("GpuConfig", [(GpuSpec, None)])
"""A GPU type: GpuSpec's fields."""

LinkConfig = record_schema("LinkConfig", [(LinkSpec, None)])
"""A network level: LinkSpec's fields."""


@dataclass
class NodeGroupConfig:
    gpu: GpuConfig = MISSING
    num_nodes: int = MISSING


@dataclass
class ClusterConfig:
    name: str = MISSING
    """The cluster's name (its hydra_conf/cluster option)."""
    num_nodes: int = MISSING
    """Nodes of a homogeneous cluster (a mixed one counts its node_groups')."""
    gpus_per_node: int = MISSING
    """GPUs in each node."""
    price_per_gpu_hour: float = MISSING
    """US dollars per GPU-hour."""
    gpu: GpuConfig = MISSING
    """The GPU of a homogeneous cluster: its datasheet figures and measured kernel efficiencies."""
    intra_node: LinkConfig = MISSING
    """The link inside a node (or NVLink domain): NVLink, xGMI."""
    inter_node: LinkConfig = MISSING
    """The link between nodes: InfiniBand, RoCE, Ethernet."""
    node_groups: List[NodeGroupConfig] = field(default_factory=list)
    """Mixed clusters: node groups in pipeline-placement order; empty for a homogeneous cluster."""
    scale_up_gpus: int = 0
    """GPUs one intra_node (NVLink) domain joins; 0 means gpus_per_node (GB200 NVL72: 72)."""
    host_cpu: str = "x86"
    """The CPU that launches the kernels: x86, or grace (GB200/GB300)."""


RuntimeConfig = record_schema("RuntimeConfig", [(RuntimeSpec, None)])
"""runtime/: RuntimeSpec's fields; its (key, value) tables are YAML maps."""

_PARALLEL_FEATURES = ("moe_token_dispatcher_type", "moe_flex_dispatcher_backend", "overlap_moe_expert_parallel_comm",
                      "delay_wgrad_compute", "moe_shared_expert_overlap")
ParallelConfig = record_schema(
    "ParallelConfig",
    [(ParallelSpec, [f.name for f in dataclasses.fields(ParallelSpec) if f.name not in ("data_parallel_size",
                                                                                         "features")]),
     (RuntimeFeatures, _PARALLEL_FEATURES)],
    nullable=("tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
              "context_parallel_size", "sequence_parallel", "expert_model_parallel_size",
              "expert_tensor_parallel_size", "moe_token_dispatcher_type", "moe_flex_dispatcher_backend",
              "overlap_moe_expert_parallel_comm", "delay_wgrad_compute"),
)
"""parallel/: ParallelSpec's sizes (data_parallel_size is what is left) and RuntimeFeatures' EP-communication
fields. A null size or feature is searched by `megapipe plan` and is Megatron's default elsewhere: TP, PP, CP, EP
1, VP none, sequence parallelism with TP > 1, ETP = TP, the alltoall dispatcher without overlap; flex's backend
alone implies moe_token_dispatcher_type=flex, and delay_wgrad_compute follows the EP overlap."""

TrainConfig = record_schema(
    "TrainConfig",
    [(TrainSpec, None), (RuntimeFeatures, [f.name for f in dataclasses.fields(RuntimeFeatures)
                                           if f.name not in _PARALLEL_FEATURES])],
    nullable=("micro_batch_size", "seq_length", "recompute_granularity", "fp8_recipe", "fp8_param_gather",
              "moe_permute_fusion", "moe_router_fusion", "cuda_graph_impl", "cuda_graph_scope", "recompute_modules"),
    replace={"global_batch_size": (int, 256)},
    extra={"num_microbatches": (Optional[int], None, "Microbatches per step; null derives them (global_batch_size / "
                                                     "(micro_batch_size x DP)); when set, plan searches only the "
                                                     "candidates that give it."),
           "total_tokens": (float, 2.0e12, "The whole training run's tokens, for its cost estimate.")},
)
"""train/: TrainSpec's fields and RuntimeFeatures' kernel and graph fields. A null micro_batch_size or
recompute_granularity is searched; a null seq_length is model.seq_length; a null fp8_recipe is mxfp8 on
Blackwell, else tensorwise; a null fp8_param_gather is on with the distributed optimizer (as Megatron-Bridge's
FP8 recipes), off for blockwise; moe_permute_fusion and moe_router_fusion null are on in `megapipe plan` (as
every Megatron-Bridge MoE recipe), Megatron's off elsewhere; cuda_graph_impl and cuda_graph_scope null are
searched for MoE plans, none elsewhere; recompute_modules null is Megatron's [core_attn]."""


@dataclass
class ScheduleConfig:
    name: Optional[str] = None
    """gpipe, 1f1b, interleaved_1f1b, zb_h1, zb_h2, zb_v, dualpipe_v, all; null is searched."""


@dataclass
class ReferenceConfig:
    """A published configuration to evaluate beside the best plan (set by an experiment, not by default)."""

    label: str = MISSING
    """How the row is labelled, e.g. the write-ups' TP4 PP8."""
    tensor_model_parallel_size: int = MISSING
    pipeline_model_parallel_size: int = MISSING
    reported_tokens_per_s_per_gpu: Optional[float] = None
    """What the source reports for it, printed beside megapipe's prediction."""
    source: str = ""


@dataclass
class SearchConfig:
    objective: Objective = Objective.throughput
    """throughput (tokens/s/GPU, highest first) or cost ($ per 1M tokens, lowest first)."""
    allow_cross_node_tp: bool = False
    """Also search TP groups wider than a node (or NVLink domain)."""
    bubble_target: Optional[List[float]] = None
    """[low, high]: pick the micro-batch size whose bubble falls in this range."""
    bubble_warning_range: Optional[List[float]] = None
    """[low, high]: warn when a plan's bubble falls outside it; null warns never."""
    ignore_memory_limit: bool = False
    """Keep plans that do not fit memory, flagged with the GiB over."""
    top_k: int = 5
    """Plans ranked in the table and plan.yaml."""
    max_pipeline_model_parallel_size: Optional[int] = None
    """Largest PP searched; null: up to one decoder layer per stage."""
    max_virtual_pipeline_model_parallel_size: Optional[int] = None
    """Most model chunks per pipeline rank searched; null: every VP Megatron allows (one decoder layer a chunk)."""
    per_stage_recompute: bool = False
    """Also search per-stage recompute (AdaPipe): each pipeline rank picks none/selective/full with the split."""
    what_if_schedules: bool = False
    """Also search schedules megatron-core cannot run (ZB-H1/H2, ZB-V, DualPipeV), ranked as what-if results:
    labelled as such, and Megatron arguments are written only for the best plan megatron-core runs."""
    drift_threshold: float = 0.1
    """Relative difference between measured and predicted figures that triggers a warning."""
    min_gain: float = 0.02
    """replan refuses to suggest a change whose predicted gain is below this fraction."""
    reference: Optional[ReferenceConfig] = None
    """A published configuration shown beside the best plan (DP is the rest, 1F1B, micro-batch 1, SP)."""
    replan_attribution: str = "stage"
    """replan: stage (split each stage's measured time in proportion to the profile) or kind (per-kind factors first)."""


@dataclass
class OutputConfig:
    format: OutputFormat = OutputFormat.table
    """table (for people) or json (one JSON object on stdout)."""
    dir: Optional[str] = None
    """Where files go; null: outputs/<command>/<date>_<time>, made only when the command writes a file."""
    pictures: bool = True
    """Draw the PNG pictures (and, for simulate, the traces); false skips them."""
    bridge_keys: str = "flat"
    """Megatron-Bridge spelling: flat (model.*, released 0.6.x) or nested (model.transformer.*, Bridge main)."""


@dataclass
class ValidateConfig:
    """`megapipe validate`: which runs, what to fit, where the table goes."""

    ids: Optional[List[str]] = None
    """Only these runs of the data set (by id); null means all."""
    leave_one_out: bool = True
    """Refit without each run in turn and predict it (about a minute per 60 runs)."""
    leave_one_source_out: bool = True
    """Refit without every run of one source (table, paper, write-up) in turn and predict those runs: the
    headline error, what a new source can expect."""
    fit: Optional[List[str]] = None
    """Runtime fields to fit on the dense runs (megapipe.validation.fit.FIT_FIELDS); null means DEFAULT_FIT."""
    fit_moe: Optional[List[str]] = None
    """Runtime fields to fit on the MoE runs, the dense fields held; null means MOE_FIT."""
    docs: Optional[str] = None
    """A Markdown file whose section between the validation markers is rewritten with the table."""


@dataclass
class JobConfig:
    """One training job of a shared cluster (`megapipe pack`)."""

    name: str = MISSING
    model: str = MISSING
    """A hydra_conf/model option (llama3_70b, mixtral_8x7b, ...)."""
    global_batch_size: int = MISSING
    seq_length: Optional[int] = None
    """null: the model's default training length."""
    precision: Optional[str] = None
    """bf16, fp8, ...; null: the command line's train.precision (bf16 by default)."""
    tokens: Optional[float] = None
    """The token budget (training tokens to process); null: none (throughput only)."""
    deadline_hours: Optional[float] = None
    """Wall-clock hours in which the token budget must be done (objective deadlines)."""
    weight: float = 1.0
    """How much a FLOP of this job counts against the others'."""
    gpu: Optional[str] = None
    """Pin the job to this GPU type (a node group's gpu.name); null: any group."""
    max_micro_batch_size: Optional[int] = None
    """Largest micro-batch the job may use; null: the search's list."""
    arrives_later: bool = False
    """Left out of the first packing; added by the what-if `pack.arrive=true`."""


@dataclass
class JobsConfig:
    """A list of jobs (hydra_conf/jobs/)."""

    name: str = ""
    """The job list's name (the hydra_conf/jobs option)."""
    description: str = ""
    """What the jobs are, in a line."""
    num_nodes: Optional[int] = None
    """Nodes of the cluster the jobs are written for: megapipe pack packs on this many unless the command line sets
    the cluster (cluster=, cluster.num_nodes=) or replaces the list (jobs.jobs=); null: the cluster's."""
    jobs: List[JobConfig] = field(default_factory=list)
    """The jobs: name, model, global_batch_size, seq_length, precision, tokens, deadline_hours, weight, gpu,
    max_micro_batch_size, arrives_later each."""


PackConfig = record_schema("PackConfig", [(PackOptions, None)])
"""pack: PackOptions' fields."""


@dataclass
class Config:
    model: ModelConfig = MISSING
    cluster: ClusterConfig = MISSING
    runtime: RuntimeConfig = MISSING
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    search: SearchConfig = field(default_factory=SearchConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    validate: ValidateConfig = field(default_factory=ValidateConfig)
    jobs: JobsConfig = field(default_factory=JobsConfig)
    pack: PackConfig = field(default_factory=PackConfig)
    profile: Optional[str] = None
    """A megapipe-profile/1 file used instead of the cost model."""
    stage_times: Optional[List[List[Any]]] = None
    """Per-stage [F, B, W] in ms for `megapipe simulate` (ints or floats; checked by the command)."""
    input: Optional[str] = None
    """The positional argument of commands that take a path (report DIR, replan RUN_DIR, calibrate RUN_DIR or
    PROFILE, validate RUNS.yaml)."""
    extra: Any = None
    """Free-form settings for commands (e.g. profile iterations); not validated."""


def register_configs() -> None:
    """Register every schema in Hydra's ConfigStore (idempotent)."""
    store = ConfigStore.instance()
    store.store(name="base_config", node=Config)
    store.store(group="model", name="base_model", node=ModelConfig)
    store.store(group="cluster", name="base_cluster", node=ClusterConfig)
    store.store(group="runtime", name="base_runtime", node=RuntimeConfig)
    store.store(group="parallel", name="base_parallel", node=ParallelConfig)
    store.store(group="train", name="base_train", node=TrainConfig)
    store.store(group="schedule", name="base_schedule", node=ScheduleConfig)
    store.store(group="search", name="base_search", node=SearchConfig)
    store.store(group="output", name="base_output", node=OutputConfig)
    store.store(group="jobs", name="base_jobs", node=JobsConfig)
