"""ZB-V (Qi et al. 2024, Sec. 6): two chunks per rank in a V, split backward, 1F1B memory.

Rank r holds chunk 0 = stage r and chunk 1 = stage 2P-1-r, so the forward runs
down the ranks and back up, and the last stage sits on rank 0 next to the first.
The handcrafted order (the one ``torch.distributed.pipelining.ScheduleZBVZeroBubble``
also runs) has these phases per rank r:

1. 2(P-r)-1 forwards of chunk 0;
2. r pairs F(chunk 1), F(chunk 0);
3. P-r triples F, I, W of chunk 1;
4. steady state: [F, I, W of chunk 0] then [F, I, W of chunk 1] until all forwards ran;
5. cool-down: r pairs I(chunk 0), I(chunk 1); P-r pairs I, W of chunk 0; then the
   remaining W of chunk 1 and of chunk 0.

It is laid out for max(m, 2P-1) microbatches; ops of microbatches >= m are then
dropped, so any m >= 1 runs. Zero bubble holds when T_F = T_I = T_W.
"""

from __future__ import annotations

from megapipe.schedules.base import Action, Kind, v_stage
from megapipe.schedules.in_flight import v_in_flight
from megapipe.schedules.spec import Placement, ScheduleName, ScheduleSpec

__all__ = ["SPEC", "zb_v_orders"]


class _RankOrder:
    """Appends ops of one rank, numbering microbatches per (chunk, kind)."""

    def __init__(self, rank: int, pipeline_model_parallel_size: int):
        self.rank, self.pp = rank, pipeline_model_parallel_size
        self.ops: list[Action] = []
        self.count = {(chunk, kind): 0 for chunk in (0, 1) for kind in (Kind.F, Kind.I, Kind.W)}

    def add(self, chunk: int, kind: Kind) -> None:
        microbatch = self.count[chunk, kind]
        self.count[chunk, kind] = microbatch + 1
        self.ops.append(Action(self.rank, kind, microbatch, chunk, v_stage(self.rank, chunk, self.pp)))

    def count_of(self, chunk: int, kind: Kind) -> int:
        return self.count[chunk, kind]


def _rank_order(rank: int, pp: int, m: int) -> tuple[Action, ...]:
    padded = max(2 * pp - 1, m)
    out = _RankOrder(rank, pp)
    for _ in range(2 * (pp - rank) - 1):
        out.add(0, Kind.F)
    for _ in range(rank):
        out.add(1, Kind.F)
        out.add(0, Kind.F)
    for _ in range(pp - rank):
        for kind in (Kind.F, Kind.I, Kind.W):
            out.add(1, kind)
    while out.count_of(1, Kind.F) < out.count_of(0, Kind.F) or out.count_of(0, Kind.F) < padded:
        if out.count_of(0, Kind.F) < padded:
            out.add(0, Kind.F)
        out.add(0, Kind.I)
        out.add(0, Kind.W)
        for kind in (Kind.F, Kind.I, Kind.W):
            out.add(1, kind)
    for _ in range(rank):
        out.add(0, Kind.I)
        out.add(1, Kind.I)
    for _ in range(pp - rank):
        out.add(0, Kind.I)
        out.add(0, Kind.W)
    while out.count_of(1, Kind.W) < out.count_of(1, Kind.I):
        out.add(1, Kind.W)
    while out.count_of(0, Kind.W) < out.count_of(0, Kind.I):
        out.add(0, Kind.W)
    return tuple(action for action in out.ops if action.microbatch < m)


def zb_v_orders(*, pipeline_model_parallel_size: int, num_microbatches: int) -> tuple[tuple[Action, ...], ...]:
    return tuple(
        _rank_order(rank, pipeline_model_parallel_size, num_microbatches)
        for rank in range(pipeline_model_parallel_size)
    )



SPEC = ScheduleSpec(
    name=ScheduleName.zb_v,
    summary="ZB-V (Qi et al. 2024, sec. 6): two chunks per rank in a V, split backward, 1F1B memory",
    orders=lambda pp, m, v, group: zb_v_orders(pipeline_model_parallel_size=pp, num_microbatches=m),
    placement=Placement.v,
    split_backward=True,
    fixed_chunks=2,
    torch_class="ScheduleZBVZeroBubble",
    # Zero bubble in the steady state when T_F = T_I = T_W; no published flushed closed form.
    steady_bubble=lambda pp, m, v: 0.0,
    in_flight=v_in_flight,
    sizes_ok=lambda pp, m, v, group: v == 2,
    min_microbatches_per_stage=2,
)
