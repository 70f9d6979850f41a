"""Typed option records built from the ``search.*`` and ``output.*`` groups, once, at the boundary.

Commands read these records, never the Hydra config: :class:`SearchOptions` (the planner's,
in :mod:`megapipe.plan.plans`), :class:`ReplanOptions` and :class:`OutputOptions`.
"""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig

from megapipe.errors import ConfigError
from megapipe.plan.plans import SearchOptions

__all__ = ["OutputOptions", "ReplanOptions", "REPLAN_ATTRIBUTIONS", "search_options", "replan_options",
           "output_options"]

REPLAN_ATTRIBUTIONS = ("stage", "kind")
"""stage: each stage's measured time split in proportion to the profile; kind: per-kind factors first."""


@dataclass(frozen=True, slots=True, kw_only=True)
class OutputOptions:
    """Where and how a command reports; never part of what was planned."""

    json: bool = False
    """Print one JSON object instead of tables (``output.format=json``)."""
    dir: str | None = None
    """Where files go (``output.dir``); None means the run directory under outputs/."""
    pictures: bool = True
    """Draw PNG pictures after the answer is printed."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplanOptions:
    """``megapipe replan`` settings from the search group."""

    min_gain: float = 0.02
    """Smallest predicted gain (0.02 = 2%) for which a change is suggested."""
    attribution: str = "stage"
    """How measured stage times are attributed to layers (:data:`REPLAN_ATTRIBUTIONS`)."""
    drift_threshold: float = 0.1
    """Relative difference between measured and predicted figures the monitor warns at."""


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
    top_k = int(node.get("top_k") or 5)
    if top_k < 1:
        raise ConfigError(f"search.top_k={top_k} must be >= 1")
    return SearchOptions(
        objective=_value(node.get("objective") or "throughput"), top_k=top_k,
        allow_cross_node_tp=bool(node.get("allow_cross_node_tp")),
        bubble_target=_pair(node, "bubble_target"),
        bubble_warning_range=_pair(node, "bubble_warning_range") or (0.12, 0.15),
        ignore_memory_limit=bool(node.get("ignore_memory_limit")),
        max_pipeline_model_parallel_size=node.get("max_pipeline_model_parallel_size"),
        per_stage_recompute=bool(node.get("per_stage_recompute")),
        megatron_schedules_only=bool(node.get("megatron_schedules_only")),
        total_tokens=float(_group(cfg, "train").get("total_tokens") or 2e12),
    )


def replan_options(cfg: DictConfig) -> ReplanOptions:
    node = _group(cfg, "search")
    attribution = str(node.get("replan_attribution") or "stage")
    if attribution not in REPLAN_ATTRIBUTIONS:
        raise ConfigError(f"search.replan_attribution={attribution!r} is not known; "
                          f"use one of {', '.join(REPLAN_ATTRIBUTIONS)}")
    return ReplanOptions(min_gain=float(node.get("min_gain", 0.02)), attribution=attribution,
                         drift_threshold=float(node.get("drift_threshold", 0.1)))


def output_options(cfg: DictConfig) -> OutputOptions:
    node = _group(cfg, "output")
    return OutputOptions(json=_value(node.get("format") or "table") == "json",
                         dir=str(node.dir) if node.get("dir") else None, pictures=bool(node.get("pictures", True)))
