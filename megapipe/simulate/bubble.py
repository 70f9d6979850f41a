"""Closed-form bubbles and the write-ups' bubble table, next to the simulated figures.

Closed forms (equal stages, no communication, T_F = T_B = T_W per chunk; a fused
backward costs B + W):

* GPipe and 1F1B: (P-1)/(m+P-1) of wall time (Huang et al. 2019; Narayanan et al.
  2021 give (P-1)/m relative to ideal compute). Same bubble; GPipe holds m
  microbatches of activations, 1F1B at most P.
* Interleaved 1F1B with v chunks per rank: (P-1)/(v*m+P-1) (Narayanan et al. 2021).
* ZB-H1: idle (P-1)(F+B-W) per stage, i.e. (P-1)/(3m+P-1) (Qi et al. 2024).
* ZB-H2: steady-state idle (P-1)(F+B-2W) = 0; with a flush it equals ZB-H1.
* ZB-V: zero steady-state bubble at 1F1B memory (Qi et al. 2024, Sec. 6).
* DualPipe (DeepSeek-V3 report): idle (P-1)(F&B+B-3W) with P = ranks of the V,
  B the full backward and F&B the overlapped pair; megapipe runs F then B, so
  F&B = F+B and the figure is an upper bound for the simulated DualPipeV idle.

A popular write-up's table (GPipe 28.6%/48.5% at 8/32 stages, 1F1B 14.3%/24.2%,
interleaved 7.1%/12.1%, ZB1 3.5%/6.4%, ZB2 1.8%/3.5%) is reproduced by
``writeup_rows``; ``matching_microbatches`` finds which m (and v) each entry
could come from.
"""

from __future__ import annotations

from dataclasses import dataclass

from megapipe.errors import ScheduleError
from megapipe.schedules import SCHEDULE_NAMES, build, chunks_per_rank
from megapipe.simulate.engine import simulate
from megapipe.simulate.records import StageTimes

__all__ = [
    "WRITEUP_PERCENT",
    "BubbleRow",
    "closed_form_bubble",
    "bubble_rows",
    "matching_microbatches",
]

WRITEUP_PERCENT = {
    "gpipe": {8: 28.6, 32: 48.5},
    "1f1b": {8: 14.3, 32: 24.2},
    "interleaved_1f1b": {8: 7.1, 32: 12.1},
    "zb_h1": {8: 3.5, 32: 6.4},
    "zb_h2": {8: 1.8, 32: 3.5},
}
"""Bubble percentages of the write-up's table, by schedule and pipeline stages."""


def closed_form_bubble(
    name: str, *, pipeline_model_parallel_size: int, num_microbatches: int,
    virtual_pipeline_model_parallel_size: int = 1, steady: bool = False,
) -> float | None:
    """Bubble fraction of wall time from the papers' closed forms (F = B = W); None where none is published."""
    pp, m, v = pipeline_model_parallel_size, num_microbatches, virtual_pipeline_model_parallel_size
    if name in ("gpipe", "1f1b") and not steady:
        return (pp - 1) / (m + pp - 1)
    if name == "interleaved_1f1b" and not steady:
        return (pp - 1) / (v * m + pp - 1)
    if name == "zb_h1" and not steady:
        return (pp - 1) / (3 * m + pp - 1)
    if name == "zb_h2":
        return 0.0 if steady else (pp - 1) / (3 * m + pp - 1)
    if name == "zb_v" and steady:
        return 0.0
    if name not in SCHEDULE_NAMES:
        raise ScheduleError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULE_NAMES)}")
    return None


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
            work = 3 * m if schedule in ("zb_h1", "zb_h2") else v * m
            value = (pp - 1) / work
        else:
            value = closed_form_bubble(
                schedule, pipeline_model_parallel_size=pp, num_microbatches=m, virtual_pipeline_model_parallel_size=v
            )
        if value is not None and round(100 * value, 1) == round(percent, 1):
            found.append(m)
    return tuple(found)
