"""Ranking evaluated plans: by throughput per GPU or by dollars per token.

Feasible plans always come before infeasible ones (those only exist with
``search.ignore_memory_limit``). Ties break on the plan's key, so the order, and
therefore ``plan.yaml``, is the same on every run.
"""

from __future__ import annotations

from collections.abc import Iterable

from megapipe.errors import ConfigError
from megapipe.plan.plans import Plan

__all__ = ["OBJECTIVES", "sort_key", "rank_plans", "pick_by_bubble_target", "score"]

OBJECTIVES = ("throughput", "cost")


def score(plan: Plan, objective: str) -> float:
    """Lower is better: -tokens/s/GPU, or $ per 1M tokens."""
    if objective == "throughput":
        return -plan.tokens_per_s_per_gpu
    if objective == "cost":
        return plan.cost_per_million_tokens
    raise ConfigError(f"search.objective={objective!r} is unknown; use throughput or cost")


def sort_key(plan: Plan, objective: str) -> tuple:
    return (not plan.feasible, plan.memory_over_gib, round(score(plan, objective), 9), plan.key)


def _layout_key(plan: Plan) -> tuple:
    """Everything but the micro-batch size."""
    key = plan.key
    return key[:6] + key[7:]


def pick_by_bubble_target(plans: Iterable[Plan], bubble_target: tuple[float, float], objective: str) -> list[Plan]:
    """Per layout (all dimensions but micro_batch_size) keep one micro-batch size.

    The kept plan is the best-scoring one whose bubble lies in ``[low, high]``; when none
    does, the one whose bubble is nearest to the range.
    """
    low, high = bubble_target
    if not 0 <= low <= high <= 1:
        raise ConfigError(f"search.bubble_target={[low, high]} must satisfy 0 <= low <= high <= 1")
    groups: dict[tuple, list[Plan]] = {}
    for plan in plans:
        groups.setdefault(_layout_key(plan), []).append(plan)

    def distance(plan: Plan) -> float:
        return max(low - plan.bubble_fraction, plan.bubble_fraction - high, 0.0)

    return [min(group, key=lambda p: (distance(p), sort_key(p, objective))) for group in groups.values()]


def rank_plans(
    plans: Iterable[Plan],
    *,
    objective: str = "throughput",
    top_k: int | None = None,
    bubble_target: tuple[float, float] | None = None,
) -> tuple[Plan, ...]:
    """Best first; ``top_k`` None keeps all."""
    if objective not in OBJECTIVES:
        raise ConfigError(f"search.objective={objective!r} is unknown; use throughput or cost")
    if top_k is not None and top_k < 1:
        raise ConfigError(f"search.top_k={top_k} must be >= 1")
    pool = list(plans)
    if bubble_target is not None:
        pool = pick_by_bubble_target(pool, bubble_target, objective)
    ordered = sorted(pool, key=lambda plan: sort_key(plan, objective))
    return tuple(ordered if top_k is None else ordered[:top_k])
