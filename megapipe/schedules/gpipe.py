"""GPipe (Huang et al. 2019): every forward, then every backward, then a flush.

Each rank runs F0..F(m-1) and then the full backwards B0..B(m-1) in microbatch
order, as ``torch.distributed.pipelining.ScheduleGPipe`` does. All m
microbatches' activations are alive at the turn, which is GPipe's memory cost;
its wall-time bubble is the same (p-1)/(m+p-1) as 1F1B's.
"""

from __future__ import annotations

from megapipe.schedules.base import Action, Kind
from megapipe.schedules.spec import InFlightFloor, PathShare, ScheduleName, ScheduleSpec

__all__ = ["SPEC", "gpipe_orders"]


def gpipe_orders(*, pipeline_model_parallel_size: int, num_microbatches: int) -> tuple[tuple[Action, ...], ...]:
    orders = []
    for rank in range(pipeline_model_parallel_size):
        forwards = [Action(rank, Kind.F, mb, 0, rank) for mb in range(num_microbatches)]
        backwards = [Action(rank, Kind.B, mb, 0, rank) for mb in range(num_microbatches)]
        orders.append(tuple(forwards + backwards))
    return tuple(orders)



SPEC = ScheduleSpec(
    name=ScheduleName.gpipe,
    summary="GPipe (Huang et al. 2019): all forwards, then all backwards, then a flush",
    orders=lambda pp, m, v, group: gpipe_orders(pipeline_model_parallel_size=pp, num_microbatches=m),
    torch_class="ScheduleGPipe",
    path_share=PathShare.whole,
    in_flight_floor=InFlightFloor.all,
    bottleneck_sets_step=True,
    # (P-1)/(m+P-1) of wall time, as 1F1B: GPipe differs only in memory (Huang et al. 2019).
    flushed_bubble=lambda pp, m, v: (pp - 1) / (m + pp - 1),
    in_flight=lambda pp, m, v, group: (m,) * pp,
    sizes_ok=lambda pp, m, v, group: v == 1,
)
