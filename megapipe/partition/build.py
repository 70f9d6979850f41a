"""Turn stage boundaries into a :class:`~megapipe.records.Partition` and explain memory misfits."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

from megapipe.errors import InfeasibleError
from megapipe.layout import format_layout
from megapipe.partition.coupled import rank_peaks
from megapipe.records import LayerCost, Partition, StageSpec
from megapipe.units import GIB

__all__ = ["build_partition", "over_memory_message"]

MEMORY_FIX = "add pipeline stages, recompute, or a smaller micro-batch"


def build_partition(
    *,
    layers: Sequence[LayerCost],
    stages: Sequence[StageSpec],
    bounds: Sequence[int],
    in_flight: Sequence[int],
    ranks: Sequence[int],
    num_microbatches: int,
    schedule: str,
    method: str,
    profiles: Sequence | None = None,
) -> Partition:
    """The record for layout stage c holding entries bounds[c]..bounds[c + 1] on pipeline rank ranks[c].

    ``profiles`` (:func:`megapipe.schedules.rank_in_flight_profiles`) gives ranks holding several stages
    their coupled peak; without it a rank's memory is the sum of its stages' peaks.
    """
    pp = len(stages)
    num_chunks = len(bounds) - 1
    assert num_chunks == len(in_flight) == len(ranks) and num_chunks % pp == 0
    cuts = [(bounds[c], bounds[c + 1]) for c in range(num_chunks)]
    all_kinds = tuple(e.kind for e in layers)
    kinds = tuple(all_kinds[a:b] for a, b in cuts)
    if any(not chunk for chunk in kinds):
        raise InfeasibleError(f"entries_per_stage={[len(c) for c in kinds]} leaves a stage empty; give each >= 1 entry")
    # One pass per field, then exact (fsum) sums over slices: the same values as summing each chunk's entries.
    times = [e.fwd_ms + e.bwd_ms for e in layers]
    statics = [e.static_bytes for e in layers]
    acts = [e.act_bytes for e in layers]
    fsum = math.fsum
    time_ms = tuple(stages[ranks[c]].time_scale * fsum(times[a:b]) for c, (a, b) in enumerate(cuts))
    static = tuple(fsum(statics[a:b]) for a, b in cuts)
    act = tuple(fsum(acts[a:b]) for a, b in cuts)
    memory = tuple(s + count * a for s, count, a in zip(static, in_flight, act))
    partition = Partition(
        entries_per_stage=tuple(len(chunk) for chunk in kinds),
        stage_kinds=kinds,
        stage_time_ms=time_ms,
        stage_static_bytes=static,
        stage_act_bytes=act,
        stage_in_flight=tuple(int(count) for count in in_flight),
        stage_memory_bytes=memory,
        layout="|".join(_stage_layout(stage_kinds) for stage_kinds in kinds),
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=num_chunks // pp,
        num_microbatches=num_microbatches,
        schedule=schedule,
        method=method,
        stage_to_rank=tuple(ranks),
        rank_peak_bytes=rank_peaks(static=static, act=act, ranks=ranks, profiles=profiles) if profiles else (),
    )
    rank_memory = partition.rank_memory_bytes
    fits = all(used <= stage.memory_bytes for used, stage in zip(rank_memory, stages))
    return dataclasses.replace(partition, fits_memory=fits)


@functools.lru_cache(maxsize=4096)
def _stage_layout(kinds: tuple) -> str:
    """One stage's layout text; stages repeat (``t*4``), so the text is cached by the stage's kinds."""
    return format_layout((kinds,))


def over_memory_message(*, label: str, need_bytes: float, cap_bytes: float, detail: str = "") -> str:
    """One line: what needs how much, what it has, by how much it is over, and what to change."""
    return (
        f"{label} needs at least {need_bytes / GIB:.1f} GiB but has {cap_bytes / GIB:.1f} GiB{detail} "
        f"(over by {(need_bytes - cap_bytes) / GIB:.1f} GiB): {MEMORY_FIX}"
    )
