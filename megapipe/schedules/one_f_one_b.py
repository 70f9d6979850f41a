"""1F1B (PipeDream-Flush) in Megatron's order.

Reproduces ``forward_backward_pipelining_without_interleaving`` of megatron-core
0.16.1: rank r runs ``min(P - r - 1, m)`` warm-up forwards, then ``m - warmup``
steady steps of one forward followed by one full backward, then the remaining
backwards (cool-down). Backwards use Megatron's fused backward (kind ``B``).
"""

from __future__ import annotations

from megapipe.schedules.base import Action, Kind

__all__ = ["one_f_one_b_orders", "warmup_microbatches"]


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
