"""Timing a lowered schedule: each rank runs its order strictly in sequence.

An op starts when its rank is free and its one cross-op dependency (see
``program``) has finished, plus one p2p message when that dependency ran on
another rank. Ops are timed in the execution order fixed at lowering, so every op
is visited once (linear in the number of ops) and deadlocks were already caught.
"""

from __future__ import annotations

from megapipe.errors import ScheduleError
from megapipe.schedules.base import Schedule
from megapipe.simulate.program import Program, lower
from megapipe.simulate.result import P2PCost, RankStats, SimResult, StageTimes

__all__ = ["simulate", "step_time_ms"]


def _tables(schedule: Schedule, times: StageTimes, p2p: P2PCost) -> tuple[list[float], list[float]]:
    """Op time per (stage * 4 + kind code) and receive delay per (stage * 2 + is_backward)."""
    stages = schedule.num_stages
    if len(times.fwd_ms) != stages:
        raise ScheduleError(
            f"StageTimes has {len(times.fwd_ms)} stages but schedule {schedule.name} has {stages} layout stages "
            "(pipeline_model_parallel_size * model chunks per rank)"
        )
    if p2p.boundary_ms is not None and len(p2p.boundary_ms) != schedule.pipeline_model_parallel_size - 1:
        raise ScheduleError(
            f"P2PCost.boundary_ms has {len(p2p.boundary_ms)} entries; give pipeline_model_parallel_size - 1 "
            f"= {schedule.pipeline_model_parallel_size - 1}"
        )
    durations: list[float] = []
    for fwd, bwd, wgrad in zip(times.fwd_ms, times.bwd_ms, times.wgrad_ms):
        durations += [fwd, bwd - wgrad, bwd, wgrad]
    s2r = schedule.stage_to_rank
    delays: list[float] = []
    for stage in range(stages):
        delays.append(p2p.between(s2r[stage - 1], s2r[stage]) if stage else 0.0)
        delays.append(p2p.between(s2r[stage + 1], s2r[stage]) if stage < stages - 1 else 0.0)
    return durations, delays


def _execute(schedule: Schedule, program: Program, duration_table: list[float], delay_table: list[float]):
    """Start and end time of every op, by op id, in the lowered execution order."""
    ops, ranks, deps, codes, delay_codes = program.flat
    count = 3 * schedule.num_stages * schedule.num_microbatches
    start_at, end_at = [0.0] * count, [0.0] * count
    free = [0.0] * len(program.rank_ops)
    durations = [duration_table[code] for code in codes]
    delays = [delay_table[code] for code in delay_codes]
    for op, rank, dep, duration, delay in zip(ops, ranks, deps, durations, delays):
        now = free[rank]
        if dep >= 0:
            arrival = end_at[dep] + delay
            if arrival > now:
                now = arrival
        start_at[op] = now
        now += duration
        end_at[op] = now
        free[rank] = now
    return start_at, end_at


def _critical_path(schedule: Schedule, program: Program, start_at, end_at, delay_table):
    """Walk back from the last op: to the dependency if it set the start, else to the rank's previous op."""
    m, s2r = schedule.num_microbatches, schedule.stage_to_rank
    last_ops = [(end_at[ops[-1]], rank) for rank, ops in enumerate(program.rank_ops) if ops]
    rank = max(last_ops)[1]
    index = len(program.rank_ops[rank]) - 1
    path = []
    while index >= 0:
        path.append((rank, index))
        op, dep = program.rank_ops[rank][index], program.deps[rank][index]
        arrival = end_at[dep] + delay_table[program.delay_codes[rank][index]] if dep >= 0 else -1.0
        if start_at[op] > 0.0 and start_at[op] == arrival:
            rank, index = s2r[dep // 3 // m], program.index_of[dep]
        elif index > 0 and start_at[op] == end_at[program.rank_ops[rank][index - 1]]:
            index -= 1
        else:
            break
    return tuple(reversed(path))


def _peak_bytes(program: Program, act_bytes: tuple[float, ...] | None) -> list[float]:
    if not act_bytes:
        return [0.0] * len(program.rank_ops)
    peaks = []
    for codes, deltas in zip(program.time_codes, program.act_deltas):
        held = peak = 0.0
        for code, delta in zip(codes, deltas):
            if delta:
                held += delta * act_bytes[code >> 2]
                if held > peak:
                    peak = held
        peaks.append(peak)
    return peaks


def step_time_ms(schedule: Schedule, times: StageTimes, *, p2p: P2PCost | None = None) -> float:
    """:func:`simulate`'s step time alone (what a fit re-evaluates many times): the same ops, the same order."""
    program = lower(schedule)
    duration_table, delay_table = _tables(schedule, times, p2p or P2PCost())
    _, end_at = _execute(schedule, program, duration_table, delay_table)
    return max((end_at[ops[-1]] for ops in program.rank_ops if ops), default=0.0)


def simulate(schedule: Schedule, times: StageTimes, *, p2p: P2PCost | None = None) -> SimResult:
    """Time ``schedule`` with per-layout-stage ``times`` and ``p2p`` message cost (zero when None)."""
    program = lower(schedule)
    duration_table, delay_table = _tables(schedule, times, p2p or P2PCost())
    start_at, end_at = _execute(schedule, program, duration_table, delay_table)
    step = max((end_at[ops[-1]] for ops in program.rank_ops if ops), default=0.0)
    peak_bytes = _peak_bytes(program, times.act_bytes)
    stats, starts, ends = [], [], []
    for rank, ops in enumerate(program.rank_ops):
        busy = min(step, sum(duration_table[code] * count for code, count in program.code_counts[rank]))
        span = end_at[ops[-1]] - start_at[ops[0]] if ops else 0.0
        stats.append(RankStats(
            rank=rank, busy_ms=busy, idle_ms=step - busy, bubble_fraction=(step - busy) / step if step else 0.0,
            span_ms=span, peak_in_flight=program.rank_peak[rank], peak_activation_bytes=peak_bytes[rank],
        ))
        starts.append(tuple([start_at[op] for op in ops]))
        ends.append(tuple([end_at[op] for op in ops]))
    busy_total, span_total = sum(s.busy_ms for s in stats), sum(s.span_ms for s in stats)
    return SimResult(
        schedule=schedule, step_time_ms=step,
        bubble_fraction=1.0 - busy_total / (len(stats) * step) if step else 0.0,
        steady_bubble_fraction=max(0.0, 1.0 - busy_total / span_total) if span_total else 0.0,
        ranks=tuple(stats), stage_peak_in_flight=program.stage_peak,
        critical_steps=_critical_path(schedule, program, start_at, end_at, delay_table) if step else (),
        start_ms=tuple(starts), end_ms=tuple(ends),
    )
