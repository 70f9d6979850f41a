"""Interleaved 1F1B in Megatron's order (Narayanan et al. 2021, virtual pipeline stages).

Reproduces ``forward_backward_pipelining_with_interleaving`` of megatron-core
0.16.1 (``get_schedule_table`` and ``get_pp_rank_microbatches``):

* virtual microbatch k of rank r runs (microbatch, chunk) = table[k], where the
  table walks microbatch groups of ``microbatch_group_size_per_vp_stage``
  (default P) and, inside a group, every chunk over the group's microbatches;
* backward k uses the same table with the chunk mirrored (v - 1 - chunk);
* warm-up = min(m*v, 2*(P - r - 1) + (v - 1) * group), then 1F1B steady state,
  then cool-down backwards. Backwards are fused (kind ``B``).

Megatron's checks are kept: v >= 2, P <= group <= m, and the last group is
either full or at least P microbatches (with the default group = P this means
m % P == 0).
"""

from __future__ import annotations

import numpy as np

from megapipe.errors import ScheduleError
from megapipe.schedules.base import KIND_CODE, Action, Kind, RankOps, loop_stage, warmup_steady_cooldown
from megapipe.schedules.in_flight import interleaved_in_flight, table_chunks
from megapipe.schedules.spec import ScheduleName, ScheduleSpec

__all__ = ["SPEC", "interleaved_orders", "schedule_table", "check_interleaved", "interleaved_sizes_ok",
           "interleaved_rank_counts", "interleaved_rank_ops"]


def schedule_table(
    *, num_microbatches: int, num_model_chunks: int, microbatch_group_size_per_vp_stage: int
) -> tuple[tuple[int, int], ...]:
    """Megatron's ``get_schedule_table``: (microbatch, chunk) per virtual microbatch id."""
    table: list[tuple[int, int]] = []
    group = microbatch_group_size_per_vp_stage
    for first in range(0, num_microbatches, group):
        last = min(first + group, num_microbatches)
        table.extend((mb, chunk) for chunk in range(num_model_chunks) for mb in range(first, last))
    return tuple(table)


def check_interleaved(
    *, pipeline_model_parallel_size: int, num_microbatches: int, virtual_pipeline_model_parallel_size: int,
    microbatch_group_size_per_vp_stage: int,
) -> None:
    pp, m, v, group = (
        pipeline_model_parallel_size, num_microbatches, virtual_pipeline_model_parallel_size,
        microbatch_group_size_per_vp_stage,
    )
    if v < 2:
        raise ScheduleError(
            f"interleaved_1f1b needs virtual_pipeline_model_parallel_size >= 2, got {v}; "
            "set parallel.virtual_pipeline_model_parallel_size=2 or use schedule=1f1b"
        )
    if pp < 2:
        raise ScheduleError(
            f"interleaved_1f1b needs pipeline_model_parallel_size >= 2, got {pp}; use schedule=1f1b"
        )
    if not pp <= group <= m:
        raise ScheduleError(
            f"interleaved_1f1b: microbatch_group_size_per_vp_stage={group} must lie in "
            f"[pipeline_model_parallel_size={pp}, num_microbatches={m}]; raise num_microbatches to >= {pp}"
        )
    remainder = m % group
    if 0 < remainder < pp:
        raise ScheduleError(
            f"interleaved_1f1b: num_microbatches={m} % microbatch_group_size_per_vp_stage={group} = {remainder} "
            f"must be 0 or >= pipeline_model_parallel_size={pp} (Megatron rejects it); "
            f"use num_microbatches={m - remainder + group} or a multiple of {group}"
        )


def _rank_order(rank: int, pp: int, m: int, v: int, group: int, table) -> tuple[Action, ...]:
    total = m * v
    warmup = min(total, 2 * (pp - rank - 1) + (v - 1) * group)

    def forward(k: int) -> Action:
        mb, chunk = table[k]
        return Action(rank, Kind.F, mb, chunk, loop_stage(rank, chunk, pp))

    def backward(k: int) -> Action:
        mb, chunk = table[k]
        chunk = v - 1 - chunk
        return Action(rank, Kind.B, mb, chunk, loop_stage(rank, chunk, pp))

    order = [forward(k) for k in range(warmup)]
    for k in range(total - warmup):
        order.append(forward(warmup + k))
        order.append(backward(k))
    order.extend(backward(k) for k in range(total - warmup, total))
    return tuple(order)


def interleaved_orders(
    *, pipeline_model_parallel_size: int, num_microbatches: int, virtual_pipeline_model_parallel_size: int,
    microbatch_group_size_per_vp_stage: int,
) -> tuple[tuple[Action, ...], ...]:
    check_interleaved(
        pipeline_model_parallel_size=pipeline_model_parallel_size, num_microbatches=num_microbatches,
        virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
        microbatch_group_size_per_vp_stage=microbatch_group_size_per_vp_stage,
    )
    table = schedule_table(
        num_microbatches=num_microbatches, num_model_chunks=virtual_pipeline_model_parallel_size,
        microbatch_group_size_per_vp_stage=microbatch_group_size_per_vp_stage,
    )
    return tuple(
        _rank_order(
            rank, pipeline_model_parallel_size, num_microbatches, virtual_pipeline_model_parallel_size,
            microbatch_group_size_per_vp_stage, table,
        )
        for rank in range(pipeline_model_parallel_size)
    )


def interleaved_rank_counts(pp: int, m: int, v: int, group: int) -> tuple[np.ndarray, ...]:
    """Per rank, the in-flight microbatches of each of its chunks right after its forwards (rows) that can be a
    peak, from the same warm-up / steady / cool-down order as :func:`_rank_order`, without building the actions:
    the last warm-up forward (counts only grow until then) and every steady one (each adds a microbatch and
    the backward before it removed one); the cool-down runs no forward."""
    chunks = table_chunks(m, v, group)
    total = m * v
    forwards = np.zeros((total + 1, v), dtype=np.int64)  # forwards[x, c]: chunk-c entries among the first x
    forwards[1:] = np.cumsum(np.eye(v, dtype=np.int64)[chunks], axis=0)
    backwards = forwards[:, ::-1]  # the k-th backward runs table entry k on chunk v - 1 - its chunk
    out = []
    for rank in range(pp):
        warmup = min(total, 2 * (pp - rank - 1) + (v - 1) * group)
        steady = np.arange(total - warmup)
        rows = np.concatenate([forwards[max(warmup, 1):warmup + 1], forwards[warmup + 1 + steady] - backwards[steady]])
        out.append(rows)
    return tuple(out)


def interleaved_rank_ops(pp: int, m: int, v: int, group: int) -> tuple[RankOps, ...]:
    """:func:`interleaved_orders` as :class:`RankOps`, without building the actions (sizes already checked)."""
    table = np.array(schedule_table(num_microbatches=m, num_model_chunks=v, microbatch_group_size_per_vp_stage=group))
    total = m * v
    out = []
    for rank in range(pp):
        backward, k = warmup_steady_cooldown(min(total, 2 * (pp - rank - 1) + (v - 1) * group), total)
        chunk = np.where(backward == 1, v - 1 - table[k, 1], table[k, 1])
        kinds = backward * (KIND_CODE[Kind.B] - KIND_CODE[Kind.F]) + KIND_CODE[Kind.F]
        out.append(RankOps(kinds=tuple(kinds.tolist()), stages=tuple((chunk * pp + rank).tolist()),
                           microbatches=tuple(table[k, 0].tolist())))
    return tuple(out)


def interleaved_sizes_ok(pp: int, m: int, v: int, group: int) -> bool:
    """The sizes :func:`check_interleaved` accepts, without raising."""
    return v >= 2 and pp >= 2 and pp <= group <= m and not 0 < m % group < pp


SPEC = ScheduleSpec(
    name=ScheduleName.interleaved_1f1b,
    summary="interleaved 1F1B (Narayanan et al. 2021): v model chunks per rank in Megatron's vp-major order",
    orders=lambda pp, m, v, group: interleaved_orders(
        pipeline_model_parallel_size=pp, num_microbatches=m, virtual_pipeline_model_parallel_size=v,
        microbatch_group_size_per_vp_stage=group),
    fixed_chunks=None,
    megatron_function="forward_backward_pipelining_with_interleaving",
    torch_class="ScheduleInterleaved1F1B",
    # (P-1)/(v m + P-1) of wall time (Narayanan et al. 2021, sec. 2.2).
    flushed_bubble=lambda pp, m, v: (pp - 1) / (v * m + pp - 1),
    in_flight=interleaved_in_flight,
    sizes_ok=interleaved_sizes_ok,
    rank_counts=interleaved_rank_counts,
    rank_ops=interleaved_rank_ops,
)
