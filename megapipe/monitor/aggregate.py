"""What one logged step writes: the row every pipeline rank gathers, and the records built from the rows.

Each rank contributes one row of :data:`ROW` (validity flag, mean step time over the
window, memory peaks and capacity); :func:`rank_fields` is its own ``rank`` record,
:func:`pipeline_fields` the ``pipeline`` record rank 0 builds from all rows and the
schedule hook's report (step time of the slowest rank, memory spread and CV, headroom,
bubble, throughput and MFU with the planner's FLOP convention). A rank reporting a
non-finite figure is left out of that figure's aggregate and listed in ``nan_ranks``.
:func:`flatten` turns a record into the scalar metrics loggers take. No torch, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from megapipe.monitor.memory import spread
from megapipe.monitor.throughput import throughput

__all__ = ["ROW", "VALID", "FAULTED", "finite", "columns_of", "rank_fields", "pipeline_fields", "flatten"]

VALID, FAULTED = 1.0, 0.0
ROW = ("flag", "step_time_ms", "peak_allocated_bytes", "peak_reserved_bytes", "rss_bytes", "capacity_bytes")
"""One rank's gathered figures, in order; ``flag`` is VALID, or FAULTED when its monitor failed."""


def finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def columns_of(rows: Sequence[Sequence[float]]) -> dict[str, list[float]]:
    """The gathered rows by figure: one list per :data:`ROW` entry, one value per pipeline rank."""
    return {name: [r[i] for r in rows] for i, name in enumerate(ROW)}


def rank_fields(row: Sequence[float], report: Any, *, pipeline_rank: int) -> dict:
    """The ``rank`` record: this rank's row, plus its compute and bubble from the hook's fresh report."""
    fields = dict(zip(ROW[1:], row[1:]))
    fields["pipeline_rank"] = pipeline_rank
    if report is not None:
        mine = report.rank
        count = max(1.0, mine.num_forward / max(1, len(mine.chunk_forward_ms)))
        fields.update(wall_ms=mine.wall_ms, forward_ms=mine.forward_ms, backward_ms=mine.backward_ms,
                      rank_bubble_ms=mine.bubble_ms, rank_bubble_fraction=mine.bubble_fraction,
                      p2p_wait_ms=mine.p2p_wait_ms, num_microbatches=count,
                      chunk_forward_ms=list(mine.chunk_forward_ms), chunk_backward_ms=list(mine.chunk_backward_ms))
    return fields


def pipeline_fields(columns: dict[str, list[float]], report: Any, *, layout: str | None,
                    decoder_layers_per_stage: Sequence[int], num_gpus: int, tokens_per_step: float | None,
                    flops_per_token: float | None, peak_tflops_per_gpu: float | None) -> dict:
    """The ``pipeline`` record (without its drift) from the gathered columns and the hook's fresh report."""
    nan_ranks = sorted({i for name in ("step_time_ms", "peak_allocated_bytes") if any(map(finite, columns[name]))
                        for i, v in enumerate(columns[name]) if not finite(v)})
    times = [v for v in columns["step_time_ms"] if finite(v)]
    step_ms = max(times) if times else math.nan
    out: dict[str, Any] = {"layout": layout, "decoder_layers_per_stage": list(decoder_layers_per_stage),
                           "step_time_ms": step_ms, "nan_ranks": nan_ranks,
                           "stage_peak_bytes": columns["peak_allocated_bytes"],
                           "stage_reserved_bytes": columns["peak_reserved_bytes"]}
    mem = spread(columns["peak_allocated_bytes"])
    if mem is not None:
        out.update(memory_spread=mem.spread, memory_cv=mem.cv, memory_max_bytes=mem.max_bytes)
    headroom = [c - r for c, r in zip(columns["capacity_bytes"], columns["peak_reserved_bytes"]) if finite(c - r)]
    out["memory_headroom_bytes"] = min(headroom) if headroom else math.nan
    if report is not None and report.pipeline is not None:
        out.update(bubble_fraction=report.measured_bubble_fraction,
                   simulated_bubble_fraction=report.simulated_bubble_fraction,
                   simulated_step_ms=report.simulated_step_ms, dispatch_ms=report.dispatch_ms,
                   stage_forward_ms=list(report.pipeline.stage_forward_ms),
                   stage_backward_ms=list(report.pipeline.stage_backward_ms),
                   compute_spread_ms=report.pipeline.compute_spread_ms)
    if tokens_per_step and finite(step_ms):
        tp = throughput(tokens_per_step=tokens_per_step, step_time_s=step_ms / 1e3, num_gpus=num_gpus,
                        flops_per_token=flops_per_token, peak_tflops_per_gpu=peak_tflops_per_gpu)
        if tp is not None:
            out.update(tokens_per_s=tp.tokens_per_s, tokens_per_s_per_gpu=tp.tokens_per_s_per_gpu,
                       tflops_per_gpu=tp.tflops_per_gpu, mfu=tp.mfu)
    return out


def flatten(fields: dict) -> dict:
    """Scalar metrics for loggers: per-stage lists become ``stage<i>_<figure>``, the drift dict ``drift_<figure>``."""
    flat = {}
    for key, value in fields.items():
        if key in ("stage_forward_ms", "stage_backward_ms", "stage_peak_bytes"):
            flat.update({f"stage{i}_{key[len('stage_'):]}": v for i, v in enumerate(value)})
        elif key == "drift":
            flat.update({f"drift_{figure}": d["drift"] for figure, d in value.items()})
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            flat[key] = value
    return flat
