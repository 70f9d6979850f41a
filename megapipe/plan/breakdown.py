"""Where one step's time goes: the slowest pipeline rank's parts, the bubble, and the step's tail.

The pipeline's time is at least the busiest rank's work, so it splits exactly into that rank's
per-part time over all microbatches (``LayerCost.parts``, :data:`megapipe.records.TIME_PARTS`),
the framework's per-microbatch time on it, and its idle time (the bubble, p2p waits included).
The data-parallel sync, the optimizer step and the per-step overhead follow the pipeline.
A measured profile has no parts: its time shows as ``measured_compute``.
"""

from __future__ import annotations

from collections.abc import Sequence

from megapipe.records import TIME_PARTS, LayerCost, Partition, StageSpec

__all__ = ["step_breakdown"]


def step_breakdown(*, layers: Sequence[LayerCost], part: Partition, specs: Sequence[StageSpec], num_microbatches: int,
                   pipeline_ms: float, sync_ms: float, optimizer_ms: float,
                   step_overhead_ms: float) -> tuple[tuple[str, float], ...]:
    """(name, ms) pairs summing to the step time."""
    pp = part.pipeline_model_parallel_size
    ranks = part.stage_to_rank or tuple(stage % pp for stage in range(len(part.entries_per_stage)))
    parts = [[0.0] * len(TIME_PARTS) for _ in range(pp)]
    measured, busy, overhead = [0.0] * pp, [0.0] * pp, [0.0] * pp
    start = 0
    for stage, count in enumerate(part.entries_per_stage):
        rank = ranks[stage]
        scale = specs[rank].time_scale
        overhead[rank] += specs[rank].microbatch_overhead_ms
        for layer in layers[start:start + count]:
            busy[rank] += scale * (layer.fwd_ms + layer.bwd_ms)
            if layer.parts:
                for index, value in enumerate(layer.parts):
                    parts[rank][index] += scale * value
            else:
                measured[rank] += scale * (layer.fwd_ms + layer.bwd_ms)
        start += count
    critical = max(range(pp), key=lambda r: busy[r] + overhead[r])
    m = num_microbatches
    out = [(name, m * value) for name, value in zip(TIME_PARTS, parts[critical]) if value > 0]
    if measured[critical] > 0:
        out.append(("measured_compute", m * measured[critical]))
    work = m * (busy[critical] + overhead[critical])
    out += [("microbatch_overhead", m * overhead[critical]), ("bubble", max(0.0, pipeline_ms - work)),
            ("dp_sync", sync_ms), ("optimizer", optimizer_ms), ("step_overhead", step_overhead_ms)]
    return tuple(out)
