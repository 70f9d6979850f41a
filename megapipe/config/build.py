"""The one function from a composed Hydra config to domain records.

``to_setup(cfg)`` validates across groups and returns a frozen :class:`Setup`.
Parallel and train fields left null are search dimensions for ``megapipe plan``;
every other command fills them with the write-ups' 70B setting (TP=4, PP=8,
VP=1, CP=1, sequence parallel when TP>1, micro-batch 1, no recompute, 1F1B), with
TP and PP capped to the largest divisors of the node and cluster sizes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from importlib import resources

from omegaconf import DictConfig, OmegaConf

from megapipe.config.hf import read_hf_config
from megapipe.config.schema import register_configs
from megapipe.errors import ConfigError
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
    TrainSpec,
)
from megapipe.schedules import ScheduleName

__all__ = ["Setup", "conf_dir", "compose", "to_setup", "DEFAULT_FILL", "SEARCHABLE"]

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

SEARCHABLE = SEARCH_DIMENSIONS


@dataclass(frozen=True, slots=True, kw_only=True)
class Setup:
    """Everything a command needs, validated once."""

    model: ModelSpec
    cluster: ClusterSpec
    parallel: ParallelSpec
    train: TrainSpec
    schedule: str
    num_microbatches: int
    fixed: frozenset[str]
    """Search dimensions the user set (the rest were filled from DEFAULT_FILL)."""
    profile_path: str | None
    cfg: DictConfig


def conf_dir() -> str:
    """Absolute path of the shipped ``hydra_conf`` (package data ``megapipe.hydra_conf``).

    In a source checkout that is not installed, the repository's ``hydra_conf/`` is used.
    """
    checkout = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "hydra_conf")
    try:
        return str(resources.files("megapipe.hydra_conf"))
    except ModuleNotFoundError:
        return checkout


def compose(overrides: list[str] | tuple[str, ...] = (), *, config_name: str = "config") -> DictConfig:
    """Compose the config as the CLI would (for tests and library use)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=conf_dir(), version_base=None):
        return hydra_compose(config_name=config_name, overrides=list(overrides), return_hydra_config=False)


def _model_spec(node: DictConfig) -> ModelSpec:
    fields = {key: node[key] for key in node if key != "config_path"}
    path = node.get("config_path")
    if not path and node.get("name") == "hf":
        raise ConfigError("model=hf needs model.config_path=/path/to/config.json (a local Hugging Face config)")
    if path:
        from_file = read_hf_config(os.path.expanduser(str(path)))
        explicit = {key: value for key, value in fields.items() if value is not None and key != "name"}
        fields = {**fields, **from_file, **explicit}
        if fields.get("name") in (None, "hf"):
            fields["name"] = from_file.get("name", "hf")
    required = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "vocab_size", "seq_length")
    missing = [key for key in required if fields.get(key) is None]
    if missing:
        raise ConfigError(f"model={fields.get('name')!r} lacks {', '.join('model.' + k for k in missing)}; set them")
    if fields.get("num_query_groups") is None:
        fields["num_query_groups"] = fields["num_attention_heads"]
    spec = ModelSpec(
        **{**fields, "activation": Activation(_enum_value(fields["activation"])),
           "attention_backend": AttentionBackend(_enum_value(fields["attention_backend"]))}
    )
    _validate_model(spec)
    return spec


def _enum_value(value) -> str:
    return value.value if hasattr(value, "value") else str(value)


def _validate_model(model: ModelSpec) -> None:
    for key in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
                "vocab_size", "seq_length"):
        if getattr(model, key) <= 0:
            raise ConfigError(f"model.{key}={getattr(model, key)} must be positive")
    if model.num_attention_heads % model.num_query_groups:
        raise ConfigError(
            f"model.num_query_groups={model.num_query_groups} must divide "
            f"num_attention_heads={model.num_attention_heads}"
        )


def _gpu_spec(node: DictConfig) -> GpuSpec:
    spec = GpuSpec(**OmegaConf.to_container(node, resolve=True))
    if spec.memory_gib <= 0 or spec.usable_memory_fraction <= 0:
        raise ConfigError(
            f"gpu {spec.name!r} has memory_gib={spec.memory_gib}, usable_memory_fraction={spec.usable_memory_fraction}; "
            "both must be positive"
        )
    if spec.bf16_tflops <= 0 or spec.hbm_gbytes_per_s <= 0:
        raise ConfigError(f"gpu {spec.name!r}: bf16_tflops and hbm_gbytes_per_s must be positive")
    return spec


def _cluster_spec(node: DictConfig) -> ClusterSpec:
    links = {key: LinkSpec(**OmegaConf.to_container(node[key], resolve=True)) for key in ("intra_node", "inter_node")}
    if node.node_groups:
        groups = tuple(NodeGroup(gpu=_gpu_spec(g.gpu), num_nodes=int(g.num_nodes)) for g in node.node_groups)
        if sum(g.num_nodes for g in groups) != node.num_nodes:
            raise ConfigError(
                f"cluster {node.name!r}: node_groups hold {sum(g.num_nodes for g in groups)} nodes but "
                f"num_nodes={node.num_nodes}; make them agree"
            )
    else:
        groups = (NodeGroup(gpu=_gpu_spec(node.gpu), num_nodes=int(node.num_nodes)),)
    if node.num_nodes <= 0 or node.gpus_per_node <= 0:
        raise ConfigError(f"cluster {node.name!r}: num_nodes={node.num_nodes} and gpus_per_node={node.gpus_per_node} must be positive")
    for link in links.values():
        if link.bandwidth_gbytes_per_s <= 0 or link.latency_us < 0:
            raise ConfigError(f"cluster {node.name!r}: link {link.kind!r} needs bandwidth > 0 and latency >= 0")
    return ClusterSpec(
        name=str(node.name), gpus_per_node=int(node.gpus_per_node), price_per_gpu_hour=float(node.price_per_gpu_hour),
        intra_node=links["intra_node"], inter_node=links["inter_node"], node_groups=groups,
    )


def _largest_divisor(n: int, limit: int) -> int:
    return max(d for d in range(1, min(n, limit) + 1) if n % d == 0)


def _fill(cfg: DictConfig, cluster: ClusterSpec) -> tuple[dict, frozenset[str]]:
    values = {key: cfg.parallel.get(key) for key in SEARCHABLE if key in cfg.parallel}
    values["micro_batch_size"] = cfg.train.micro_batch_size
    values["recompute_granularity"] = cfg.train.recompute_granularity
    values["schedule"] = cfg.schedule.name
    fixed = frozenset(key for key, value in values.items() if value is not None)
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
    return values, fixed


def to_setup(cfg: DictConfig) -> Setup:
    """Validate the composed config and turn it into records (nulls filled from DEFAULT_FILL)."""
    model = _model_spec(cfg.model)
    cluster = _cluster_spec(cfg.cluster)
    values, fixed = _fill(cfg, cluster)
    tp, pp, cp = (int(values[k]) for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"))
    vp = int(values["virtual_pipeline_model_parallel_size"])
    for key, value in (("tensor_model_parallel_size", tp), ("pipeline_model_parallel_size", pp),
                       ("context_parallel_size", cp), ("virtual_pipeline_model_parallel_size", vp)):
        if value < 1:
            raise ConfigError(f"parallel.{key}={value} must be >= 1")
    if cluster.num_gpus % (tp * pp * cp):
        raise ConfigError(
            f"{cluster.num_gpus} GPUs are not divisible by TP*PP*CP={tp}*{pp}*{cp}; "
            "change the parallel sizes or cluster.num_nodes"
        )
    parallel = ParallelSpec(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vp,
        context_parallel_size=cp, data_parallel_size=cluster.num_gpus // (tp * pp * cp),
        sequence_parallel=bool(values["sequence_parallel"]),
        use_distributed_optimizer=bool(cfg.parallel.use_distributed_optimizer),
        microbatch_group_size_per_vp_stage=cfg.parallel.microbatch_group_size_per_vp_stage,
    )
    train = TrainSpec(
        micro_batch_size=int(values["micro_batch_size"]), global_batch_size=int(cfg.train.global_batch_size),
        seq_length=int(cfg.train.seq_length or model.seq_length),
        recompute_granularity=Recompute(_enum_value(values["recompute_granularity"])),
        precision=str(cfg.train.precision),
    )
    return Setup(
        model=model, cluster=cluster, parallel=parallel, train=train, schedule=str(values["schedule"]),
        num_microbatches=_num_microbatches(cfg, train, parallel), fixed=fixed,
        profile_path=cfg.get("profile"), cfg=cfg,
    )


def _num_microbatches(cfg: DictConfig, train: TrainSpec, parallel: ParallelSpec) -> int:
    if cfg.train.num_microbatches is not None:
        if cfg.train.num_microbatches < 1:
            raise ConfigError(f"train.num_microbatches={cfg.train.num_microbatches} must be >= 1")
        return int(cfg.train.num_microbatches)
    per_step = train.micro_batch_size * parallel.data_parallel_size
    if train.global_batch_size % per_step:
        raise ConfigError(
            f"train.global_batch_size={train.global_batch_size} is not divisible by micro_batch_size * "
            f"data-parallel size = {train.micro_batch_size} * {parallel.data_parallel_size}; "
            "change the global batch or the micro-batch size"
        )
    return train.global_batch_size // per_step
