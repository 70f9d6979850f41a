"""Published measured training runs (``megapipe-runs/1``): the records, and the document's parser.

A run names its source, the cluster option it ran on (``hydra_conf/cluster``), its GPU count, the
model and parallel settings in Megatron's names, and the measured step time. Settings the source
does not state are listed in ``unknown`` and parsed as placeholders; the validation lets the
planner choose them (:mod:`megapipe.validation.predict`).
"""

from __future__ import annotations

import functools

import os
from collections.abc import Mapping
from dataclasses import dataclass

from megapipe.config.memory import memory_fields
from megapipe.config.validate import check_model, positive_int
from megapipe.cost.precision import FP8_RECIPES, PRECISIONS
from megapipe.errors import ConfigError
from megapipe.files import read_yaml
from megapipe.layout import parse_layout
from megapipe.schedules import MEGATRON_SCHEDULES
from megapipe.schedules import spec as schedule_spec
from megapipe.cost.model_state import state_problem
from megapipe.records import Activation, ModelSpec, ParallelSpec, Recompute, RuntimeFeatures, TrainSpec

__all__ = ["PublishedRun", "RUNS_FORMAT", "UNKNOWABLE", "PUBLIC_RUNS", "runs_from_document", "read_runs"]

RUNS_FORMAT = "megapipe-runs/1"
PUBLIC_RUNS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "public_runs.yaml")
"""The public measured runs shipped with megapipe (``megapipe validate``'s default data set)."""
UNKNOWABLE = ("micro_batch_size", "virtual_pipeline_model_parallel_size", "sequence_parallel",
              "recompute_granularity")
"""Settings a run may leave unstated; the planner picks them."""
_MODEL_KEYS = ("name", "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
               "vocab_size", "seq_length", "activation", "untie_embeddings_and_output_weights",
               "position_embedding_type", "kv_channels")


@dataclass(frozen=True, slots=True, kw_only=True)
class PublishedRun:
    """One measured run: what ran, on what, and how long a step took."""

    id: str
    set: str
    """The table or paper it comes from."""
    source: str
    """Where to read it (URL and place)."""
    framework: str
    cluster: str
    """The ``hydra_conf/cluster`` option of its GPU."""
    num_gpus: int
    gpus_per_node: int
    model: ModelSpec
    parallel: ParallelSpec
    train: TrainSpec
    unknown: tuple[str, ...]
    """Settings the source does not state (placeholders in parallel/train): a subset of UNKNOWABLE."""
    schedule: str = ""
    """The schedule when the source names it without the interleaving depth (``interleaved_1f1b``)."""
    step_time_s: float
    """Measured, or converted from the source's TFLOP/s with its own FLOP formula (``how``)."""
    how: str
    verified: bool = True
    assumptions: tuple[str, ...] = ()
    fit: bool = True
    """Used to fit the runtime constants; False keeps a run for validation only (its reason in assumptions)."""
    ablation: str = ""
    """The optimisation sequence the run is a step of (runs of one source that change one feature at a time, in
    file order): ``megapipe validate`` compares each step's measured and predicted gain over the previous one."""
    step_only: bool = False
    """A step measured with software its own source later fixed in ways megapipe does not model (kernel bugs,
    launch tuning): compared only with its neighbours in the sequence, not fitted or summarised alone."""
    layout: str = ""
    """The ``pipeline_model_parallel_layout`` the run states; empty: Megatron's default equal split."""

    @property
    def precision(self) -> str:
        return self.train.precision


def _get(node: Mapping, key: str, where: str):
    if key not in node:
        raise ConfigError(f"{where} lacks {key!r}; every run gives it (see megapipe/data/public_runs.yaml)")
    return node[key]


def _preset(node: Mapping, where: str) -> ModelSpec:
    """A run of a model megapipe has a preset for (the MoE runs): ``preset`` names ``hydra_conf/model``'s
    option, and any other key overrides the preset's field of that name."""
    import dataclasses

    overrides = {key: value for key, value in node.items() if key != "preset"}
    try:
        model = _preset_model(str(node["preset"]))
    except ConfigError as error:
        raise ConfigError(f"{where}.model.preset={node['preset']!r}: {error}") from None
    names = {item.name for item in dataclasses.fields(ModelSpec)}
    bad = sorted(set(overrides) - names)
    if bad:
        raise ConfigError(f"{where}.model has unknown keys {bad}; use ModelSpec's (Megatron's) names")
    model = dataclasses.replace(model, **overrides)
    check_model(model)
    return model


@functools.lru_cache(maxsize=64)
def _preset_model(name: str) -> ModelSpec:
    """``hydra_conf/model``'s preset ``name`` as a record, composed once per process (many runs share one)."""
    import copy

    from omegaconf import open_dict

    from megapipe.config import to_scenario
    from megapipe.config.build import compose_model

    cfg = copy.deepcopy(_defaults())
    with open_dict(cfg):
        cfg.model = compose_model(name)
    return to_scenario(cfg).model


@functools.lru_cache(maxsize=1)
def _defaults():
    """The default config, composed once: the rest of what a model preset is read with."""
    from megapipe.config import compose

    return compose([])


def _model(node: Mapping, where: str) -> ModelSpec:
    if "preset" in node:
        return _preset(node, where)
    unknown = sorted(set(node) - set(_MODEL_KEYS))
    if unknown:
        raise ConfigError(f"{where}.model has unknown keys {unknown}; use Megatron's names {list(_MODEL_KEYS)}")
    fields = {key: node[key] for key in _MODEL_KEYS if node.get(key) is not None}
    for key in ("name", "num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "vocab_size",
                "seq_length"):
        _get(fields, key, f"{where}.model")
    fields.setdefault("num_query_groups", fields["num_attention_heads"])
    try:
        fields["activation"] = Activation(fields.get("activation", "swiglu"))
    except ValueError:
        raise ConfigError(f"{where}.model.activation={node.get('activation')!r} is unknown; use "
                          f"{', '.join(a.value for a in Activation)}") from None
    model = ModelSpec(**fields)
    check_model(model)
    return model


_FEATURE_KEYS = {
    "moe_token_dispatcher_type": str, "moe_flex_dispatcher_backend": str, "overlap_moe_expert_parallel_comm": bool,
    "delay_wgrad_compute": bool, "moe_shared_expert_overlap": bool, "moe_permute_fusion": bool,
    "moe_router_fusion": bool, "cuda_graph_impl": str, "cuda_graph_scope": tuple, "recompute_modules": tuple,
    "moe_router_force_load_balancing": bool, "moe_router_padding_for_quantization": bool,
    "fine_grained_activation_offloading": bool, "offload_modules": tuple,
}
"""Runtime features a run may state, in megatron-core's names, under ``parallel``, ``train`` or ``features``."""


def _features(parallel: Mapping, train: Mapping, where: str, extra: Mapping | None = None) -> RuntimeFeatures:
    """The features the run states (Megatron's defaults for the rest)."""
    values = {}
    for block in (parallel, train, extra or {}):
        for key, kind in _FEATURE_KEYS.items():
            value = block.get(key)
            if value is None:
                continue
            if kind is tuple:
                value = (value,) if isinstance(value, str) else tuple(str(item) for item in value)
            elif kind is bool and not isinstance(value, bool):
                raise ConfigError(f"{where}: {key}={value!r} must be true or false")
            values[key] = kind(value) if kind is not tuple else value
    if values.get("cuda_graph_scope") and "cuda_graph_impl" not in values:
        values["cuda_graph_impl"] = "transformer_engine"
    if "delay_wgrad_compute" not in values and values.get("overlap_moe_expert_parallel_comm"):
        values["delay_wgrad_compute"] = False
    return RuntimeFeatures(**values)


def _unknown_settings(node: Mapping, where: str) -> tuple[str, ...]:
    """The settings the run lists as unstated, checked to be a subset of UNKNOWABLE."""
    unknown = tuple(node.get("unknown") or ())
    bad = [name for name in unknown if name not in UNKNOWABLE]
    if bad:
        raise ConfigError(f"{where}.unknown holds {bad}; only {list(UNKNOWABLE)} may be unstated")
    return unknown


def _parallel_sizes(node: Mapping, parallel: Mapping, where: str) -> tuple[int, int, int, int]:
    """(num_gpus, TP, PP, CP) of the run, checked that TP*PP*CP divides the GPUs."""
    num_gpus = positive_int(f"{where}.num_gpus", _get(node, "num_gpus", where))
    tp, pp, cp = (positive_int(f"{where}.parallel.{key}", _get(parallel, key, f"{where}.parallel"))
                  for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"))
    if num_gpus % (tp * pp * cp):
        raise ConfigError(f"{where}: num_gpus={num_gpus} is not divisible by TP*PP*CP={tp * pp * cp}; fix the run")
    return num_gpus, tp, pp, cp


def _precision(train: Mapping, where: str) -> tuple[str, str]:
    """(precision, fp8_recipe) of the run, checked against the known precisions and FP8 recipes."""
    precision = str(_get(train, "precision", f"{where}.train"))
    if precision not in PRECISIONS:
        raise ConfigError(f"{where}.train.precision={precision!r}; use one of {', '.join(PRECISIONS)}")
    recipe = train.get("fp8_recipe") or ""
    if precision == "fp8" and recipe not in FP8_RECIPES:
        raise ConfigError(f"{where}.train.fp8_recipe={recipe!r}; an fp8 run names one of {', '.join(FP8_RECIPES)}")
    return precision, recipe


def _schedule(parallel: Mapping, vp: object, where: str) -> str | None:
    """The megatron-core schedule the run names (None when unstated), checked against its interleaving depth."""
    schedule = parallel.get("schedule")
    if schedule is not None and schedule not in MEGATRON_SCHEDULES:
        raise ConfigError(f"{where}.parallel.schedule={schedule!r}; a run states one of megatron-core's schedules "
                          f"({', '.join(MEGATRON_SCHEDULES)}) or nothing")
    if schedule is not None and schedule_spec(schedule).fixed_chunks is None and vp is not None and int(vp) < 2:
        raise ConfigError(f"{where}: schedule=interleaved_1f1b with virtual_pipeline_model_parallel_size={vp}; "
                          "interleaving needs 2 or more")
    return schedule


def _parallel_spec(parallel: Mapping, train: Mapping, where: str, *, num_gpus: int, tp: int, pp: int, cp: int,
                   vp: object, sp: object) -> ParallelSpec:
    """The run's ParallelSpec: its stated sizes and overlaps, Megatron's defaults (or placeholders) for the rest."""
    return ParallelSpec(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp,
        virtual_pipeline_model_parallel_size=int(vp or 1), data_parallel_size=num_gpus // (tp * pp * cp),
        sequence_parallel=bool(tp > 1 if sp is None else sp and tp > 1),
        tp_comm_overlap=bool(parallel.get("tp_comm_overlap") or False) and tp > 1,
        use_distributed_optimizer=bool(parallel.get("use_distributed_optimizer", True)),
        overlap_grad_reduce=bool(parallel.get("overlap_grad_reduce", True)),
        overlap_param_gather=bool(parallel.get("overlap_param_gather", True)),
        expert_model_parallel_size=int(parallel.get("expert_model_parallel_size") or 1),
        expert_tensor_parallel_size=int(parallel.get("expert_tensor_parallel_size") or 0),
        features=_features(parallel, train, where),
        **memory_fields(parallel, ParallelSpec, where=f"{where}.parallel"),
    )


def _train_spec(train: Mapping, model: ModelSpec, where: str, *, precision: str, recipe: str) -> TrainSpec:
    """The run's TrainSpec: its stated batch, sequence and recompute (placeholders where unstated)."""
    recompute = train.get("recompute_granularity")
    return TrainSpec(
        micro_batch_size=int(train.get("micro_batch_size") or 1),
        global_batch_size=positive_int(f"{where}.train.global_batch_size", _get(train, "global_batch_size", where)),
        seq_length=positive_int(f"{where}.train.seq_length", train.get("seq_length") or model.seq_length),
        recompute_granularity=Recompute(recompute or "none"), precision=precision, fp8_recipe=recipe,
        fp8_param_gather=bool(train.get("fp8_param_gather") or False),
        grad_reduce_in_fp32=bool(train.get("grad_reduce_in_fp32", True)),
        moe_load_imbalance=None if train.get("moe_load_imbalance") is None else float(train["moe_load_imbalance"]),
        **memory_fields(train, TrainSpec, where=f"{where}.train"),
    )


def _check_stated(stated: Mapping, unknown: tuple[str, ...], where: str, *, tp: int, pp: int) -> None:
    """ConfigError when an UNKNOWABLE setting is null without being listed in ``unknown`` (and it matters)."""
    missing = [name for name, value in stated.items() if value is None and name not in unknown
               and not (name == "sequence_parallel" and tp == 1)
               and not (name == "virtual_pipeline_model_parallel_size" and pp == 1)]
    if missing:
        raise ConfigError(f"{where}: {missing} are null but not listed in unknown; state them or list them")


def _layout(parallel: Mapping, where: str, *, pp: int, vp: object) -> tuple[str, object]:
    """(the stated layout, the interleaving depth it implies or the stated one); ConfigError when they disagree."""
    layout = str(parallel.get("pipeline_model_parallel_layout") or "")
    if not layout:
        return "", vp
    stages = len(parse_layout(layout))
    if stages % pp or (vp is not None and stages != pp * int(vp)):
        raise ConfigError(f"{where}: pipeline_model_parallel_layout {layout!r} has {stages} stages, not "
                          f"PP x VP = {pp} x {vp}; fix one of them")
    return layout, stages // pp


def _step_time(measured: Mapping, where: str) -> int | float:
    """The run's measured step time in seconds as stated, checked to be a number > 0."""
    step = measured.get("step_time_s")
    if not (isinstance(step, (int, float)) and step > 0):
        raise ConfigError(f"{where}.measured.step_time_s={step!r} must be a number > 0")
    return step


def _run(node: Mapping, index: int) -> PublishedRun:
    """One run of the document (``runs[index]``); ConfigError naming the run and field on bad input."""
    where = f"runs[{index}] ({node.get('id', '?')})"
    parallel, train, measured = (_get(node, key, where) for key in ("parallel", "train", "measured"))
    model = _model(_get(node, "model", where), where)
    unknown = _unknown_settings(node, where)
    num_gpus, tp, pp, cp = _parallel_sizes(node, parallel, where)
    layout, vp = _layout(parallel, where, pp=pp, vp=parallel.get("virtual_pipeline_model_parallel_size"))
    sp = parallel.get("sequence_parallel")
    precision, recipe = _precision(train, where)
    schedule = _schedule(parallel, vp, where)
    spec = _parallel_spec(parallel, train, where, num_gpus=num_gpus, tp=tp, pp=pp, cp=cp, vp=vp, sp=sp)
    train_spec = _train_spec(train, model, where, precision=precision, recipe=recipe)
    stated = {"micro_batch_size": train.get("micro_batch_size"), "virtual_pipeline_model_parallel_size": vp,
              "sequence_parallel": sp, "recompute_granularity": train.get("recompute_granularity")}
    _check_stated(stated, unknown, where, tp=tp, pp=pp)
    problem = state_problem(spec, train_spec)
    if problem:
        raise ConfigError(f"{where}: {problem}")
    step = _step_time(measured, where)
    source = node.get("source") or {}
    return PublishedRun(
        id=str(_get(node, "id", where)), set=str(node.get("set", "")),
        source=" ".join(str(source.get(key, "")) for key in ("url", "where") if source.get(key)),
        framework=str(node.get("framework", "")), cluster=str(_get(node, "cluster", where)), num_gpus=num_gpus,
        gpus_per_node=positive_int(f"{where}.gpus_per_node", node.get("gpus_per_node", 8)),
        model=model, parallel=spec, train=train_spec, unknown=unknown, step_time_s=float(step),
        schedule=str(schedule or ""),
        how=str(measured.get("how", "")), verified=bool(node.get("verified", True)),
        assumptions=tuple(str(item) for item in node.get("assumptions") or ()),
        fit=bool(node.get("fit", True)) and not bool(node.get("step_only", False)),
        ablation=str(node.get("ablation") or ""), step_only=bool(node.get("step_only", False)), layout=layout,
    )


def runs_from_document(document: object, *, source: str = "runs") -> tuple[PublishedRun, ...]:
    """The runs of a ``megapipe-runs/1`` document; ConfigError naming the run and field on bad input."""
    if not isinstance(document, Mapping) or document.get("format") != RUNS_FORMAT:
        raise ConfigError(f"{source} is not a {RUNS_FORMAT} document (its 'format' key); see "
                          "megapipe/data/public_runs.yaml for the layout")
    runs = document.get("runs")
    if not isinstance(runs, list) or not runs:
        raise ConfigError(f"{source} holds no runs; give a non-empty 'runs' list")
    parsed = tuple(_run(node if isinstance(node, Mapping) else {}, index) for index, node in enumerate(runs))
    ids = [run.id for run in parsed]
    duplicates = sorted({run_id for run_id in ids if ids.count(run_id) > 1})
    if duplicates:
        raise ConfigError(f"{source}: run ids {duplicates} appear more than once; make them unique")
    return parsed


def read_runs(path: str | os.PathLike = PUBLIC_RUNS):
    """The measured runs of a ``megapipe-runs/1`` file (:mod:`megapipe.validation.runs`)."""
    path = str(path)
    document = read_yaml(path, ConfigError, "runs",
                          "give a megapipe-runs/1 file (megapipe/data/public_runs.yaml shows the layout)")
    return runs_from_document(document, source=path)
