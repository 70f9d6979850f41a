"""Lowering a Schedule to flat arrays once: validation, dependencies, in-flight counts, execution order.

Op id = (stage * m + microbatch) * 3 + slot, slot 0 = F, 1 = I or B, 2 = W. Each op
keeps at most one dependency on another op: F waits for the upstream F, I/B for
the downstream I/B. The other dependencies (a stage's own F before its I/B, I
before W) sit on the same rank, so they hold exactly when they come earlier in
that rank's order; lowering checks that instead of timing them.

Whether an op can run before another depends only on this structure, never on the
times, so lowering also fixes one valid execution order (each rank advanced until
it waits for an op not yet run; a finished op wakes the rank waiting for it) and
detects deadlock there. Timing is then one pass over that order.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from megapipe.arrays import sorted_unique, unique_counts
from megapipe.errors import ScheduleError
from megapipe.schedules.base import KIND_CODE, Action, Kind, Schedule

__all__ = ["Program", "lower", "KIND_CODE"]

_SLOT = {Kind.F: 0, Kind.I: 1, Kind.B: 1, Kind.W: 2}


@dataclass(frozen=True, slots=True)
class Program:
    """Per rank, in order: op ids, time codes (stage * 4 + kind code) and the one cross-op dependency."""

    rank_ops: tuple[list[int], ...]
    time_codes: tuple[list[int], ...]
    deps: tuple[list[int], ...]
    delay_codes: tuple[list[int], ...]
    """stage * 2 (+1 for a backward): index of the receive delay into the stage."""
    stage_peak: tuple[int, ...]
    rank_peak: tuple[int, ...]
    act_deltas: tuple[tuple[int, ...], ...]
    """Per rank, per op: +1 for F, -1 for the op that releases its activations (B or W), else 0."""
    index_of: list[int]
    """Op id -> its position in its rank's order."""
    flat: tuple[list[int], list[int], list[int], list[int], list[int]]
    """Execution order: op ids, ranks, dependency op ids, time codes, delay codes."""
    code_counts: tuple[tuple[tuple[int, int], ...], ...]
    """Per rank: (time code, how many ops have it), so busy time is a short sum."""


def _fail(schedule: Schedule, rank: int, action: Action, problem: str) -> ScheduleError:
    return ScheduleError(f"schedule {schedule.name}: action {action} on rank {rank} is invalid: {problem}")


def _check_action(schedule: Schedule, rank: int, action: Action, kind_at: list, op: int) -> None:
    stage, m = action.stage, schedule.num_microbatches
    if not (0 <= stage < len(schedule.stage_to_rank) and 0 <= action.microbatch < m):
        raise _fail(schedule, rank, action, "its stage or microbatch is out of range")
    if schedule.stage_to_rank[stage] != rank:
        raise _fail(schedule, rank, action, f"stage {stage} lives on rank {schedule.stage_to_rank[stage]}")
    if kind_at[op] is not None:
        raise _fail(schedule, rank, action, "it occurs twice")
    base = op - _SLOT[action.kind]
    if action.kind is not Kind.F and kind_at[base] is None:
        raise _fail(schedule, rank, action, "its F comes later on this rank (deadlock)")
    if action.kind is Kind.W and kind_at[base + 1] is not Kind.I:
        raise _fail(schedule, rank, action, "W must follow its I on this rank (B is already fused)")


def _missing_op(schedule: Schedule, kind_at: list) -> str | None:
    m = schedule.num_microbatches
    for op in range(0, len(kind_at), 3):
        stage, mb = divmod(op // 3, m)
        if kind_at[op] is None:
            return f"F of stage {stage} microbatch {mb}"
        if kind_at[op + 1] is None:
            return f"backward (B or I) of stage {stage} microbatch {mb}"
        if kind_at[op + 1] is Kind.I and kind_at[op + 2] is None:
            return f"W of stage {stage} microbatch {mb}"
    return None


def _lower_rank(schedule: Schedule, rank: int, kind_at: list, stage_now: list, stage_peak: list, index_of: list):
    m, last = schedule.num_microbatches, schedule.num_stages - 1
    s2r, order = schedule.stage_to_rank, schedule.orders[rank]
    forward, input_grad, weight_grad = Kind.F, Kind.I, Kind.W
    ops, codes, deps, delays, changes = [], [], [], [], []
    held = peak = 0
    for index, action in enumerate(order):
        stage, kind = action.stage, action.kind
        base = (stage * m + action.microbatch) * 3
        slot = 0 if kind is forward else 2 if kind is weight_grad else 1
        op = base + slot
        if (
            not (0 <= stage <= last and 0 <= action.microbatch < m and s2r[stage] == rank and kind_at[op] is None)
            or (slot and kind_at[base] is None)
            or (slot == 2 and kind_at[base + 1] is not input_grad)
        ):
            _check_action(schedule, rank, action, kind_at, op)
        kind_at[op] = kind
        index_of[op] = index
        ops.append(op)
        if kind is forward:
            codes.append(stage * 4)
            deps.append(base - 3 * m if stage else -1)
            delays.append(stage * 2)
            held += 1
            stage_now[stage] += 1
            if held > peak:
                peak = held
            if stage_now[stage] > stage_peak[stage]:
                stage_peak[stage] = stage_now[stage]
            changes.append(1)
            continue
        codes.append(stage * 4 + (1 if kind is input_grad else 3 if slot == 2 else 2))
        deps.append(base + 3 * m + 1 if slot == 1 and stage < last else -1)
        delays.append(stage * 2 + 1)
        if kind is input_grad:
            changes.append(0)
        else:
            held -= 1
            stage_now[stage] -= 1
            changes.append(-1)
    return ops, codes, deps, delays, changes, peak


def _execution_order(schedule: Schedule, rank_ops, rank_deps) -> list[int]:
    """Every op's position in the ranks' orders laid end to end (rank r's index i is r's offset + i), in an order
    that respects all dependencies; raises on deadlock."""
    done = bytearray(3 * schedule.num_stages * schedule.num_microbatches)
    waiter = [-1] * len(done)
    position = [0] * len(rank_ops)
    offsets = [0] * len(rank_ops)
    for rank in range(1, len(rank_ops)):
        offsets[rank] = offsets[rank - 1] + len(rank_ops[rank - 1])
    ready, order = list(range(len(rank_ops))), []
    append = order.append
    while ready:
        rank = ready.pop()
        ops, deps, index, offset = rank_ops[rank], rank_deps[rank], position[rank], offsets[rank]
        count = len(ops)
        while index < count:
            dep = deps[index]
            if dep >= 0 and not done[dep]:
                waiter[dep] = rank
                break
            op = ops[index]
            done[op] = 1
            append(offset + index)
            if waiter[op] >= 0:
                ready.append(waiter[op])
            index += 1
        position[rank] = index
    stuck = [f"rank {r} at {schedule.orders[r][i]}" for r, i in enumerate(position) if i < len(rank_ops[r])]
    if stuck:
        raise ScheduleError(
            f"schedule {schedule.name} deadlocks: {', '.join(stuck)} each wait for an op that a blocked rank "
            "runs later; reorder the ops"
        )
    return order


def _flat(order: list[int], tables) -> tuple[list, ...]:
    """Each per-rank table (a list per rank, laid end to end) read in the execution order."""
    at = np.asarray(order, dtype=np.int64)
    return tuple(np.concatenate([np.asarray(rows, dtype=np.int64) for rows in table]).take(at).tolist()
                 if len(at) else [] for table in tables)


def lower(schedule: Schedule) -> Program:
    """Validate ``schedule`` and lower it; memoised on the schedule record. A builder's closed-form orders
    (``schedule.rank_ops``) are lowered with array operations and not checked action by action."""
    if isinstance(schedule.lowered, Program):
        return schedule.lowered
    program = _lower_closed_form(schedule) if schedule.rank_ops is not None else _lower_checked(schedule)
    object.__setattr__(schedule, "lowered", program)
    return program


def _lower_checked(schedule: Schedule) -> Program:
    stages = schedule.num_stages
    kind_at: list = [None] * (3 * stages * schedule.num_microbatches)
    stage_now, stage_peak, index_of = [0] * stages, [0] * stages, [0] * len(kind_at)
    per_rank = [
        _lower_rank(schedule, rank, kind_at, stage_now, stage_peak, index_of) for rank in range(len(schedule.orders))
    ]
    missing = _missing_op(schedule, kind_at)
    if missing:
        raise ScheduleError(f"schedule {schedule.name} never runs the {missing}; every op must occur once")
    ops, codes, deps, delays, changes, peaks = zip(*per_rank) if per_rank else ((),) * 6
    order = _execution_order(schedule, ops, deps)
    flat = _flat(order, (ops, [[r] * len(o) for r, o in enumerate(ops)], deps, codes, delays))
    program = Program(
        rank_ops=ops, time_codes=codes, deps=deps, delay_codes=delays, stage_peak=tuple(stage_peak),
        rank_peak=tuple(peaks), act_deltas=changes, index_of=index_of, flat=flat,
        code_counts=tuple(tuple(sorted(Counter(rank_codes).items())) for rank_codes in codes),
    )
    return program


def _lower_closed_form(schedule: Schedule) -> Program:
    """:func:`_lower_checked`'s program from the builder's plain tuples: the same op ids, codes, dependencies,
    delays, activation changes and peaks, computed per rank on arrays."""
    m, last = schedule.num_microbatches, schedule.num_stages - 1
    index_of = np.zeros(3 * schedule.num_stages * m, dtype=np.int64)
    stage_peak = [0] * schedule.num_stages
    per_rank = []
    for ops in schedule.rank_ops:
        kinds, stages = np.asarray(ops.kinds), np.asarray(ops.stages)
        base = (stages * m + np.asarray(ops.microbatches)) * 3
        forward, weight_grad = kinds == KIND_CODE[Kind.F], kinds == KIND_CODE[Kind.W]
        op = base + np.where(forward, 0, np.where(weight_grad, 2, 1))
        deps = np.where(forward, np.where(stages > 0, base - 3 * m, -1),
                        np.where(weight_grad | (stages == last), -1, base + 3 * m + 1))
        changes = np.where(forward, 1, np.where(kinds == KIND_CODE[Kind.I], 0, -1))
        index_of[op] = np.arange(len(op))
        held = np.cumsum(changes)
        for stage in sorted_unique(stages).tolist():
            stage_peak[stage] = max(stage_peak[stage], int(np.cumsum(np.where(stages == stage, changes, 0)).max()))
        codes = stages * 4 + kinds
        found, counts = unique_counts(codes)
        per_rank.append((op.tolist(), codes.tolist(), deps.tolist(), (stages * 2 + ~forward).tolist(),
                         tuple(changes.tolist()), max(0, int(held.max(initial=0))),
                         tuple(zip(found.tolist(), counts.tolist()))))
    ops, codes, deps, delays, changes, peaks, code_counts = zip(*per_rank)
    order = _execution_order(schedule, ops, deps)
    flat = _flat(order, (ops, [[r] * len(o) for r, o in enumerate(ops)], deps, codes, delays))
    return Program(rank_ops=ops, time_codes=codes, deps=deps, delay_codes=delays, stage_peak=tuple(stage_peak),
                   rank_peak=tuple(peaks), act_deltas=changes, index_of=index_of.tolist(), flat=flat,
                   code_counts=code_counts)
