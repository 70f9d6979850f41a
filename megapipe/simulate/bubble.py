"""Closed-form bubbles and the write-ups' bubble table, next to the simulated figures.

Closed forms (equal stages, no communication, T_F = T_B = T_W per chunk; a fused
backward costs B + W) live in each schedule's spec (``ScheduleSpec.flushed_bubble`` and
``steady_bubble``, with their sources); :func:`closed_form_bubble` reads them.

A popular write-up's table (GPipe 28.6%/48.5% at 8/32 stages, 1F1B 14.3%/24.2%,
interleaved 7.1%/12.1%, ZB1 3.5%/6.4%, ZB2 1.8%/3.5%) is reproduced by
``writeup_rows``; ``matching_microbatches`` finds which m (and v) each entry
could come from.
"""

from __future__ import annotations

from dataclasses import dataclass

from megapipe.errors import ScheduleError
from megapipe.schedules import SCHEDULE_NAMES, ScheduleName, build, chunks_per_rank, spec
from megapipe.simulate.engine import simulate
from megapipe.simulate.result import StageTimes

__all__ = [
    "WRITEUP_PERCENT",
    "BubbleRow",
    "closed_form_bubble",
    "bubble_rows",
    "matching_microbatches",
]

WRITEUP_PERCENT = {
    ScheduleName.gpipe: {8: 28.6, 32: 48.5},
    ScheduleName.one_f_one_b: {8: 14.3, 32: 24.2},
    ScheduleName.interleaved_1f1b: {8: 7.1, 32: 12.1},
    ScheduleName.zb_h1: {8: 3.5, 32: 6.4},
    ScheduleName.zb_h2: {8: 1.8, 32: 3.5},
}
"""Bubble percentages of the write-up's table, by schedule and pipeline stages."""


def closed_form_bubble(
    name: str, *, pipeline_model_parallel_size: int, num_microbatches: int,
    virtual_pipeline_model_parallel_size: int = 1, steady: bool = False,
) -> float | None:
    """Bubble fraction of wall time from the schedule spec's closed forms (F = B = W); None where none is published."""
    item = spec(name)
    form = item.steady_bubble if steady else item.flushed_bubble
    return form(pipeline_model_parallel_size, num_microbatches, virtual_pipeline_model_parallel_size)


@dataclass(frozen=True, slots=True, kw_only=True)
class BubbleRow:
    schedule: str
    virtual_pipeline_model_parallel_size: int
    closed_form: float | None
    """Flushed closed form (None where no paper gives one)."""
    simulated: float
    """Simulated flushed bubble fraction."""
    simulated_steady: float
    peak_in_flight: int
    """Peak microbatch-chunks of activations on the busiest rank."""
    writeup_percent: float | None
    error: str = ""
    """Why the schedule cannot run these sizes (then the numbers are 0)."""


def _row(name: str, pp: int, m: int, v: int) -> BubbleRow:
    chunks = chunks_per_rank(name, v)
    try:
        schedule = build(
            name, pipeline_model_parallel_size=pp, num_microbatches=m, virtual_pipeline_model_parallel_size=chunks
        )
    except ScheduleError as exc:
        return BubbleRow(
            schedule=name, virtual_pipeline_model_parallel_size=chunks, closed_form=None, simulated=0.0,
            simulated_steady=0.0, peak_in_flight=0, writeup_percent=WRITEUP_PERCENT.get(name, {}).get(pp),
            error=str(exc),
        )
    unit = 1.0 / chunks
    times = StageTimes.uniform(pp * chunks, fwd_ms=unit, input_grad_ms=unit, wgrad_ms=unit)
    result = simulate(schedule, times)
    return BubbleRow(
        schedule=name, virtual_pipeline_model_parallel_size=chunks,
        closed_form=closed_form_bubble(
            name, pipeline_model_parallel_size=pp, num_microbatches=m, virtual_pipeline_model_parallel_size=chunks
        ),
        simulated=result.bubble_fraction, simulated_steady=result.steady_bubble_fraction,
        peak_in_flight=max(rank.peak_in_flight for rank in result.ranks),
        writeup_percent=WRITEUP_PERCENT.get(name, {}).get(pp),
    )


def bubble_rows(
    *, pipeline_model_parallel_size: int, num_microbatches: int, virtual_pipeline_model_parallel_size: int = 2,
    schedules: tuple[str, ...] = SCHEDULE_NAMES,
) -> tuple[BubbleRow, ...]:
    """One row per schedule: closed form, simulated flushed and steady bubble, memory, write-up figure.

    Equal stages with T_F = T_B = T_W per microbatch of a whole rank (a chunk of a
    v-chunk rank takes 1/v of it). ``virtual_pipeline_model_parallel_size`` applies
    to interleaved_1f1b; V-shaped schedules always use 2 chunks.
    """
    return tuple(
        _row(name, pipeline_model_parallel_size, num_microbatches, virtual_pipeline_model_parallel_size)
        for name in schedules
    )


def matching_microbatches(
    percent: float, *, schedule: str, pipeline_model_parallel_size: int, max_microbatches: int = 4096,
    virtual_pipeline_model_parallel_size: int = 1, ideal: bool = False,
) -> tuple[int, ...]:
    """Microbatch counts m whose closed-form bubble rounds to ``percent`` (one decimal).

    ``ideal=True`` uses Megatron's (P-1)/(v*m) relative to ideal compute instead of
    the wall-time form; for ZB schedules the ideal form is (P-1)/(3m).
    """
    pp, v = pipeline_model_parallel_size, virtual_pipeline_model_parallel_size
    found = []
    for m in range(1, max_microbatches + 1):
        if ideal:
            work = 3 * m if spec(schedule).split_backward else v * m
            value = (pp - 1) / work
        else:
            value = closed_form_bubble(
                schedule, pipeline_model_parallel_size=pp, num_microbatches=m, virtual_pipeline_model_parallel_size=v
            )
        if value is not None and round(100 * value, 1) == round(percent, 1):
            found.append(m)
    return tuple(found)
