"""The ``search.*`` and ``output.*`` groups as option records (:mod:`megapipe.options`), once, at the boundary.

Commands read those records, never the Hydra config.
"""

from __future__ import annotations

import math

from omegaconf import DictConfig

from megapipe.config.validate import check_fraction_pair, positive_int
from megapipe.errors import ConfigError
from megapipe.options import REPLAN_ATTRIBUTIONS, OutputOptions, Reference, ReplanOptions, SearchOptions

__all__ = ["search_options", "replan_options", "output_options"]

def _value(raw) -> str:
    return getattr(raw, "value", str(raw))


def _pair(node: DictConfig, key: str) -> tuple[float, float] | None:
    raw = node.get(key)
    if raw is None:
        return None
    values = list(raw)
    if len(values) != 2:
        raise ConfigError(f"search.{key}={values} must be [low, high]")
    return float(values[0]), float(values[1])


def _group(cfg: DictConfig, name: str) -> DictConfig:
    """A group of the config; an empty one when a recorded config (a plan's inputs) leaves it out."""
    node = cfg.get(name)
    return node if node is not None else DictConfig({})


def search_options(cfg: DictConfig) -> SearchOptions:
    """``search.*`` (and train.total_tokens) as a SearchOptions record."""
    node = _group(cfg, "search")
    limit = node.get("max_pipeline_model_parallel_size")
    vp_limit = node.get("max_virtual_pipeline_model_parallel_size")
    target, warn = _pair(node, "bubble_target"), _pair(node, "bubble_warning_range")
    check_fraction_pair("search.bubble_target", target)
    check_fraction_pair("search.bubble_warning_range", warn)
    return SearchOptions(
        objective=_value(node.get("objective") or "throughput"),
        top_k=positive_int("search.top_k", node.get("top_k", 5), upper=10_000),
        allow_cross_node_tp=bool(node.get("allow_cross_node_tp")),
        bubble_target=target, bubble_warning_range=warn,
        ignore_memory_limit=bool(node.get("ignore_memory_limit")),
        max_pipeline_model_parallel_size=None if limit is None else positive_int(
            "search.max_pipeline_model_parallel_size", limit),
        max_virtual_pipeline_model_parallel_size=None if vp_limit is None else positive_int(
            "search.max_virtual_pipeline_model_parallel_size", vp_limit),
        per_stage_recompute=bool(node.get("per_stage_recompute")),
        what_if_schedules=bool(node.get("what_if_schedules")),
        total_tokens=float(_group(cfg, "train").get("total_tokens") or 2e12),
        reference=_reference(node.get("reference")),
    )


def _reference(node) -> Reference | None:
    if node is None:
        return None
    reported = node.get("reported_tokens_per_s_per_gpu")
    return Reference(
        label=str(node.label),
        tensor_model_parallel_size=positive_int("search.reference.tensor_model_parallel_size",
                                                node.tensor_model_parallel_size),
        pipeline_model_parallel_size=positive_int("search.reference.pipeline_model_parallel_size",
                                                  node.pipeline_model_parallel_size),
        reported_tokens_per_s_per_gpu=None if reported is None else float(reported), source=str(node.get("source", "")),
    )


def replan_options(cfg: DictConfig) -> ReplanOptions:
    node = _group(cfg, "search")
    attribution = str(node.get("replan_attribution") or "stage")
    if attribution not in REPLAN_ATTRIBUTIONS:
        raise ConfigError(f"search.replan_attribution={attribution!r} is not known; "
                          f"use one of {', '.join(REPLAN_ATTRIBUTIONS)}")
    min_gain, drift = node.get("min_gain", 0.02), node.get("drift_threshold", 0.1)
    if not (isinstance(min_gain, (int, float)) and math.isfinite(min_gain) and min_gain >= 0):
        raise ConfigError(f"search.min_gain={min_gain!r} must be a number >= 0 (0.02 = 2%)")
    if not (isinstance(drift, (int, float)) and math.isfinite(drift) and drift > 0):
        raise ConfigError(f"search.drift_threshold={drift!r} must be a number > 0 (0.1 = 10%)")
    return ReplanOptions(min_gain=float(min_gain), attribution=attribution, drift_threshold=float(drift))


def output_options(cfg: DictConfig) -> OutputOptions:
    node = _group(cfg, "output")
    keys = str(node.get("bridge_keys") or "flat")
    if keys not in ("flat", "nested"):
        raise ConfigError(f"output.bridge_keys={keys!r} is not known; use flat (Megatron-Bridge 0.6.x) or nested "
                          "(Bridge main's model.transformer.*)")
    return OutputOptions(json=_value(node.get("format") or "table") == "json",
                         dir=str(node.dir) if node.get("dir") else None, pictures=bool(node.get("pictures", True)),
                         bridge_keys=keys)
