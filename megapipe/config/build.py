"""The one function from a composed Hydra config to the job's records.

``to_scenario(cfg)`` validates across groups and returns a frozen :class:`Scenario`: the model,
cluster, parallel and train records, the schedule, the micro-batches and the search dimensions
the user fixed. It checks the option groups too (``search.*``, ``output.*``, ``extra``), so a bad
option fails every command alike; each command builds the option records it reads itself
(:mod:`megapipe.config.options`) and its raw inputs (:func:`stage_times_of`, :func:`extra_of`,
``cfg.get("profile")``, ``cfg.get("input")``) into its own input record. Parallel and train
fields left null are search dimensions for ``megapipe plan`` (``to_scenario(cfg, search=True)``
leaves them free and validates only what was given); every other command fills them with the
write-ups' 70B setting (TP=4, PP=8, VP=1, CP=1, sequence parallel when TP>1, micro-batch 1, no
recompute, 1F1B), with TP and PP capped to the largest divisors of the node and cluster sizes,
or with ``fill`` (e.g. the sizes a monitored run used).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
import dataclasses
from dataclasses import dataclass
from importlib import resources

from omegaconf import DictConfig, ListConfig, OmegaConf

from megapipe.config.cache import composed
from megapipe.config.hf import read_hf_config
from megapipe.config.memory import memory_fields
from megapipe.config.options import output_options, replan_options, search_options
from megapipe.config.schema import ModelConfig, register_configs
from megapipe.cost.precision import PRECISIONS, check_precision, default_fp8_recipe
from megapipe.config.validate import (
    MAX_GPUS,
    MAX_LAYERS,
    MAX_SIZE,
    MAX_SEQ_LENGTH,
    check_bounds,
    check_cluster,
    check_gpu,
    check_known_keys,
    check_model,
    positive_int,
)
from megapipe.errors import ConfigError
from megapipe.cost.model_state import state_problem
from megapipe.features import feature_problem
from megapipe.records import (
    SEARCH_DIMENSIONS,
    Activation,
    AttentionBackend,
    ClusterSpec,
    GpuSpec,
    LinkSpec,
    ModelSpec,
    NodeGroup,
    ParallelSpec,
    Recompute,
    RuntimeFeatures,
    RuntimeSpec,
    TrainSpec,
)
from megapipe.schedules import SCHEDULE_NAMES, ScheduleName, spec

__all__ = ["Scenario", "conf_dir", "compose", "to_scenario", "DEFAULT_FILL", "extra_of", "recorded_inputs",
           "runtime_file", "runtime_of", "stage_times_of", "with_runtime_file"]

DEFAULT_FILL = {
    "tensor_model_parallel_size": 4,
    "pipeline_model_parallel_size": 8,
    "virtual_pipeline_model_parallel_size": 1,
    "context_parallel_size": 1,
    "micro_batch_size": 1,
    "recompute_granularity": "none",
    "schedule": ScheduleName.one_f_one_b,
}
"""What a null search dimension means outside ``megapipe plan``."""

_SEARCH_PLACEHOLDER = {
    "tensor_model_parallel_size": 1,
    "pipeline_model_parallel_size": 1,
    "virtual_pipeline_model_parallel_size": 1,
    "context_parallel_size": 1,
    "sequence_parallel": False,
    "micro_batch_size": 1,
    "recompute_granularity": "none",
    "schedule": ScheduleName.one_f_one_b,
    "expert_model_parallel_size": 1,
    "expert_tensor_parallel_size": 1,
}
"""What stands in for a searched dimension while the given ones are validated (never planned with)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Scenario:
    """The job: what is trained on which cluster, how it is split, validated once."""

    model: ModelSpec
    cluster: ClusterSpec
    parallel: ParallelSpec
    train: TrainSpec
    schedule: str
    """A schedule name, or ``all`` (``megapipe simulate``)."""
    seq_length_source: str
    """Where train.seq_length came from, for the console: the command line or the model's default."""
    num_microbatches: int
    fixed: Mapping[str, object]
    """Search dimensions the user set, with their values (the rest were filled or are searched)."""


def conf_dir() -> str:
    """Absolute path of the shipped ``hydra_conf`` (package data ``megapipe.hydra_conf``).

    In a source checkout that is not installed, the repository's ``hydra_conf/`` is used.
    """
    checkout = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "hydra_conf")
    try:
        return str(resources.files("megapipe.hydra_conf"))
    except ModuleNotFoundError:
        return checkout


_RUNTIME_OPTION = "megatron_core"
"""The runtime group's option a ``runtime=FILE`` override stands on before the file replaces it."""


def runtime_file(overrides: list[str] | tuple[str, ...]) -> tuple[list[str], str | None]:
    """``runtime=FILE`` (a runtime.yaml that ``megapipe validate`` or ``megapipe calibrate`` wrote, or any file of
    ``hydra_conf/runtime``'s form): the overrides with the group's default option in its place, and the file."""
    kept, path = [], None
    for override in overrides:
        key, sep, value = override.partition("=")
        if sep and key.lstrip("+~") == "runtime" and (value.endswith((".yaml", ".yml")) or os.sep in value):
            if "," in value:
                raise ConfigError(f"runtime={value!r}: a runtime file cannot be swept; run one file at a time")
            path = os.path.abspath(os.path.expanduser(value))
            if not os.path.isfile(path):
                raise ConfigError(f"runtime={value!r} is not a file; pass a runtime.yaml that megapipe validate "
                                  f"or megapipe calibrate wrote, or an option of hydra_conf/runtime ({_RUNTIME_OPTION})")
            kept.append(f"runtime={_RUNTIME_OPTION}")
        else:
            kept.append(override)
    return kept, path


def with_runtime_file(cfg: DictConfig, path: str | None) -> DictConfig:
    """``cfg`` with its runtime node replaced by the file's (checked against the runtime schema)."""
    if path is None:
        return cfg
    from megapipe.config.schema import RuntimeConfig

    try:
        loaded = OmegaConf.load(path)
        loaded.pop("defaults", None)
        node = OmegaConf.merge(OmegaConf.structured(RuntimeConfig), loaded)
    except Exception as exc:  # omegaconf/yaml errors: unknown key, wrong type, not YAML
        first = " ".join(str(exc).split("\n")[0].split())
        raise ConfigError(f"runtime file {path!r} is not a runtime: {first}; pass a runtime.yaml that megapipe "
                          "validate or megapipe calibrate wrote") from None
    cfg.runtime = node
    return cfg


def compose(overrides: list[str] | tuple[str, ...] = (), *, config_name: str = "config",
            return_hydra_config: bool = False) -> DictConfig:
    """Compose the config as the CLI does; ``return_hydra_config`` keeps the ``hydra`` node (run dir, job name).
    ``runtime=FILE`` takes the runtime from that file (:func:`runtime_file`). A composition is kept between
    processes (:mod:`megapipe.config.cache`)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    overrides, path = runtime_file(overrides)
    directory = conf_dir()

    def fresh(chosen: list[str], keep_hydra: bool) -> DictConfig:
        register_configs()
        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=directory, version_base=None):
            return hydra_compose(config_name=config_name, overrides=chosen, return_hydra_config=keep_hydra)

    cfg = composed(overrides, config_name=config_name, return_hydra_config=return_hydra_config, conf_dir=directory,
                   compose=fresh)
    return with_runtime_file(cfg, path)


def compose_model(name: str) -> DictConfig:
    """The model group of preset ``name`` (``hydra_conf/model``), composed alone (``hydra_conf/model_only.yaml``):
    what a job list or a published run reads of a preset, a quarter of composing the whole config."""
    return compose([f"model={name}"], config_name="model_only").model


_NO_DEFAULT = object()
_MODEL_DEFAULTS = {item.name: item.default if item.default is not dataclasses.MISSING else item.default_factory()
                   for item in dataclasses.fields(ModelConfig)
                   if item.default is not dataclasses.MISSING or item.default_factory is not dataclasses.MISSING}
"""ModelConfig's defaults: a Hugging Face config.json overrides exactly these."""


def _model_spec(node: DictConfig, *, train_seq_length) -> tuple[ModelSpec, str]:
    """The model record, and where the training sequence length comes from (train.seq_length or its default)."""
    fields = {key: node[key] for key in node if key not in ("config_path", "source")}
    path = node.get("config_path")
    if not path and node.get("name") == "hf":
        raise ConfigError("model=hf needs model.config_path=/path/to/config.json (a local Hugging Face config)")
    if path:
        from_file = read_hf_config(os.path.expanduser(str(path)))
        # the file fills every field left at its schema default (null, or 0 experts, ...); others win
        explicit = {key: value for key, value in fields.items()
                    if key != "name" and value is not None and value != _MODEL_DEFAULTS.get(key, _NO_DEFAULT)}
        fields = {**fields, **from_file, **explicit}
        if fields.get("name") in (None, "hf"):
            fields["name"] = from_file.get("name", "hf")
    if train_seq_length is not None:
        source = "train.seq_length"
    elif fields.get("seq_length") is not None:
        source = f"model {fields.get('name')}'s default seq_length"
    else:
        longest = fields.get("max_position_embeddings")
        raise ConfigError(
            f"model={fields.get('name')!r} gives no training sequence length"
            + (f" (config.json's max_position_embeddings={longest} is the longest context it supports, not what "
               "to train with)" if longest else "") + "; set train.seq_length=4096 (or the length you train with)")
    if fields.get("seq_length") is None:
        fields["seq_length"] = train_seq_length
    required = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "vocab_size", "seq_length")
    missing = [key for key in required if fields.get(key) is None]
    if missing:
        raise ConfigError(f"model={fields.get('name')!r} lacks {', '.join('model.' + k for k in missing)}; set them")
    if fields.get("num_query_groups") is None or fields.get("multi_latent_attention"):
        fields["num_query_groups"] = fields["num_attention_heads"]  # MLA has no query groups
    freq = fields.pop("moe_layer_freq", 1)
    if isinstance(freq, ListConfig):
        freq = OmegaConf.to_container(freq)
    if fields.get("num_moe_experts"):
        positive_int("model.num_layers", fields["num_layers"], upper=MAX_LAYERS)
        fields["moe_layer_freq"] = _moe_layer_pattern(freq, int(fields["num_layers"]), fields.get("name"))
    spec = ModelSpec(
        **{**fields, "activation": Activation(_enum_value(fields["activation"])),
           "attention_backend": AttentionBackend(_enum_value(fields["attention_backend"]))}
    )
    check_model(spec)
    return spec, source


def _enum_value(value) -> str:
    return value.value if hasattr(value, "value") else str(value)


def _gpu_spec(node: DictConfig, where: str) -> GpuSpec:
    spec = GpuSpec(**OmegaConf.to_container(node, resolve=True))
    check_gpu(spec, where)
    return spec


def runtime_of(cfg: DictConfig) -> RuntimeSpec:
    """The config's runtime record (``runtime=``), on its own."""
    return _runtime_spec(cfg.get("runtime"))


def _runtime_spec(node: DictConfig | None) -> RuntimeSpec:
    if node is None:
        return RuntimeSpec()
    values = OmegaConf.to_container(node, resolve=True)
    intervals = values.pop("step_time_intervals", None) or {}
    bad = [key for key, pair in intervals.items() if not (isinstance(pair, list) and len(pair) == 2
                                                         and all(isinstance(v, (int, float)) for v in pair))]
    if bad:
        raise ConfigError(f"runtime.step_time_intervals{bad} must each be [low, high]; rerun megapipe validate")
    tables = {name: values.pop(name, None) or {} for name in ("gemm_efficiency_by_architecture",
                                                              "attention_efficiency_by_architecture",
                                                              "host_kernel_us_by_cpu")}
    scales = {f"{name}.{k}": v for name, table in tables.items() for k, v in table.items()}
    for key, value in {**values, **scales}.items():
        if key != "name" and not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
            raise ConfigError(f"runtime.{key}={value!r} must be a finite number >= 0")
    for key, value in {**scales, **{key: values[key] for key in (
            "gemm_efficiency_scale", "attention_efficiency_scale", "comm_efficiency_scale")}}.items():
        if value <= 0:
            raise ConfigError(f"runtime.{key}={value!r} must be > 0 (1 = the microbenchmarks' efficiency)")
    return RuntimeSpec(**values, **{name: tuple(table.items()) for name, table in tables.items()},
                       step_time_intervals=tuple((key, pair[0], pair[1]) for key, pair in intervals.items()))


def _cluster_spec(node: DictConfig, runtime: RuntimeSpec = RuntimeSpec()) -> ClusterSpec:
    links = {key: LinkSpec(**OmegaConf.to_container(node[key], resolve=True)) for key in ("intra_node", "inter_node")}
    positive_int("cluster.num_nodes", node.num_nodes, upper=MAX_GPUS)
    if node.node_groups:
        groups = tuple(NodeGroup(gpu=_gpu_spec(g.gpu, f"cluster.node_groups[{i}].gpu"),
                                 num_nodes=positive_int(f"cluster.node_groups[{i}].num_nodes", g.num_nodes))
                       for i, g in enumerate(node.node_groups))
        if sum(g.num_nodes for g in groups) != node.num_nodes:
            raise ConfigError(
                f"cluster {node.name!r}: node_groups hold {sum(g.num_nodes for g in groups)} nodes but "
                f"num_nodes={node.num_nodes}; make them agree"
            )
    else:
        groups = (NodeGroup(gpu=_gpu_spec(node.gpu, "cluster.gpu"), num_nodes=int(node.num_nodes)),)
    gpus_per_node = positive_int("cluster.gpus_per_node", node.gpus_per_node)
    scale_up = int(node.get("scale_up_gpus") or 0)
    if scale_up and scale_up % gpus_per_node:
        raise ConfigError(f"cluster.scale_up_gpus={scale_up} must be a multiple of gpus_per_node={gpus_per_node} "
                          "(an NVLink domain joins whole nodes); fix one of them or set it to 0")
    cluster = ClusterSpec(
        name=str(node.name), gpus_per_node=gpus_per_node,
        price_per_gpu_hour=float(node.price_per_gpu_hour),
        intra_node=links["intra_node"], inter_node=links["inter_node"], node_groups=groups,
        scale_up_gpus=scale_up, runtime=runtime, host_cpu=str(node.get("host_cpu") or "x86"),
    )
    check_cluster(cluster)
    return cluster


def _precision(value) -> str:
    name = str(getattr(value, "value", value))
    if name not in PRECISIONS:
        raise ConfigError(f"train.precision={name!r} is not supported; use one of {', '.join(PRECISIONS)}")
    return name


def _fp8_fields(cfg: DictConfig, precision: str, cluster: ClusterSpec, parallel: ParallelSpec) -> dict:
    """train.fp8_recipe (per GPU when null) and fp8_param_gather (with the distributed optimizer when null);
    both are checked against every GPU type afterwards."""
    recipe = cfg.train.get("fp8_recipe")
    gather = cfg.train.get("fp8_param_gather")
    if precision == "fp8" and recipe is None:
        recipes = {default_fp8_recipe(group.gpu) for group in cluster.node_groups}
        recipe = "tensorwise" if len(recipes) > 1 else recipes.pop()  # a mixed cluster needs one recipe for all
    if gather is None:
        gather = precision == "fp8" and parallel.use_distributed_optimizer and recipe != "blockwise"
    elif gather and precision == "fp8" and not parallel.use_distributed_optimizer:
        raise ConfigError("train.fp8_param_gather=true needs parallel.use_distributed_optimizer=true "
                          "(Megatron-LM asserts it); set one of them")
    return {"fp8_recipe": "" if recipe is None else str(recipe), "fp8_param_gather": bool(gather)}


def _imbalance(value, runtime: RuntimeSpec) -> float:
    """The stated routing assumption, or the runtime's dropless default when null."""
    if value is None:
        return runtime.moe_dropless_imbalance
    if not (isinstance(value, (int, float)) and math.isfinite(value) and 1.0 <= value <= 64.0):
        raise ConfigError(f"train.moe_load_imbalance={value!r} must lie in [1, 64] (the busiest expert-parallel rank's "
                          "tokens over the mean; 1 = balanced)")
    return float(value)


def _moe_layer_pattern(freq, num_layers: int, name) -> tuple[int, ...]:
    """Megatron's ``--moe-layer-freq``: an int N puts MoE on layer i when i % N == 0 (so N=2 means even layers,
    unlike Hugging Face's interleave step), a list gives 0/1 per layer."""
    if isinstance(freq, bool) or freq is None:
        raise ConfigError(f"model.moe_layer_freq={freq!r} must be an int N or a 0/1 list of num_layers entries")
    if isinstance(freq, int):
        if not 1 <= freq <= num_layers:
            raise ConfigError(f"model.moe_layer_freq={freq} must lie in [1, num_layers={num_layers}]; "
                              "or give a 0/1 list per layer")
        return tuple(1 if i % freq == 0 else 0 for i in range(num_layers))
    values = list(freq)
    if len(values) != num_layers or any(v not in (0, 1) or isinstance(v, bool) for v in values):
        raise ConfigError(f"model {name!r}: model.moe_layer_freq must list num_layers={num_layers} entries of 0 "
                          f"(dense) or 1 (MoE); it has {len(values)}")
    return tuple(values)


def _check_run_size(cfg: DictConfig) -> None:
    if cfg.train.num_microbatches is not None:
        positive_int("train.num_microbatches", cfg.train.num_microbatches, upper=1 << 20)
    tokens = cfg.train.get("total_tokens")
    if tokens is not None and not (isinstance(tokens, (int, float)) and math.isfinite(tokens) and tokens > 0):
        raise ConfigError(f"train.total_tokens={tokens!r} must be a finite number > 0")


def _largest_divisor(n: int, limit: int) -> int:
    return max(d for d in range(1, min(n, limit) + 1) if n % d == 0)


def _given(cfg: DictConfig) -> dict[str, object]:
    """The search dimensions the config sets (not null), by name."""
    values = {key: cfg.parallel.get(key) for key in SEARCH_DIMENSIONS if key in cfg.parallel}
    values["micro_batch_size"] = cfg.train.micro_batch_size
    values["recompute_granularity"] = cfg.train.recompute_granularity
    name = cfg.schedule.name
    if name is not None and name != "all" and name not in SCHEDULE_NAMES:
        raise ConfigError(f"schedule={name!r} is unknown; use one of {', '.join(SCHEDULE_NAMES)} or all")
    values["schedule"] = None if name is None else ("all" if name == "all" else spec(name).name)
    return {key: value for key, value in values.items() if value is not None}


def _fill(given: Mapping[str, object], cluster: ClusterSpec, fill: Mapping[str, object] | None) -> dict:
    """Every search dimension: the given value, else ``fill``'s, else the write-ups' default."""
    values = {**(fill or {}), **given}
    # The write-ups' TP=4, PP=8, capped to what the cluster can hold (TP inside a node).
    if values.get("tensor_model_parallel_size") is None:
        values["tensor_model_parallel_size"] = _largest_divisor(
            cluster.gpus_per_node, DEFAULT_FILL["tensor_model_parallel_size"])
    if values.get("pipeline_model_parallel_size") is None:
        rest = cluster.num_gpus // int(values["tensor_model_parallel_size"]) or 1
        values["pipeline_model_parallel_size"] = _largest_divisor(rest, DEFAULT_FILL["pipeline_model_parallel_size"])
    for key, value in DEFAULT_FILL.items():
        if values.get(key) is None:
            values[key] = value
    if values.get("sequence_parallel") is None:
        values["sequence_parallel"] = values["tensor_model_parallel_size"] > 1
    return values


def _flag(node: DictConfig, key: str) -> bool | None:
    value = node.get(key)
    if value is None or isinstance(value, bool):
        return value
    raise ConfigError(f"{key}={value!r} must be true, false or null")


def _names(node: DictConfig, key: str) -> tuple[str, ...] | None:
    value = node.get(key)
    if value is None:
        return None
    if isinstance(value, str):
        return (value,)
    if isinstance(value, ListConfig):
        return tuple(str(item) for item in value)
    raise ConfigError(f"{key}={value!r} must be a list such as [attn,moe_router]")


def _pinned_sizes(given: Mapping[str, object], parallel: ParallelSpec) -> ParallelSpec:
    """The sizes a search keeps, the free ones at values no feature rule objects to (PP 1, VP 2, TP and EP 2), so
    the features' size rules fail here only for what the user pinned."""
    pp = int(given.get("pipeline_model_parallel_size") or 1)
    free_vp = 2 if pp > 1 else 1
    return dataclasses.replace(
        parallel, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=int(given.get("virtual_pipeline_model_parallel_size") or free_vp),
        tensor_model_parallel_size=int(given.get("tensor_model_parallel_size") or 2),
        expert_model_parallel_size=int(given.get("expert_model_parallel_size") or 2))


def _features(cfg: DictConfig, model: ModelSpec, *, search: bool) -> tuple[RuntimeFeatures, dict[str, object]]:
    """The runtime features, and the searched ones the config pins (by :data:`megapipe.features.SEARCHED` name).

    Null means Megatron's default, except in ``megapipe plan`` for a MoE model: the searched ones are left to
    the search, and the fusions are on (as every Megatron-Bridge MoE recipe sets them)."""
    par, train = cfg.parallel, cfg.train
    dispatcher, backend = par.get("moe_token_dispatcher_type"), par.get("moe_flex_dispatcher_backend")
    if backend is not None and dispatcher is None:
        dispatcher = "flex"
    overlap = _flag(par, "overlap_moe_expert_parallel_comm")
    delay = _flag(par, "delay_wgrad_compute")
    impl, scope = train.get("cuda_graph_impl"), _names(train, "cuda_graph_scope")
    if scope is not None and impl is None:
        impl = "transformer_engine"
    fused = search and model.is_moe
    permute, router = _flag(train, "moe_permute_fusion"), _flag(train, "moe_router_fusion")
    modules = _names(train, "recompute_modules")
    features = RuntimeFeatures(
        moe_token_dispatcher_type=str(dispatcher or "alltoall"), moe_flex_dispatcher_backend=str(backend or "deepep"),
        overlap_moe_expert_parallel_comm=bool(overlap), delay_wgrad_compute=bool(overlap if delay is None else delay),
        moe_shared_expert_overlap=bool(_flag(par, "moe_shared_expert_overlap")),
        moe_permute_fusion=fused if permute is None else permute, moe_router_fusion=fused if router is None else router,
        cuda_graph_impl=str(impl or "none"), cuda_graph_scope=scope or (),
        recompute_modules=("core_attn",) if modules is None else modules,
        moe_router_force_load_balancing=bool(_flag(train, "moe_router_force_load_balancing")),
        moe_router_padding_for_quantization=bool(_flag(train, "moe_router_padding_for_quantization")),
        fine_grained_activation_offloading=bool(_flag(train, "fine_grained_activation_offloading")),
        offload_modules=_names(train, "offload_modules") or (),
    )
    pinned = {}
    if dispatcher is not None:
        pinned["moe_token_dispatcher_type"] = features.dispatcher
    if overlap is not None:
        pinned["overlap_moe_expert_parallel_comm"] = features.overlap_moe_expert_parallel_comm
    if impl is not None:
        pinned["cuda_graph_scope"] = (features.cuda_graph_impl, features.cuda_graph_scope)
    return features, pinned


def _expert_sizes(model: ModelSpec, values: Mapping, *, tp: int, stage: int, cluster: ClusterSpec,
                  search: bool) -> tuple[int, int]:
    """(EP, ETP): the given sizes, else Megatron's ETP = TP and the largest EP that divides the experts and
    folds into the stage's TP x CP x DP GPUs inside one NVLink domain (1 for dense models)."""
    ep, etp = values.get("expert_model_parallel_size"), values.get("expert_tensor_parallel_size")
    if not model.is_moe:
        if ep not in (None, 1) or etp not in (None, 0, 1, tp):
            raise ConfigError(f"parallel.expert_model_parallel_size={ep} / expert_tensor_parallel_size={etp} need a "
                              "mixture-of-experts model (model.num_moe_experts > 0); leave them null")
        return 1, 0
    etp = tp if etp is None else positive_int("parallel.expert_tensor_parallel_size", etp, upper=cluster.num_gpus)
    if ep is None:
        if search:
            return 1, etp
        fits = [d for d in range(1, model.num_moe_experts + 1)
                if model.num_moe_experts % d == 0 and stage % (d * etp) == 0 and d * etp <= cluster.domain_gpus]
        ep = max(fits, default=1)
    ep = positive_int("parallel.expert_model_parallel_size", ep, upper=cluster.num_gpus)
    if model.num_moe_experts % ep:
        divisors = [d for d in range(1, model.num_moe_experts + 1) if model.num_moe_experts % d == 0]
        raise ConfigError(f"parallel.expert_model_parallel_size={ep} does not divide model.num_moe_experts="
                          f"{model.num_moe_experts} (Megatron gives each EP rank the same number of experts); "
                          f"use one of {divisors}")
    return ep, etp


def to_scenario(cfg: DictConfig, *, search: bool = False, fill: Mapping[str, object] | None = None) -> Scenario:
    """Validate the composed config and turn the job it describes into records.

    ``search=True`` (``megapipe plan``): searched dimensions stay free; stand-ins let the given
    ones be validated, and ``Scenario.fixed`` holds what the search must keep. Otherwise null
    dimensions are filled from ``fill``, then from :data:`DEFAULT_FILL`. The option groups
    (search, replan, output, extra) are checked last, as for every command; their records are
    built by the commands that read them.
    """
    check_known_keys(cfg)
    model, seq_source = _model_spec(cfg.model, train_seq_length=cfg.train.seq_length)
    cluster = _cluster_spec(cfg.cluster, _runtime_spec(cfg.get("runtime")))
    given, values = _dimension_values(cfg, cluster, search=search, fill=fill)
    parallel, pinned = _parallel_spec(cfg, model, cluster, values, search=search)
    train = _train_spec(cfg, model, cluster, values, parallel)
    _check_run_size(cfg)
    problem = feature_problem(parallel.features, model=model, parallel=_pinned_sizes(given, parallel) if search else parallel,
                              train=train) or state_problem(parallel, train)
    if problem:
        raise ConfigError(problem)
    given.update(pinned)
    if "recompute_granularity" in given:
        given["recompute_granularity"] = train.recompute_granularity
    stage_times_of(cfg)
    scenario = Scenario(
        model=model, cluster=cluster, parallel=parallel, train=train, schedule=str(values["schedule"]),
        seq_length_source=seq_source,
        # A search derives each candidate's microbatches from its own DP and micro-batch size.
        num_microbatches=1 if search else _num_microbatches(cfg, train, parallel, (fill or {}).get("num_microbatches")),
        fixed=given,
    )
    # the option groups are checked for every command, in this order (the records are built where they are read)
    search_options(cfg), replan_options(cfg), output_options(cfg)
    extra_of(cfg)
    return scenario


def _dimension_values(cfg: DictConfig, cluster: ClusterSpec, *, search: bool,
                      fill: Mapping[str, object] | None) -> tuple[dict, dict]:
    """(the search dimensions the config pins, every dimension's value): stand-ins for the free ones in a search,
    else ``fill``'s and the defaults."""
    given = _given(cfg)
    if not search:
        return given, _fill(given, cluster, fill)
    if given.get("schedule") == "all":
        del given["schedule"]
    if cfg.train.num_microbatches is not None:  # Megatron derives it; the search keeps the candidates giving it
        given["num_microbatches"] = positive_int("train.num_microbatches", cfg.train.num_microbatches, upper=MAX_SIZE)
    return given, {**_SEARCH_PLACEHOLDER, **given}


def _indivisible(cfg: DictConfig, cluster: ClusterSpec, sizes: Mapping[str, int], *, search: bool) -> str:
    """Why TP x PP x CP cannot split the cluster, naming the sizes the user gave and those derived from them (a
    searched size is not named)."""
    short = {"tensor_model_parallel_size": "TP", "pipeline_model_parallel_size": "PP", "context_parallel_size": "CP"}
    given = {key: (f"parallel.{key}={size}" if cfg.parallel.get(key) is not None else f"{short[key]}={size} (derived)")
             for key, size in sizes.items() if cfg.parallel.get(key) is not None or (not search and size > 1)}
    named = " x ".join(given.values())
    product = 1
    for size in sizes.values():
        product *= size
    divisors = [size for size in range(1, cluster.num_gpus + 1) if cluster.num_gpus % size == 0]
    shown = ", ".join(str(size) for size in divisors[:8]) + (", ..." if len(divisors) > 8 else "")
    return (f"{named}{f' = {product}' if len(given) > 1 else ''} does not divide the cluster's {cluster.num_gpus} "
            f"GPUs (TP x PP x CP must); use sizes whose product is one of {shown}, or change cluster.num_nodes")


def _parallel_spec(cfg: DictConfig, model: ModelSpec, cluster: ClusterSpec, values: Mapping, *,
                   search: bool) -> tuple[ParallelSpec, dict]:
    """The ParallelSpec of the dimension values, checked against the cluster's GPU count, and the runtime features
    the user pinned."""
    tp, pp, cp = (positive_int(f"parallel.{key}", values[key], upper=cluster.num_gpus,
                               fix=f"cluster {cluster.name!r} has {cluster.num_gpus} GPUs")
                  for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"))
    vp = positive_int("parallel.virtual_pipeline_model_parallel_size", values["virtual_pipeline_model_parallel_size"],
                      upper=MAX_LAYERS)
    group = cfg.parallel.microbatch_group_size_per_vp_stage
    if group is not None:
        positive_int("parallel.microbatch_group_size_per_vp_stage", group)
    if cluster.num_gpus % (tp * pp * cp):
        raise ConfigError(_indivisible(cfg, cluster, {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
                                                      "context_parallel_size": cp}, search=search))
    dp = cluster.num_gpus // (tp * pp * cp)
    ep, etp = _expert_sizes(model, values, tp=tp, stage=tp * cp * dp, cluster=cluster, search=search)
    features, pinned = _features(cfg, model, search=search)
    return ParallelSpec(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vp,
        context_parallel_size=cp, data_parallel_size=dp,
        expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
        features=features,
        sequence_parallel=bool(values["sequence_parallel"]),
        use_distributed_optimizer=bool(cfg.parallel.use_distributed_optimizer),
        microbatch_group_size_per_vp_stage=group,
        tp_comm_overlap=bool(cfg.parallel.get("tp_comm_overlap", False)),
        overlap_grad_reduce=bool(cfg.parallel.get("overlap_grad_reduce", True)),
        overlap_param_gather=bool(cfg.parallel.get("overlap_param_gather", True)),
        **memory_fields(cfg.parallel, ParallelSpec),
    ), pinned


def _train_spec(cfg: DictConfig, model: ModelSpec, cluster: ClusterSpec, values: Mapping,
                parallel: ParallelSpec) -> TrainSpec:
    """The TrainSpec of the config and the dimension values, its precision checked on every GPU type."""
    precision = _precision(cfg.train.precision)
    train = TrainSpec(
        micro_batch_size=positive_int("train.micro_batch_size", values["micro_batch_size"], upper=1 << 20),
        global_batch_size=positive_int("train.global_batch_size", cfg.train.global_batch_size, upper=MAX_SIZE),
        seq_length=model.seq_length if cfg.train.seq_length is None else positive_int(
            "train.seq_length", cfg.train.seq_length, upper=MAX_SEQ_LENGTH),
        recompute_granularity=Recompute(_enum_value(values["recompute_granularity"])),
        precision=precision,
        **_fp8_fields(cfg, precision, cluster, parallel),
        moe_load_imbalance=_imbalance(cfg.train.get("moe_load_imbalance"), cluster.runtime),
        grad_reduce_in_fp32=bool(cfg.train.get("grad_reduce_in_fp32", True)),
        **memory_fields(cfg.train, TrainSpec),
    )
    check_bounds(train, "train")
    for index, group in enumerate(cluster.node_groups):
        check_precision(train, group.gpu, where=f"cluster.node_groups[{index}].gpu" if cluster.is_heterogeneous
                        else "cluster.gpu")
    return train


def stage_times_of(cfg: DictConfig) -> tuple | None:
    """``stage_times`` as given (``megapipe simulate``'s per-stage [F, B, W] triples, checked by the command)."""
    stage_times = cfg.get("stage_times")
    if isinstance(stage_times, ListConfig):
        stage_times = OmegaConf.to_container(stage_times, resolve=True)
    return None if stage_times is None else tuple(stage_times)


def extra_of(cfg: DictConfig) -> dict:
    """The free-form command settings (``extra.*``) as a mapping, checked by the command that reads them."""
    raw = cfg.get("extra")
    if raw is None:
        return {}
    options = OmegaConf.to_container(raw, resolve=True) if isinstance(raw, DictConfig) else raw
    if not isinstance(options, dict):
        raise ConfigError(f"extra={raw!r} must be a mapping such as extra='{{iters: 10}}'")
    return options


def recorded_inputs(cfg: DictConfig) -> dict:
    """The resolved config as plain data, without hydra's and output's groups: what a plan records it was made from."""
    inputs = {}
    for key in cfg:
        if key in ("hydra", "output", "validate", "jobs", "pack"):  # how the run was launched, not what was planned
            continue
        value = cfg[key]
        if isinstance(value, DictConfig | ListConfig):
            value = OmegaConf.to_container(value, resolve=True, enum_to_str=True)
        inputs[key] = getattr(value, "value", value)
    return inputs


def _num_microbatches(cfg: DictConfig, train: TrainSpec, parallel: ParallelSpec, filled: int | None) -> int:
    given = cfg.train.num_microbatches if cfg.train.num_microbatches is not None else filled
    if given is not None:
        if given < 1:
            raise ConfigError(f"train.num_microbatches={given} must be >= 1")
        return int(given)
    per_step = train.micro_batch_size * parallel.data_parallel_size
    if train.global_batch_size % per_step:
        raise ConfigError(
            f"train.global_batch_size={train.global_batch_size} is not divisible by micro_batch_size * "
            f"data-parallel size = {train.micro_batch_size} * {parallel.data_parallel_size}; "
            "change the global batch or the micro-batch size"
        )
    return train.global_batch_size // per_step
