"""Checks across the config groups, once, at the boundary: every bad value gets one ConfigError naming it and the fix.

Hydra's schemas reject a mistyped key of a known group and values of the wrong type; these
checks reject what a schema cannot: keys added with ``+`` that megapipe does not know, sizes
that are zero, negative, not finite or beyond what megapipe plans, and fractions outside (0, 1].
"""

from __future__ import annotations

import dataclasses
import difflib
import math

from omegaconf import DictConfig, ListConfig

import megapipe.config.schema as schema
from megapipe.errors import ConfigError
from megapipe.records import BOUNDS, ClusterSpec, GpuSpec, LinkSpec, ModelSpec

__all__ = ["MAX_LAYERS", "MAX_GPUS", "MAX_SIZE", "MAX_SEQ_LENGTH", "check_known_keys", "check_model", "check_override_keys", "megatron_flag_key", "check_gpu",
           "check_link", "check_bounds", "check_cluster", "positive_int", "check_fraction_pair", "check_experts"]

MAX_LAYERS = 4096
"""More decoder layers than any published model by 10x; the partition solver's tables grow with it."""
MAX_GPUS = 1 << 20
MAX_SIZE = 10**9
"""The largest width, vocabulary or batch megapipe takes (a thousand times any published model's)."""
MAX_SEQ_LENGTH = 1 << 24

_GROUPS = {
    "model": schema.ModelConfig, "cluster": schema.ClusterConfig, "runtime": schema.RuntimeConfig,
    "parallel": schema.ParallelConfig,
    "train": schema.TrainConfig, "schedule": schema.ScheduleConfig, "search": schema.SearchConfig,
    "output": schema.OutputConfig, "validate": schema.ValidateConfig, "pack": schema.PackConfig,
}
_NESTED = {("cluster", "gpu"): schema.GpuConfig, ("cluster", "intra_node"): schema.LinkConfig,
           ("cluster", "inter_node"): schema.LinkConfig}


def _names(schema_class) -> set[str]:
    return {item.name for item in dataclasses.fields(schema_class)}


def _unknown(where: str, node, known: set[str]) -> None:
    if not isinstance(node, (DictConfig, dict)):
        return
    for key in node:
        if key not in known:
            close = difflib.get_close_matches(str(key), sorted(known), n=1)
            hint = f"did you mean {where}.{close[0]}?" if close else f"known keys: {', '.join(sorted(known))}"
            raise ConfigError(f"{where}.{key} is not a megapipe setting; {hint}")


_MEGATRON_FLAGS = {"num_experts": "model.num_moe_experts", "seq_length": "train.seq_length",
                   "bf16": "train.precision=bf16", "fp16": "train.precision=fp16", "fp8_format": "train.precision=fp8"}
"""Megatron-LM flags whose megapipe setting has another name or group; with ``=`` the whole setting (a switch
that megapipe spells as a value)."""


def megatron_flag_key(flag: str) -> str | None:
    """The megapipe key a Megatron-LM style flag (``--tensor-model-parallel-size``) sets, or None; a
    ``key=value`` where the flag is a switch megapipe spells as a value (``--bf16``: ``train.precision=bf16``)."""
    name = flag.lstrip("-").split("=")[0].replace("-", "_")
    if name in _MEGATRON_FLAGS:
        return _MEGATRON_FLAGS[name]
    groups = _group_of(name)
    preferred = [group for group in ("parallel", "train", "model", "search", "output") if group in groups]
    return f"{(preferred or groups)[0]}.{name}" if groups else None


def check_known_keys(cfg: DictConfig) -> None:
    """Refuse keys added with ``+key=value`` that no schema has (a typo would otherwise be ignored)."""
    top = _names(schema.Config) | {"hydra"}
    for key in cfg:
        if key not in top:
            close = difflib.get_close_matches(str(key), sorted(top), n=1)
            raise ConfigError(f"{key} is not a megapipe setting" + (f"; did you mean {close[0]}?" if close else ""))
    for group, schema_class in _GROUPS.items():
        _unknown(group, cfg.get(group), _names(schema_class))
    cluster = cfg.get("cluster")
    if isinstance(cluster, DictConfig):
        for (group, key), schema_class in _NESTED.items():
            _unknown(f"{group}.{key}", cluster.get(key), _names(schema_class))
        groups = cluster.get("node_groups")
        if isinstance(groups, ListConfig):
            for index, entry in enumerate(groups):
                _unknown(f"cluster.node_groups[{index}]", entry, _names(schema.NodeGroupConfig))
                if isinstance(entry, DictConfig):
                    _unknown(f"cluster.node_groups[{index}].gpu", entry.get("gpu"), _names(schema.GpuConfig))


_OPEN = ("hydra", "extra", "jobs", "stage_times", "input", "profile")
"""Top-level keys whose contents no schema lists (Hydra's own, free-form command settings, the job list)."""


def _group_of(key: str) -> list[str]:
    return sorted(group for group, schema_class in _GROUPS.items() if key in _names(schema_class))


_DERIVED = {
    "data_parallel_size": "DP is not set but derived, as Megatron does: the GPUs / (TP x PP x CP); set "
                          "cluster.num_nodes or parallel.tensor_model_parallel_size, pipeline_model_parallel_size, "
                          "context_parallel_size",
    "num_gpus": "the GPU count is cluster.num_nodes x cluster.gpus_per_node; set those",
}
"""Keys a user may try that megapipe derives instead, with what to set."""


def check_override_keys(overrides) -> None:
    """Refuse a ``key=value`` override whose key no schema has, with the key it likely means, before Hydra's
    "use +key" advice: a typo (``train.seq_lenght``) or a key without its group (``tensor_model_parallel_size``)."""
    top = _names(schema.Config)
    for override in overrides:
        key, _, value = str(override).partition("=")
        key = key.lstrip("+~").strip()
        if not key or "@" in key or key.startswith(_OPEN):
            continue
        parts = [part.split("[")[0] for part in key.split(".")]
        if parts[-1] in _DERIVED and len(parts) <= 2:
            raise ConfigError(f"{key}={value}: {_DERIVED[parts[-1]]}")
        if len(parts) == 1:
            if key in top:
                continue
            groups = _group_of(key)
            if groups:
                raise ConfigError(f"{key} is no top-level setting; did you mean {groups[0]}.{key}={value}?")
            close = difflib.get_close_matches(key, sorted(top), n=1)
            raise ConfigError(f"{key} is not a megapipe setting" + (f"; did you mean {close[0]}?" if close else
                                                                       "; settings are group.key=value"))
        schema_class = _GROUPS.get(parts[0])
        if len(parts) >= 3 and (parts[0], parts[1]) in _NESTED:
            _unknown(f"{parts[0]}.{parts[1]}", {parts[2]: None}, _names(_NESTED[(parts[0], parts[1])]))
        elif schema_class is not None and parts[1] not in _names(schema_class):
            groups = _group_of(parts[1])
            if groups:
                raise ConfigError(f"{key} is not a megapipe setting; did you mean {groups[0]}.{parts[1]}?")
            _unknown(parts[0], {parts[1]: None}, _names(schema_class))


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def positive_int(key: str, value, *, upper: int | None = None, fix: str = "") -> int:
    """``value`` as an int >= 1 (and <= ``upper``), else ConfigError naming ``key``."""
    if isinstance(value, bool) or not _finite(value) or value != int(value) or value < 1:
        raise ConfigError(f"{key}={value!r} must be a whole number >= 1" + (f"; {fix}" if fix else ""))
    if upper is not None and value > upper:
        raise ConfigError(f"{key}={value!r} exceeds {upper:,}" + (f": {fix}" if fix else ", the most megapipe plans for"))
    return int(value)


def check_model(model: ModelSpec) -> None:
    positive_int("model.num_layers", model.num_layers, upper=MAX_LAYERS)
    for key in ("hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size", "vocab_size"):
        positive_int(f"model.{key}", getattr(model, key), upper=MAX_SIZE)
    positive_int("model.seq_length", model.seq_length, upper=MAX_SEQ_LENGTH)
    if model.kv_channels is not None:
        positive_int("model.kv_channels", model.kv_channels, upper=1 << 20)
    if model.mtp_num_layers < 0 or model.mtp_num_layers > MAX_LAYERS:
        raise ConfigError(f"model.mtp_num_layers={model.mtp_num_layers} must lie in [0, {MAX_LAYERS}]")
    if model.kv_channels is None and model.hidden_size % model.num_attention_heads:
        raise ConfigError(
            f"model.hidden_size={model.hidden_size} is not a multiple of num_attention_heads="
            f"{model.num_attention_heads} (Megatron's per-head size); set model.kv_channels or change one of them")
    if model.num_attention_heads % model.num_query_groups:
        raise ConfigError(
            f"model.num_query_groups={model.num_query_groups} must divide "
            f"num_attention_heads={model.num_attention_heads}"
        )
    if model.mtp_num_layers and model.position_embedding_type == "learned_absolute":
        raise ConfigError("model.mtp_num_layers needs position_embedding_type rope or none (Megatron-LM's "
                          "validate_args refuses learned_absolute with MTP)")
    if model.multi_latent_attention:
        for key in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
            positive_int(f"model.{key}", getattr(model, key), upper=1 << 20)
        if model.q_lora_rank is not None:
            positive_int("model.q_lora_rank", model.q_lora_rank, upper=1 << 20)
    if model.num_moe_experts:
        check_experts(model)


ROUTER_SCORE_FUNCTIONS = ("softmax", "sigmoid")
LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none")


def check_experts(model: ModelSpec) -> None:
    """The MoE fields, with the rules megatron-core 0.16's TransformerConfig enforces."""
    experts = positive_int("model.num_moe_experts", model.num_moe_experts, upper=1 << 16)
    topk = model.moe_router_topk
    if not (isinstance(topk, int) and 1 <= topk <= experts):
        raise ConfigError(f"model.moe_router_topk={topk!r} must lie in [1, num_moe_experts={experts}]")
    positive_int("model.moe_ffn_hidden_size", model.expert_ffn_hidden_size, upper=MAX_SIZE)
    if model.moe_shared_expert_intermediate_size < 0:
        raise ConfigError(f"model.moe_shared_expert_intermediate_size={model.moe_shared_expert_intermediate_size} "
                          "must be >= 0 (0: no shared experts)")
    if model.moe_router_score_function not in ROUTER_SCORE_FUNCTIONS:
        raise ConfigError(f"model.moe_router_score_function={model.moe_router_score_function!r}; use softmax or sigmoid")
    if model.moe_router_load_balancing_type not in LOAD_BALANCING_TYPES:
        raise ConfigError(f"model.moe_router_load_balancing_type={model.moe_router_load_balancing_type!r}; use one "
                          f"of {', '.join(LOAD_BALANCING_TYPES)}")
    if model.moe_router_enable_expert_bias and model.moe_router_score_function != "sigmoid":
        raise ConfigError("model.moe_router_enable_expert_bias=true needs moe_router_score_function=sigmoid "
                          "(megatron-core refuses it with softmax)")
    if topk == 1 and model.moe_router_score_function == "softmax" and not model.moe_router_pre_softmax:
        raise ConfigError("model.moe_router_topk=1 with softmax needs moe_router_pre_softmax=true "
                          "(megatron-core refuses it otherwise: the weight would always be 1)")
    groups, group_topk = model.moe_router_num_groups, model.moe_router_group_topk
    if groups is not None:
        positive_int("model.moe_router_num_groups", groups, upper=experts)
        if experts % groups:
            raise ConfigError(f"model.moe_router_num_groups={groups} must divide num_moe_experts={experts}")
        if group_topk is None or not 1 <= group_topk <= groups:
            raise ConfigError(f"model.moe_router_group_topk={group_topk!r} must lie in [1, moe_router_num_groups="
                              f"{groups}] with group-limited routing")
    if len(model.moe_layer_freq) not in (0, model.num_layers):
        raise ConfigError(f"model.moe_layer_freq has {len(model.moe_layer_freq)} entries for num_layers="
                          f"{model.num_layers}; give one 0/1 per layer")


def check_bounds(record, where: str) -> None:
    """Every field of ``record`` that declares a bound (:data:`megapipe.records.BOUNDS`) within it."""
    for item in dataclasses.fields(record):
        bound = item.metadata.get("bound")
        if bound is None:
            continue
        value = getattr(record, item.name)
        ok = _finite(value) and {"positive": value > 0, "non_negative": value >= 0, "fraction": 0 < value <= 1,
                                 "fraction_or_zero": 0 <= value <= 1}[bound]
        if not ok:
            raise ConfigError(f"{where}.{item.name}={value!r} must be {BOUNDS[bound]}")


def check_gpu(gpu: GpuSpec, where: str = "cluster.gpu") -> None:
    check_bounds(gpu, where)


def check_link(link: LinkSpec, where: str) -> None:
    check_bounds(link, where)


def check_cluster(cluster: ClusterSpec) -> None:
    positive_int("cluster.gpus_per_node", cluster.gpus_per_node, upper=1024)
    if cluster.num_gpus > MAX_GPUS:
        raise ConfigError(f"cluster {cluster.name!r} has {cluster.num_gpus:,} GPUs, beyond the {MAX_GPUS:,} "
                          "megapipe plans for; lower cluster.num_nodes")
    if not (_finite(cluster.price_per_gpu_hour) and cluster.price_per_gpu_hour >= 0):
        raise ConfigError(f"cluster.price_per_gpu_hour={cluster.price_per_gpu_hour!r} must be a finite number >= 0")
    check_link(cluster.intra_node, "cluster.intra_node")
    check_link(cluster.inter_node, "cluster.inter_node")


def check_fraction_pair(key: str, pair: tuple[float, float] | None) -> None:
    """A [low, high] range of fractions: 0 <= low <= high <= 1."""
    if pair is not None and not (all(_finite(v) for v in pair) and 0 <= pair[0] <= pair[1] <= 1):
        raise ConfigError(f"{key}={list(pair)} must satisfy 0 <= low <= high <= 1")
