"""Test helper: torch.distributed.pipelining orders and real CPU/gloo runs.

Two things live here, both kept out of the pure core because they import torch:

* ``torch_order`` reads the per-rank compute order that torch's schedule classes
  build, without a process group: the classes only read ``num_stages``,
  ``group_size``, ``group_rank`` and ``stage_index_to_group_rank`` from their
  stages, so a small stand-in stage object is enough (torch's own schedule tests
  use the same trick).
* ``run_pipeline`` spawns 2-4 gloo ranks and runs real torch pipeline schedules
  over stage modules whose forward, input-gradient and weight-gradient costs
  are fixed sleeps (sleeps do not contend for the two cores), recording the
  ``perf_counter`` interval of every F/B/I/W action each rank executes.

``_pipelining_validation`` turns those records into simulator inputs.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as torch_schedules

__all__ = [
    "TORCH_SCHEDULE_CLASSES",
    "V_STYLE",
    "TorchAction",
    "torch_order",
    "stage_to_rank",
    "RunCase",
    "ActionRecord",
    "CaseResult",
    "run_pipeline",
    "to_schedule",
]

TORCH_SCHEDULE_CLASSES: dict[str, type] = {
    "GPipe": torch_schedules.ScheduleGPipe,
    "1F1B": torch_schedules.Schedule1F1B,
    "Interleaved1F1B": torch_schedules.ScheduleInterleaved1F1B,
    "InterleavedZeroBubble": torch_schedules.ScheduleInterleavedZeroBubble,
    "ZBVZeroBubble": torch_schedules.ScheduleZBVZeroBubble,
}
if hasattr(torch_schedules, "ScheduleDualPipeV"):
    TORCH_SCHEDULE_CLASSES["DualPipeV"] = torch_schedules.ScheduleDualPipeV

_SINGLE_STAGE = {"GPipe", "1F1B"}
V_STYLE = frozenset({"ZBVZeroBubble", "DualPipeV"})
"""Schedules that place two stages per rank in a V (rank r holds r and 2p-1-r)."""


@dataclass(frozen=True, slots=True)
class TorchAction:
    """One compute action as torch writes it (``"2F0"``): global stage, kind F/B/I/W, microbatch."""

    stage_index: int
    kind: str
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage_index}{self.kind}{self.microbatch}"


def stage_to_rank(name: str, *, pipeline_model_parallel_size: int, num_stages: int) -> dict[int, int]:
    """torch's stage -> rank placement: looped (stage % p) or V-shaped."""
    style = "v" if name in V_STYLE else "loop"
    return torch_schedules.generate_stage_to_rank_mapping(pipeline_model_parallel_size, num_stages, style=style)


class _StandInStage:
    """The attributes torch's schedule constructors read from a stage, nothing else."""

    def __init__(self, *, stage_index: int, num_stages: int, group_size: int, group_rank: int) -> None:
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.group_size = group_size
        self.group_rank = group_rank
        self.stage_index_to_group_rank: dict[int, int] = {}
        self.submod = None
        self.is_first = stage_index == 0
        self.is_last = stage_index == num_stages - 1


def _flatten(action) -> list[TorchAction]:
    if action is None:
        return []
    if action.sub_actions is not None:  # DualPipeV's OVERLAP_F_B runs its parts in order
        return [a for sub in action.sub_actions for a in _flatten(sub)]
    if not action.is_compute_op:
        return []
    return [TorchAction(action.stage_index, action.computation_type.value, action.microbatch_index)]


def torch_order(
    name: str, *, pipeline_model_parallel_size: int, num_microbatches: int, num_stages_per_rank: int = 1
) -> dict[int, list[TorchAction]]:
    """Per-rank compute order of torch schedule ``name``, idle slots and comms dropped.

    For GPipe and 1F1B this is ``pipeline_order``, the IR torch documents for
    the single-stage schedules; their runtime (``_step_microbatches``) does not
    read it (see docs/schedules.md for where the two disagree).
    """
    cls = TORCH_SCHEDULE_CLASSES[name]
    pp = pipeline_model_parallel_size
    num_stages = pp * num_stages_per_rank
    placement = stage_to_rank(name, pipeline_model_parallel_size=pp, num_stages=num_stages)
    local = [s for s in range(num_stages) if placement[s] == 0]
    stages = [_StandInStage(stage_index=s, num_stages=num_stages, group_size=pp, group_rank=0) for s in local]
    schedule = cls(stages[0], num_microbatches) if name in _SINGLE_STAGE else cls(stages, num_microbatches)
    return {
        rank: [a for action in actions for a in _flatten(action)]
        for rank, actions in sorted(schedule.pipeline_order.items())
    }


# --------------------------------------------------------------------------------------------
# Real runs
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RunCase:
    """One real pipeline run: torch schedule, sizes and per-global-stage sleep costs (ms)."""

    name: str
    pipeline_model_parallel_size: int
    num_microbatches: int
    fwd_ms: tuple[float, ...]
    """Forward sleep per global stage."""
    input_grad_ms: tuple[float, ...]
    """Backward sleep on the activation path (I) per global stage."""
    wgrad_ms: tuple[float, ...]
    """Backward sleep on the weight path (W) per global stage."""
    hidden_size: int = 64
    micro_batch_size: int = 2
    label: str = ""
    """Row name in reports; the torch schedule name when empty."""

    @property
    def num_stages(self) -> int:
        return len(self.fwd_ms)


@dataclass(frozen=True, slots=True)
class ActionRecord:
    stage_index: int
    kind: str
    """F, B (full backward), I (input grad) or W (weight grad)."""
    microbatch: int
    start_s: float
    end_s: float


@dataclass(slots=True)
class CaseResult:
    """What every rank measured for one case: per measured step, per rank, the actions run."""

    case: RunCase
    p2p_ms: float
    step_starts_s: list[list[float]] = field(default_factory=list)
    """[step][rank]: perf_counter just before schedule.step()."""
    step_ends_s: list[list[float]] = field(default_factory=list)
    actions: list[list[list[ActionRecord]]] = field(default_factory=list)
    """[step][rank]: actions in execution order."""

    @property
    def step_call_ms(self) -> list[float]:
        """First rank entering schedule.step() to the last one leaving it, per step."""
        return [1e3 * (max(e) - min(s)) for s, e in zip(self.step_starts_s, self.step_ends_s)]

    @property
    def step_time_ms(self) -> list[float]:
        """First op's start to last op's end over all ranks, per step: the simulator's
        step_time_ms. It leaves out the ranks' skew leaving the barrier before step()."""
        return [
            1e3 * (max(r[-1].end_s for r in step) - min(r[0].start_s for r in step))
            for step in self.actions
        ]

    def busy_ms(self, step: int) -> list[float]:
        return [1e3 * sum(a.end_s - a.start_s for a in rank) for rank in self.actions[step]]

    def bubble_fraction(self, step: int) -> float:
        """Idle share of the ranks' wall time: 1 - sum(busy) / (p * step time)."""
        busy = self.busy_ms(step)
        return 1.0 - sum(busy) / (len(busy) * self.step_time_ms[step])

    def executed_order(self, step: int = 0) -> dict[int, list[TorchAction]]:
        return {
            rank: [TorchAction(a.stage_index, a.kind, a.microbatch) for a in actions]
            for rank, actions in enumerate(self.actions[step])
        }


class _SleepThrough(torch.autograd.Function):
    """Identity whose forward and backward each sleep a fixed time (cost without CPU use)."""

    @staticmethod
    def forward(ctx, x, fwd_s, bwd_s):
        time.sleep(fwd_s)
        ctx.bwd_s = bwd_s
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.bwd_s)
        return grad.clone(), None, None


class SleepStage(torch.nn.Module):
    """``out = sleep_path(x) + sleep_path(weight)``: the activation path costs F and I,
    the parameter path costs W, so torch's I/W split puts each sleep in its own pass."""

    def __init__(self, *, hidden_size: int, fwd_ms: float, input_grad_ms: float, wgrad_ms: float) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size))
        # Lets the first stage's activation path have a backward although its input needs no grad.
        self.input_anchor = torch.nn.Parameter(torch.zeros(hidden_size))
        self.fwd_s, self.input_grad_s, self.wgrad_s = fwd_ms / 1e3, input_grad_ms / 1e3, wgrad_ms / 1e3

    def forward(self, x):
        if not x.requires_grad:
            x = x + self.input_anchor
        act = _SleepThrough.apply(x, self.fwd_s, self.input_grad_s)
        return act + _SleepThrough.apply(self.weight, 0.0, self.wgrad_s)


class _TimedStage(PipelineStage):
    """PipelineStage that appends an ActionRecord for every compute call."""

    records: list[ActionRecord]

    def _timed(self, kind, microbatch, call):
        start = time.perf_counter()
        out = call()
        self.records.append(ActionRecord(self.stage_index, kind, microbatch, start, time.perf_counter()))
        return out

    def forward_one_chunk(self, fwd_chunk_id, *args, **kwargs):
        return self._timed(
            "F", fwd_chunk_id, lambda: super(_TimedStage, self).forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        )

    def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
        kind = "B" if full_backward else "I"
        return self._timed(
            kind,
            bwd_chunk_id,
            lambda: super(_TimedStage, self).backward_one_chunk(
                bwd_chunk_id, loss=loss, full_backward=full_backward, last_backward=last_backward
            ),
        )

    def backward_weight_one_chunk(self, bwd_chunk_id, last_backward=False):
        return self._timed(
            "W",
            bwd_chunk_id,
            lambda: super(_TimedStage, self).backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward),
        )


def _measure_p2p_ms(*, rank: int, world_size: int, numel: int, rounds: int = 30) -> float:
    """Half the median round trip of one activation-sized tensor between ranks 0 and 1."""
    buf = torch.zeros(numel)
    samples = []
    dist.barrier()
    for _ in range(rounds):
        start = time.perf_counter()
        if rank == 0:
            dist.send(buf, 1)
            dist.recv(buf, 1)
        elif rank == 1:
            dist.recv(buf, 0)
            dist.send(buf, 0)
        samples.append(time.perf_counter() - start)
    value = torch.tensor([statistics.median(samples) / 2 * 1e3])
    dist.broadcast(value, 0)
    return float(value)


def _loss(output, target):
    return ((output - target) ** 2).mean()


def _run_case(case: RunCase, *, rank: int, world_size: int, steps: int, warmup_steps: int) -> dict:
    placement = stage_to_rank(case.name, pipeline_model_parallel_size=world_size, num_stages=case.num_stages)
    records: list[ActionRecord] = []
    stages = []
    for s in (s for s in range(case.num_stages) if placement[s] == rank):
        module = SleepStage(
            hidden_size=case.hidden_size,
            fwd_ms=case.fwd_ms[s],
            input_grad_ms=case.input_grad_ms[s],
            wgrad_ms=case.wgrad_ms[s],
        )
        stage = _TimedStage(module, s, case.num_stages, torch.device("cpu"))
        stage.records = records
        stages.append(stage)
    cls = TORCH_SCHEDULE_CLASSES[case.name]
    schedule = cls(stages[0] if case.name in _SINGLE_STAGE else stages, case.num_microbatches, loss_fn=_loss)
    batch = case.num_microbatches * case.micro_batch_size
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, case.hidden_size, generator=gen)
    target = torch.randn(batch, case.hidden_size, generator=gen)
    holds_first = any(s.is_first for s in stages)
    holds_last = any(s.is_last for s in stages)
    out: dict = {"starts": [], "ends": [], "actions": []}
    for step in range(warmup_steps + steps):
        args = (x,) if holds_first else ()
        kwargs = {"target": target} if holds_last else {}
        records.clear()
        dist.barrier()
        start = time.perf_counter()
        schedule.step(*args, **kwargs)
        end = time.perf_counter()
        if step >= warmup_steps:
            out["starts"].append(start)
            out["ends"].append(end)
            out["actions"].append([asdict(r) for r in records])
    dist.barrier()
    return out


def _rank_main(
    rank: int, world_size: int, port: int, cases: list[RunCase], steps: int, warmup_steps: int, out_dir: str
) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        numel = cases[0].hidden_size * cases[0].micro_batch_size
        result = {
            "p2p_ms": _measure_p2p_ms(rank=rank, world_size=world_size, numel=numel),
            "cases": [
                _run_case(c, rank=rank, world_size=world_size, steps=steps, warmup_steps=warmup_steps) for c in cases
            ],
        }
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_pipeline(cases: list[RunCase], *, steps: int = 3, warmup_steps: int = 1) -> list[CaseResult]:
    """Run every case on one spawned gloo group (world size = the cases' pipeline size)."""
    world_sizes = {c.pipeline_model_parallel_size for c in cases}
    assert len(world_sizes) == 1, f"one pipeline size per call, got {world_sizes}"
    world_size = world_sizes.pop()
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(
            _rank_main,
            args=(world_size, _free_port(), cases, steps, warmup_steps, out_dir),
            nprocs=world_size,
            join=True,
        )
        per_rank = [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(world_size)]
    results = []
    for index, case in enumerate(cases):
        ranks = [r["cases"][index] for r in per_rank]
        result = CaseResult(case=case, p2p_ms=per_rank[0]["p2p_ms"])
        for step in range(steps):
            result.step_starts_s.append([r["starts"][step] for r in ranks])
            result.step_ends_s.append([r["ends"][step] for r in ranks])
            result.actions.append([[ActionRecord(**a) for a in r["actions"][step]] for r in ranks])
        results.append(result)
    return results


def to_schedule(
    name: str, *, pipeline_model_parallel_size: int, num_microbatches: int, num_stages_per_rank: int = 1,
    orders: dict[int, list[TorchAction]] | None = None,
):
    """A megapipe Schedule running torch's order (``torch_order`` unless ``orders`` is given).

    Chunk c of a rank is its c-th stage in model order, so looped placement gives
    stage = c * P + rank and V placement gives stages r and 2P-1-r, as in megapipe.
    """
    from megapipe.schedules.base import Action, Kind, Schedule

    pp = pipeline_model_parallel_size
    num_stages = pp * num_stages_per_rank
    if orders is None:
        orders = torch_order(
            name, pipeline_model_parallel_size=pp, num_microbatches=num_microbatches,
            num_stages_per_rank=num_stages_per_rank,
        )
    placement = stage_to_rank(name, pipeline_model_parallel_size=pp, num_stages=num_stages)
    chunk_of = {}
    for rank in range(pp):
        for chunk, stage in enumerate(s for s in range(num_stages) if placement[s] == rank):
            chunk_of[stage] = chunk
    return Schedule(
        name=f"torch:{name}",
        pipeline_model_parallel_size=pp,
        num_microbatches=num_microbatches,
        virtual_pipeline_model_parallel_size=num_stages_per_rank,
        microbatch_group_size_per_vp_stage=None,
        stage_to_rank=tuple(placement[s] for s in range(num_stages)),
        orders=tuple(
            tuple(
                Action(rank, Kind(a.kind), a.microbatch, chunk_of[a.stage_index], a.stage_index)
                for a in orders[rank]
            )
            for rank in range(pp)
        ),
    )
