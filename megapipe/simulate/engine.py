"""Timing a lowered schedule: each rank runs its order strictly in sequence.

An op starts when its rank is free and its one cross-op dependency (see
``program``) has finished, plus one p2p message when that dependency ran on
another rank. Ranks are advanced until they block; a finishing op wakes the rank
waiting for it, so every op is visited once (linear in the number of ops).
"""

from __future__ import annotations

from megapipe.errors import ScheduleError
from megapipe.schedules.base import Schedule
from megapipe.simulate.program import Program, lower
from megapipe.simulate.records import P2PCost, RankStats, SimResult, StageTimes

__all__ = ["simulate"]


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


def _execute(schedule: Schedule, program: Program, durations: list[list[float]], delays: list[list[float]]):
    """Start and end time of every op, by op id; raises ScheduleError on deadlock."""
    count = 3 * schedule.num_stages * schedule.num_microbatches
    start_at, end_at, waiter = [0.0] * count, [-1.0] * count, [-1] * count
    ranks = len(program.rank_ops)
    position, free = [0] * ranks, [0.0] * ranks
    ready = list(range(ranks))
    while ready:
        rank = ready.pop()
        ops, deps, times, waits = program.rank_ops[rank], program.deps[rank], durations[rank], delays[rank]
        index, now, length = position[rank], free[rank], len(ops)
        while index < length:
            dep = deps[index]
            if dep >= 0:
                arrival = end_at[dep]
                if arrival < 0.0:
                    waiter[dep] = rank
                    break
                arrival += waits[index]
                if arrival > now:
                    now = arrival
            op = ops[index]
            start_at[op] = now
            now += times[index]
            end_at[op] = now
            if waiter[op] >= 0:
                ready.append(waiter[op])
            index += 1
        position[rank], free[rank] = index, now
    stuck = [f"rank {r} at {schedule.orders[r][i]}" for r, i in enumerate(position) if i < len(program.rank_ops[r])]
    if stuck:
        raise ScheduleError(
            f"schedule {schedule.name} deadlocks: {', '.join(stuck)} each wait for an op that a blocked rank "
            "runs later; reorder the ops"
        )
    return start_at, end_at


def _critical_path(schedule: Schedule, program: Program, start_at, end_at, delays):
    """Walk back from the last op: to the dependency if it set the start, else to the rank's previous op."""
    m, s2r = schedule.num_microbatches, schedule.stage_to_rank
    last_ops = [(end_at[ops[-1]], rank) for rank, ops in enumerate(program.rank_ops) if ops]
    rank = max(last_ops)[1]
    index = len(program.rank_ops[rank]) - 1
    path = []
    while index >= 0:
        path.append(schedule.orders[rank][index])
        op, dep = program.rank_ops[rank][index], program.deps[rank][index]
        if dep >= 0 and start_at[op] > 0.0 and start_at[op] == end_at[dep] + delays[rank][index]:
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


def simulate(schedule: Schedule, times: StageTimes, *, p2p: P2PCost | None = None) -> SimResult:
    """Time ``schedule`` with per-layout-stage ``times`` and ``p2p`` message cost (zero when None)."""
    program = lower(schedule)
    duration_table, delay_table = _tables(schedule, times, p2p or P2PCost())
    durations = [[duration_table[code] for code in codes] for codes in program.time_codes]
    delays = [[delay_table[code] for code in codes] for codes in program.delay_codes]
    start_at, end_at = _execute(schedule, program, durations, delays)
    step = max((end_at[ops[-1]] for ops in program.rank_ops if ops), default=0.0)
    peak_bytes = _peak_bytes(program, times.act_bytes)
    stats, starts, ends = [], [], []
    for rank, ops in enumerate(program.rank_ops):
        busy = sum(durations[rank])
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
        steady_bubble_fraction=1.0 - busy_total / span_total if span_total else 0.0,
        ranks=tuple(stats), stage_peak_in_flight=program.stage_peak,
        critical_path=_critical_path(schedule, program, start_at, end_at, delays) if step else (),
        start_ms=tuple(starts), end_ms=tuple(ends),
    )
