"""1F1B (PipeDream-Flush) in Megatron's order.

Reproduces ``forward_backward_pipelining_without_interleaving`` of megatron-core
0.16.1: rank r runs ``min(P - r - 1, m)`` warm-up forwards, then ``m - warmup``
steady steps of one forward followed by one full backward, then the remaining
backwards (cool-down). Backwards use Megatron's fused backward (kind ``B``).
"""

from __future__ import annotations

from megapipe.schedules.base import KIND_CODE, Action, Kind, RankOps, warmup_steady_cooldown
from megapipe.schedules.spec import InFlightFloor, PathShare, ScheduleName, ScheduleSpec

__all__ = ["SPEC", "one_f_one_b_orders", "one_f_one_b_rank_ops", "warmup_microbatches"]


def warmup_microbatches(*, rank: int, pipeline_model_parallel_size: int, num_microbatches: int) -> int:
    """Megatron: ``min(pipeline_model_parallel_size - rank - 1, num_microbatches)``."""
    return min(pipeline_model_parallel_size - rank - 1, num_microbatches)


def _rank_order(rank: int, pipeline_model_parallel_size: int, num_microbatches: int) -> tuple[Action, ...]:
    warmup = warmup_microbatches(
        rank=rank, pipeline_model_parallel_size=pipeline_model_parallel_size, num_microbatches=num_microbatches
    )
    order = [Action(rank, Kind.F, mb, 0, rank) for mb in range(warmup)]
    for step in range(num_microbatches - warmup):
        order.append(Action(rank, Kind.F, warmup + step, 0, rank))
        order.append(Action(rank, Kind.B, step, 0, rank))
    order.extend(Action(rank, Kind.B, mb, 0, rank) for mb in range(num_microbatches - warmup, num_microbatches))
    return tuple(order)


def one_f_one_b_orders(
    *, pipeline_model_parallel_size: int, num_microbatches: int
) -> tuple[tuple[Action, ...], ...]:
    return tuple(
        _rank_order(rank, pipeline_model_parallel_size, num_microbatches)
        for rank in range(pipeline_model_parallel_size)
    )


def one_f_one_b_rank_ops(pp: int, m: int) -> tuple[RankOps, ...]:
    """:func:`one_f_one_b_orders` as :class:`RankOps`, without building the actions."""
    out = []
    for rank in range(pp):
        backward, microbatch = warmup_steady_cooldown(warmup_microbatches(
            rank=rank, pipeline_model_parallel_size=pp, num_microbatches=m), m)
        kinds = backward * (KIND_CODE[Kind.B] - KIND_CODE[Kind.F]) + KIND_CODE[Kind.F]
        out.append(RankOps(kinds=tuple(kinds.tolist()), stages=(rank,) * (2 * m),
                           microbatches=tuple(microbatch.tolist())))
    return tuple(out)


SPEC = ScheduleSpec(
    name=ScheduleName.one_f_one_b,
    summary="1F1B / PipeDream-Flush (Narayanan et al. 2021): P - r - 1 warm-up forwards, then one F one B",
    orders=lambda pp, m, v, group: one_f_one_b_orders(pipeline_model_parallel_size=pp, num_microbatches=m),
    megatron_function="forward_backward_pipelining_without_interleaving",
    torch_class="Schedule1F1B",
    path_share=PathShare.whole,
    in_flight_floor=InFlightFloor.staircase,
    bottleneck_sets_step=True,
    flushed_bubble=lambda pp, m, v: (pp - 1) / (m + pp - 1),
    # Stage s keeps min(P - s, m) microbatches (Narayanan et al. 2021, sec. 2.2).
    in_flight=lambda pp, m, v, group: tuple(min(pp - stage, m) for stage in range(pp)),
    sizes_ok=lambda pp, m, v, group: v == 1,
    rank_ops=lambda pp, m, v, group: one_f_one_b_rank_ops(pp, m),
)
