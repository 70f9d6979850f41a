"""DualPipeV: DeepSeek's DualPipe (DeepSeek-V3 report, 2024) cut in half into a V.

P ranks hold 2P stages in a V (chunk 0 = stage r, chunk 1 = stage 2P-1-r), so
parameters are not duplicated as in bidirectional DualPipe. Phases per rank r
(the order of DeepSeek's open-source DualPipeV, also run by
``torch.distributed.pipelining.ScheduleDualPipeV``):

1. 2(P-r-1) forwards of chunk 0;
2. r+1 pairs F(chunk 0), F(chunk 1);
3. P-r-1 times: I(chunk 1), the oldest pending W, F(chunk 1);
4. main: m-2P+r+1 times F(chunk 0)&B(chunk 1) then F(chunk 1)&B(chunk 0);
5. P-r-1 times: B(chunk 1), then F(chunk 1)&B(chunk 0);
6. r+1 pairs of backwards of chunk 1 and chunk 0; half-way the backward
   switches from fused B to split I (W deferred);
7. P-r-1 times: pending W, backward of chunk 0;
8. r+1 pending W.

"F&B" marks DualPipe's overlapped forward/backward pair; megapipe issues it as F
then B on the rank, with no overlap credit, as torch's runtime executes it.
Needs m >= 2P.
"""

from __future__ import annotations

from collections import deque

from megapipe.errors import ScheduleError
from megapipe.schedules.base import Action, Kind, v_stage
from megapipe.schedules.in_flight import v_in_flight
from megapipe.schedules.spec import Placement, ScheduleName, ScheduleSpec

__all__ = ["SPEC", "dualpipe_v_orders"]


class _RankOrder:
    def __init__(self, rank: int, pipeline_model_parallel_size: int):
        self.rank, self.pp = rank, pipeline_model_parallel_size
        self.ops: list[Action] = []
        self.forwards, self.backwards = [0, 0], [0, 0]
        self.pending_w: deque[tuple[int, int]] = deque()

    def _emit(self, chunk: int, kind: Kind, microbatch: int) -> None:
        self.ops.append(Action(self.rank, kind, microbatch, chunk, v_stage(self.rank, chunk, self.pp)))

    def forward(self, chunk: int) -> None:
        self._emit(chunk, Kind.F, self.forwards[chunk])
        self.forwards[chunk] += 1

    def backward(self, chunk: int, *, split: bool) -> None:
        microbatch = self.backwards[chunk]
        self.backwards[chunk] += 1
        self._emit(chunk, Kind.I if split else Kind.B, microbatch)
        if split:
            self.pending_w.append((chunk, microbatch))

    def weight(self) -> None:
        if self.pending_w:
            chunk, microbatch = self.pending_w.popleft()
            self._emit(chunk, Kind.W, microbatch)


def _rank_order(rank: int, pp: int, m: int) -> tuple[Action, ...]:
    out = _RankOrder(rank, pp)
    for _ in range(2 * (pp - rank - 1)):
        out.forward(0)
    for _ in range(rank + 1):
        out.forward(0)
        out.forward(1)
    for _ in range(pp - rank - 1):
        out.backward(1, split=True)
        out.weight()
        out.forward(1)
    for _ in range(m - 2 * pp + rank + 1):
        out.forward(0)
        out.backward(1, split=False)
        out.forward(1)
        out.backward(0, split=False)
    for _ in range(pp - rank - 1):
        out.backward(1, split=False)
        out.forward(1)
        out.backward(0, split=False)
    split = False
    half = (rank + 1) // 2
    for step in range(rank + 1):
        split = split or (step == half and rank % 2 == 1)
        out.backward(1, split=split)
        split = split or (step == half and rank % 2 == 0)
        out.backward(0, split=split)
    for _ in range(pp - rank - 1):
        out.weight()
        out.backward(0, split=split)
    while out.pending_w:
        out.weight()
    return tuple(out.ops)


def dualpipe_v_orders(
    *, pipeline_model_parallel_size: int, num_microbatches: int
) -> tuple[tuple[Action, ...], ...]:
    pp, m = pipeline_model_parallel_size, num_microbatches
    if m < 2 * pp:
        raise ScheduleError(
            f"dualpipe_v needs num_microbatches >= 2 * pipeline_model_parallel_size = {2 * pp}, got {m}; "
            f"raise train.global_batch_size or use schedule=zb_v"
        )
    return tuple(_rank_order(rank, pp, m) for rank in range(pp))



SPEC = ScheduleSpec(
    name=ScheduleName.dualpipe_v,
    summary="DualPipeV (DeepSeek-V3 report): DualPipe cut into a V, overlapped F&B pairs issued as F then B",
    orders=lambda pp, m, v, group: dualpipe_v_orders(pipeline_model_parallel_size=pp, num_microbatches=m),
    placement=Placement.v,
    split_backward=True,
    fixed_chunks=2,
    torch_class="ScheduleDualPipeV",
    in_flight=v_in_flight,
    sizes_ok=lambda pp, m, v, group: v == 2 and m >= 2 * pp,
    min_microbatches_per_stage=2,
)
