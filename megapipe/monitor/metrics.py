"""Pure derivation of schedule metrics from timer intervals (no torch, no I/O).

The schedule hook records, per ``forward-backward`` step, intervals
``(start_ms, end_ms, kind)`` for the timers megatron-core's schedules open
(``forward-compute``, ``backward-compute`` and the p2p timers). This module turns
them into per-rank :class:`StepMetrics`, packs those into one fixed-size row for
a single all-gather over the pipeline group, and combines the gathered rows into
a :class:`PipelineMetrics`.

Definitions (per rank and step, following Narayanan et al. 2021, "Efficient
Large-Scale Language Model Training on GPU Clusters", Sec. 2.2):

* ``wall_ms`` = the ``forward-backward`` interval;
* ``bubble_ms`` = ``wall_ms`` - forward compute - backward compute (the time the
  rank's compute is idle: p2p wait plus anything else between compute calls);
* ``p2p_wait_ms`` = send + recv + exchange timers; a combined send+recv timer
  (e.g. ``forward-send-backward-recv``) is an *exchange*: it returns only when the
  peer's tensor has arrived, so it cannot be split into its send and recv parts;
* ``other_ms`` = ``wall_ms`` - compute - p2p wait (Python between timers, the
  gradient finalisation inside ``forward-backward``);
* warm-up idle = non-compute time before the first backward starts; cool-down
  idle = non-compute time after the last forward ends;
* ``dispatch_ms`` = the median non-compute stretch before a compute call (p2p
  timers plus untimed Python between them): what the rank spends per op when its
  input is already there. Most stretches are of that kind; the long ones are waits
  on a neighbour, which the simulator derives from the schedule itself, so the
  median leaves them out (the torch-pipelining validation in docs/validation.md
  charges each op the same kind of overhead).

Interleaved schedules: the i-th forward on a rank belongs to the model chunk of
megatron-core's schedule table (``get_schedule_table``: groups of
``microbatch_group_size_per_vp_stage`` microbatches, all chunks of a group in
order), and the i-th backward to chunk ``num_model_chunks - 1 -`` that chunk.
"""

from __future__ import annotations

import enum
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "EventKind",
    "TIMER_KINDS",
    "StepMetrics",
    "PipelineMetrics",
    "schedule_chunks",
    "derive_step",
    "mean_steps",
    "pack_row",
    "unpack_row",
    "row_size",
    "combine_rows",
]


class EventKind(enum.IntEnum):
    forward = 0
    backward = 1
    send = 2
    recv = 3
    exchange = 4


TIMER_KINDS: dict[str, EventKind] = {
    "forward-compute": EventKind.forward,
    "backward-compute": EventKind.backward,
    "forward-send": EventKind.send,
    "backward-send": EventKind.send,
    "forward-recv": EventKind.recv,
    "backward-recv": EventKind.recv,
    "forward-send-backward-recv": EventKind.exchange,
    "backward-send-forward-recv": EventKind.exchange,
    "forward-send-forward-recv": EventKind.exchange,
    "backward-send-backward-recv": EventKind.exchange,
    "forward-backward-send-forward-backward-recv": EventKind.exchange,
}
"""megatron-core 0.16.1 timer names (schedules.py, p2p_communication.py) and their kind."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StepMetrics:
    """One rank's view of one or more ``forward-backward`` steps (means when several)."""

    wall_ms: float
    forward_ms: float
    backward_ms: float
    send_ms: float
    recv_ms: float
    exchange_ms: float
    warmup_idle_ms: float
    cooldown_idle_ms: float
    max_gap_ms: float
    """Longest idle gap before a compute call (from step start or the previous compute end)."""
    num_forward: float
    num_backward: float
    chunk_forward_ms: tuple[float, ...]
    """Per model chunk on this rank: mean forward time per microbatch."""
    chunk_backward_ms: tuple[float, ...]
    gaps_ms: tuple[float, ...] = ()
    """Idle gap before each compute call in order (single steps only)."""
    num_steps: int = 1
    dispatch_ms: float = 0.0
    """Median of the gaps before compute calls: per-op overhead of a rank whose input is ready."""

    @property
    def compute_ms(self) -> float:
        return self.forward_ms + self.backward_ms

    @property
    def p2p_wait_ms(self) -> float:
        return self.send_ms + self.recv_ms + self.exchange_ms

    @property
    def bubble_ms(self) -> float:
        return self.wall_ms - self.compute_ms

    @property
    def bubble_fraction(self) -> float:
        return self.bubble_ms / self.wall_ms if self.wall_ms > 0 else 0.0

    @property
    def other_ms(self) -> float:
        return self.wall_ms - self.compute_ms - self.p2p_wait_ms


@dataclass(frozen=True, slots=True, kw_only=True)
class PipelineMetrics:
    """All pipeline ranks combined; virtual stages in Megatron's vp-major order."""

    pipeline_model_parallel_size: int
    num_model_chunks: int
    num_microbatches: int
    num_steps: int
    ranks: tuple[StepMetrics, ...]
    stage_forward_ms: tuple[float, ...]
    """Per virtual stage (index vp * pp + rank): mean forward time per microbatch."""
    stage_backward_ms: tuple[float, ...]

    @property
    def rank_compute_ms(self) -> tuple[float, ...]:
        return tuple(r.compute_ms for r in self.ranks)

    @property
    def compute_spread_ms(self) -> float:
        """max - min per-rank compute per step: the imbalance a better layout removes."""
        return max(self.rank_compute_ms) - min(self.rank_compute_ms)

    @property
    def dispatch_ms(self) -> float:
        """Per-op dispatch overhead of the pipeline: the smallest rank's median stretch (see predict.py)."""
        return min(r.dispatch_ms for r in self.ranks)

    @property
    def makespan_ms(self) -> float:
        """The longest rank's ``forward-backward`` wall (ranks start together after the previous gather)."""
        return max(r.wall_ms for r in self.ranks)

    @property
    def bubble_fraction(self) -> float:
        """1 - total compute / (pp * makespan): the idle share of the pipeline's device time."""
        total = self.pipeline_model_parallel_size * self.makespan_ms
        return 1.0 - sum(self.rank_compute_ms) / total if total > 0 else 0.0


def schedule_chunks(*, num_microbatches: int, num_model_chunks: int, microbatch_group_size: int) -> tuple[int, ...]:
    """Model chunk of each forward, in execution order (megatron-core's ``get_schedule_table``)."""
    chunks: list[int] = []
    group = max(1, microbatch_group_size)
    for first in range(0, num_microbatches, group):
        size = min(group, num_microbatches - first)
        for chunk in range(num_model_chunks):
            chunks.extend([chunk] * size)
    return tuple(chunks)


def _chunk_means(durations: list[float], chunks: Sequence[int], num_model_chunks: int) -> tuple[float, ...]:
    sums = [0.0] * num_model_chunks
    counts = [0] * num_model_chunks
    for duration, chunk in zip(durations, chunks):
        sums[chunk] += duration
        counts[chunk] += 1
    return tuple(s / c if c else 0.0 for s, c in zip(sums, counts))


def derive_step(
    *,
    step_start: float,
    step_end: float,
    starts: Sequence[float],
    ends: Sequence[float],
    kinds: Sequence[int],
    num_model_chunks: int = 1,
    microbatch_group_size: int = 1,
) -> StepMetrics:
    """Metrics of one step from its intervals (times in ms, intervals in start order)."""
    totals = [0.0] * len(EventKind)
    forward_durations: list[float] = []
    backward_durations: list[float] = []
    gaps: list[float] = []
    last_compute_end = step_start
    first_backward_start = step_end
    last_forward_end = step_start
    compute_before_first_backward = 0.0
    for start, end, kind in zip(starts, ends, kinds):
        duration = end - start
        totals[kind] += duration
        if kind == EventKind.forward or kind == EventKind.backward:
            gaps.append(max(0.0, start - last_compute_end))
            last_compute_end = end
            if kind == EventKind.forward:
                forward_durations.append(duration)
                last_forward_end = end
                if first_backward_start == step_end:
                    compute_before_first_backward += duration
            else:
                backward_durations.append(duration)
                first_backward_start = min(first_backward_start, start)
    compute_after_last_forward = sum(
        end - start for start, end, kind in zip(starts, ends, kinds) if kind == EventKind.backward and start >= last_forward_end
    )
    num_forward, num_backward = len(forward_durations), len(backward_durations)
    chunk_of_forward = _forward_chunks(num_forward, num_model_chunks, microbatch_group_size)
    chunk_of_backward = tuple(num_model_chunks - 1 - c for c in _forward_chunks(num_backward, num_model_chunks, microbatch_group_size))
    return StepMetrics(
        wall_ms=step_end - step_start,
        forward_ms=totals[EventKind.forward],
        backward_ms=totals[EventKind.backward],
        send_ms=totals[EventKind.send],
        recv_ms=totals[EventKind.recv],
        exchange_ms=totals[EventKind.exchange],
        warmup_idle_ms=max(0.0, first_backward_start - step_start - compute_before_first_backward),
        cooldown_idle_ms=max(0.0, step_end - last_forward_end - compute_after_last_forward) if num_forward else 0.0,
        max_gap_ms=max(gaps + [max(0.0, step_end - last_compute_end)]),
        num_forward=float(num_forward),
        num_backward=float(num_backward),
        chunk_forward_ms=_chunk_means(forward_durations, chunk_of_forward, num_model_chunks),
        chunk_backward_ms=_chunk_means(backward_durations, chunk_of_backward, num_model_chunks),
        gaps_ms=tuple(gaps),
        dispatch_ms=statistics.median(gaps) if gaps else 0.0,
    )


def _forward_chunks(count: int, num_model_chunks: int, microbatch_group_size: int) -> tuple[int, ...]:
    if num_model_chunks == 1 or count % num_model_chunks:
        return (0,) * count if num_model_chunks == 1 else tuple(i % num_model_chunks for i in range(count))
    return schedule_chunks(
        num_microbatches=count // num_model_chunks,
        num_model_chunks=num_model_chunks,
        microbatch_group_size=microbatch_group_size,
    )


_SCALARS = (
    "wall_ms",
    "forward_ms",
    "backward_ms",
    "send_ms",
    "recv_ms",
    "exchange_ms",
    "warmup_idle_ms",
    "cooldown_idle_ms",
    "max_gap_ms",
    "num_forward",
    "num_backward",
    "dispatch_ms",
)


def mean_steps(steps: Sequence[StepMetrics]) -> StepMetrics:
    """Field-wise mean of several steps of one rank (max for ``max_gap_ms``)."""
    count = len(steps)
    values = {name: sum(getattr(s, name) for s in steps) / count for name in _SCALARS}
    values["max_gap_ms"] = max(s.max_gap_ms for s in steps)
    chunks = len(steps[0].chunk_forward_ms)
    return StepMetrics(
        **values,
        chunk_forward_ms=tuple(sum(s.chunk_forward_ms[c] for s in steps) / count for c in range(chunks)),
        chunk_backward_ms=tuple(sum(s.chunk_backward_ms[c] for s in steps) / count for c in range(chunks)),
        gaps_ms=steps[0].gaps_ms if count == 1 else (),
        num_steps=sum(s.num_steps for s in steps),
    )


def row_size(num_model_chunks: int) -> int:
    """Length of the gathered row: valid flag, step count, the scalars, two values per chunk."""
    return 2 + len(_SCALARS) + 2 * num_model_chunks


def pack_row(metrics: StepMetrics | None, num_model_chunks: int) -> list[float]:
    """Row for the all-gather; ``None`` (a rank whose hook faulted) packs as an invalid row."""
    if metrics is None:
        return [0.0] * row_size(num_model_chunks)
    return [
        1.0,
        float(metrics.num_steps),
        *(float(getattr(metrics, name)) for name in _SCALARS),
        *metrics.chunk_forward_ms,
        *metrics.chunk_backward_ms,
    ]


def unpack_row(row: Sequence[float], num_model_chunks: int) -> StepMetrics | None:
    if row[0] != 1.0:
        return None
    scalars = dict(zip(_SCALARS, row[2 : 2 + len(_SCALARS)]))
    offset = 2 + len(_SCALARS)
    return StepMetrics(
        **scalars,
        chunk_forward_ms=tuple(row[offset : offset + num_model_chunks]),
        chunk_backward_ms=tuple(row[offset + num_model_chunks : offset + 2 * num_model_chunks]),
        num_steps=int(row[1]),
    )


def combine_rows(ranks: Sequence[StepMetrics], *, num_model_chunks: int) -> PipelineMetrics:
    """Per-rank metrics (in pipeline-rank order) -> the pipeline's view."""
    pp = len(ranks)
    stage_forward = [0.0] * (pp * num_model_chunks)
    stage_backward = [0.0] * (pp * num_model_chunks)
    for rank, metrics in enumerate(ranks):
        for chunk in range(num_model_chunks):
            stage_forward[chunk * pp + rank] = metrics.chunk_forward_ms[chunk]
            stage_backward[chunk * pp + rank] = metrics.chunk_backward_ms[chunk]
    return PipelineMetrics(
        pipeline_model_parallel_size=pp,
        num_model_chunks=num_model_chunks,
        num_microbatches=round(ranks[0].num_forward / num_model_chunks),
        num_steps=ranks[0].num_steps,
        ranks=tuple(ranks),
        stage_forward_ms=tuple(stage_forward),
        stage_backward_ms=tuple(stage_backward),
    )
