"""Memory side of the partition: in-flight microbatches per stage, per-chunk caps, memory reach.

A stage holding entries [a, b) needs ``sum(static_bytes) + in_flight * sum(act_bytes)``
bytes (Narayanan et al. 2021, sec. 2.2: under 1F1B stage j keeps at most p - j
microbatches' activations; GPipe keeps all m). Comparisons are made on prefix sums,
which are exact when byte counts are integers below 2**53.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from megapipe.errors import ConfigError
from megapipe.records import LayerCost, StageSpec
from megapipe.schedules import peak_in_flight, spec

__all__ = ["in_flight_counts", "stage_ranks", "chunk_memory_caps", "memory_reach"]


def stage_ranks(*, schedule: str, pipeline_model_parallel_size: int, num_stages: int) -> tuple[int, ...]:
    """Pipeline rank of each layout stage, by the schedule's placement (vp-major loop or V)."""
    return spec(schedule).stage_to_rank(pipeline_model_parallel_size=pipeline_model_parallel_size,
                                        num_stages=num_stages)


def in_flight_counts(
    *,
    schedule: str,
    pipeline_model_parallel_size: int,
    num_microbatches: int,
    virtual_pipeline_model_parallel_size: int = 1,
    microbatch_group_size_per_vp_stage: int | None = None,
) -> tuple[int, ...]:
    """Peak in-flight microbatches per layout stage (P * v of them, in layout order), by the schedule's spec."""
    pp, vp, m = pipeline_model_parallel_size, virtual_pipeline_model_parallel_size, num_microbatches
    counts = tuple(
        int(count)
        for count in peak_in_flight(
            schedule, pipeline_model_parallel_size=pp, num_microbatches=m, virtual_pipeline_model_parallel_size=vp,
            microbatch_group_size_per_vp_stage=microbatch_group_size_per_vp_stage,
        )
    )
    if len(counts) != pp * vp:
        raise ConfigError(f"schedule={schedule!r} gave {len(counts)} in-flight counts for {pp * vp} layout stages")
    return counts


def chunk_memory_caps(
    *, layers: Sequence[LayerCost], stages: Sequence[StageSpec], in_flight: Sequence[int], ranks: Sequence[int]
) -> tuple[float, ...]:
    """Each layout stage's share of its pipeline rank's memory_bytes.

    With v == 1 a stage gets its rank's whole cap. With v > 1 a rank's memory is the
    sum over its v chunks, which couples non-contiguous chunks; megapipe splits the
    cap in proportion to ``w_c = mean(static_bytes) + in_flight_c * mean(act_bytes)``,
    i.e. to what a chunk of average entries needs, so a split with the same number
    of average entries per chunk fits its shares exactly when it fits the rank cap.
    The solver is exact under this rule: no partition with every chunk within its
    share has a smaller bottleneck. Chunks' real sums never exceed the rank cap.
    """
    if len(ranks) == len(stages):
        return tuple(float(stages[rank].memory_bytes) for rank in ranks)
    mean_static = float(np.mean([layer.static_bytes for layer in layers]))
    mean_act = float(np.mean([layer.act_bytes for layer in layers]))
    weights = [mean_static + count * mean_act for count in in_flight]
    mates: dict[int, list[float]] = {}
    for weight, rank in zip(weights, ranks):
        mates.setdefault(rank, []).append(weight)
    rank_weight = {rank: sum(chunk_weights) for rank, chunk_weights in mates.items()}
    caps = []
    for weight, rank in zip(weights, ranks):
        total = rank_weight[rank]
        share = weight / total if total > 0 else 1.0 / len(mates[rank])
        caps.append(float(stages[rank].memory_bytes) * share)
    return tuple(caps)


def memory_reach(
    *, static_prefix: np.ndarray, act_prefix: np.ndarray, in_flight: Sequence[int], caps: Sequence[float]
) -> np.ndarray:
    """reach[c, a] = the largest b >= a with static(a, b) + in_flight[c] * act(a, b) <= caps[c].

    All layout stages at once: one searchsorted over rows made disjoint by an offset.
    With integral byte counts and every sum below 2**53 that is exact; otherwise each
    boundary is then settled on the canonical sum, which the offset's rounding can miss.
    """
    num_entries = len(static_prefix) - 1
    if all(cap == math.inf for cap in caps):  # no memory limit: every stop fits (the split without memory asks this)
        return np.full((len(caps), num_entries + 1), num_entries, dtype=np.intp)
    counts = np.asarray(in_flight, dtype=float)[:, None]
    cap_column = np.asarray(caps, dtype=float)[:, None]
    total = counts * act_prefix[None, -1:]
    total += static_prefix[None, -1:]  # the last column of static + count * act, same rounding
    limit = np.minimum(cap_column, total + 1.0)
    span = float(np.max(total + limit)) + 1.0
    exact = bool(
        np.all(np.floor(static_prefix) == static_prefix)
        and np.all(np.floor(act_prefix) == act_prefix)
        and np.all(np.floor(counts) == counts)
        and span * (len(counts) + 1) < 2.0**53
    )
    if exact:
        limit = np.floor(limit)  # integer sums: x <= cap exactly when x <= floor(cap)
    reach = _search_rows(static_prefix, act_prefix, counts, limit, span)
    starts = np.arange(num_entries + 1)[None, :]
    np.maximum(reach, starts, out=reach)
    np.minimum(reach, num_entries, out=reach)
    if exact:
        return reach

    def fits(stops: np.ndarray) -> np.ndarray:
        return (static_prefix[stops] - static_prefix) + counts * (act_prefix[stops] - act_prefix) <= cap_column

    for _ in range(num_entries + 1):
        grow = (reach < num_entries) & fits(np.minimum(reach + 1, num_entries))
        shrink = (reach > starts) & ~fits(reach)
        if not grow.any() and not shrink.any():
            break
        reach = reach + grow - shrink
    return reach


_BLOCK = 16
"""Stages per searchsorted call: keeps each temporary small (16 x 257 float64 = 33 KB at L = 256), so
repeated solves reuse heap memory instead of faulting fresh pages in for every large array."""


def _search_rows(static_prefix, act_prefix, counts, limit, span: float) -> np.ndarray:
    """found[c, a] - 1: the last b with combined[c, b] <= combined[c, a] + limit[c], c's rows offset by c * span.

    Row c's values lie in [c * span, (c + 1) * span) and so does each of its keys, so a
    search within a block of rows gives the same position as one over all rows.
    """
    num_rows, width = len(counts), len(static_prefix)
    reach = np.empty((num_rows, width), dtype=np.intp)
    offsets = np.arange(num_rows, dtype=float)[:, None] * span
    for first in range(0, num_rows, _BLOCK):
        part = slice(first, first + _BLOCK)
        combined = counts[part] * act_prefix[None, :]
        combined += static_prefix[None, :]
        keys = combined + limit[part]
        keys += offsets[part]  # (combined + limit) + offset
        combined += offsets[part]
        found = np.searchsorted(combined.ravel(), keys.ravel(), side="right")
        reach[part] = found.reshape(combined.shape)
    reach -= (np.arange(num_rows) % _BLOCK)[:, None] * width + 1
    return reach
