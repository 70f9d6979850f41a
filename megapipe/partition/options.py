"""Exact min-max split where each stage also picks one of several cost options (per-stage recompute).

Problem: split entries 0..n-1 into P contiguous non-empty stages; stage j holding [a, b) under
option o costs ``s_j (T_o[b] - T_o[a])`` (T_o the fwd + bwd prefix of option o's profile) and needs
``S_o[b] - S_o[a] + k_j (A_o[b] - A_o[a]) <= cap_j`` (static and activation prefixes, k_j in-flight
microbatches). Minimise the largest stage cost over splits and options.

Method: for a bound B, stage j can end anywhere in [a + 1, r_j(a)], r_j(a) = max over o of the last
stop whose cost is <= B and whose bytes fit under o: each option's stops from a are contiguous
(time and bytes grow with the segment), so their union is too. r_j never decreases in a, so the
stops reachable after stage j follow from those after stage j - 1 by a running maximum, as in
:mod:`megapipe.partition.minmax`. Feasibility is monotone in B and the optimum is one of the
canonical segment costs, so a binary search over their sorted values is exact. Memory is
O(P x options x n^2) floats: the planner uses it, opt-in, for one chunk per rank
(:mod:`megapipe.plan.per_stage_recompute`).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from megapipe.records import LayerCost, StageSpec

__all__ = ["OptionSplit", "split_with_options"]


@dataclass(frozen=True, slots=True, kw_only=True)
class OptionSplit:
    bottleneck_ms: float
    bounds: tuple[int, ...]
    """Stage boundaries, P + 1 of them."""
    choices: tuple[int, ...]
    """Index into ``options`` per stage: the fastest option that fits the stage's segment."""


def _prefix(values) -> np.ndarray:
    return np.array((0.0, *itertools.accumulate(values)))


def _costs(options: Sequence[Sequence[LayerCost]], stages: Sequence[StageSpec], in_flight: Sequence[int]):
    """cost[j, o, a, b]: stage j's time for entries [a, b) under option o; inf when empty or over memory."""
    num_entries = len(options[0])
    cost = np.full((len(stages), len(options), num_entries + 1, num_entries + 1), np.inf)
    later = np.arange(num_entries + 1)[None, :] > np.arange(num_entries + 1)[:, None]
    for index, layers in enumerate(options):
        time_prefix = _prefix(layer.fwd_ms + layer.bwd_ms for layer in layers)
        static = _prefix(layer.static_bytes for layer in layers)
        act = _prefix(layer.act_bytes for layer in layers)
        span = time_prefix[None, :] - time_prefix[:, None]
        static_span, act_span = static[None, :] - static[:, None], act[None, :] - act[:, None]
        for stage, (spec, count) in enumerate(zip(stages, in_flight)):
            fits = later & (static_span + count * act_span <= spec.memory_bytes)
            cost[stage, index] = np.where(fits, spec.time_scale * span, np.inf)
    return cost


def _reachable(reach: np.ndarray) -> list[np.ndarray]:
    """Reachable stops after each stage, given reach[j, a] (a itself when nothing fits)."""
    num_stops = reach.shape[1]
    stops = np.arange(num_stops)
    current = np.zeros(num_stops, dtype=bool)
    current[0] = True
    history = [current]
    for row in reach:
        best = np.maximum.accumulate(np.where(current, row, -1))
        current = np.zeros(num_stops, dtype=bool)
        current[1:] = best[:-1] >= stops[1:]
        history.append(current)
    return history


def _probe(cost: np.ndarray, bound: float) -> list[np.ndarray] | None:
    reach = (cost <= bound).sum(axis=-1).max(axis=1) + np.arange(cost.shape[-1])[None, :]
    history = _reachable(reach)
    return history if history[-1][-1] else None


def split_with_options(*, options: Sequence[Sequence[LayerCost]], stages: Sequence[StageSpec],
                       in_flight: Sequence[int]) -> OptionSplit | None:
    """The exact min-max split with one option per stage, or None when no split fits memory.

    ``options[o]`` is the profile under option o (same entries, e.g. one recompute setting each);
    ``stages`` one StageSpec per pipeline rank (one chunk each), ``in_flight`` its peak in-flight
    microbatches.
    """
    cost = _costs(options, stages, in_flight)
    num_entries = cost.shape[-1] - 1
    # Every entry sits on some stage under some option, and a segment costs at least any entry in it.
    single = cost[:, :, np.arange(num_entries), np.arange(1, num_entries + 1)].min(axis=(0, 1)).max()
    values = np.unique(cost[np.isfinite(cost) & (cost >= single)])
    if not len(values) or _probe(cost, values[-1]) is None:  # the largest finite cost admits every fitting segment
        return None
    low, high = 0, len(values) - 1
    while low < high:
        middle = (low + high) // 2
        if _probe(cost, values[middle]) is None:
            low = middle + 1
        else:
            high = middle
    bound = float(values[low])
    return _reconstruct(cost, _probe(cost, bound), bound)


def _reconstruct(cost: np.ndarray, history: list[np.ndarray], bound: float) -> OptionSplit:
    num_stages = cost.shape[0]
    stop = cost.shape[-1] - 1
    bounds, choices = [stop], []
    for stage in range(num_stages - 1, -1, -1):
        fits = cost[stage, :, :, stop] <= bound  # (option, start)
        starts = np.nonzero(history[stage][:stop] & fits.any(axis=0)[:stop])[0]
        start = int(starts[-1])
        column = np.where(fits[:, start], cost[stage, :, start, stop], np.inf)
        choices.append(int(np.argmin(column)))
        bounds.append(start)
        stop = start
    bounds.reverse()
    choices.reverse()
    bottleneck = max(float(cost[j, choices[j], bounds[j], bounds[j + 1]]) for j in range(num_stages))
    return OptionSplit(bottleneck_ms=bottleneck, bounds=tuple(bounds), choices=tuple(choices))
