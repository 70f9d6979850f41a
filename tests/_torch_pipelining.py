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
    "runtime_gaps_ms",
    "mean_action_ms",
    "measured_stage_times",
    "Comparison",
    "compare",
    "VALIDATION_SCHEDULES",
    "validation_case",
    "megapipe_schedule_for",
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

    def median_action_ms(self) -> dict[tuple[int, str], float]:
        """Median duration of each (stage, kind) over all measured steps and microbatches."""
        samples: dict[tuple[int, str], list[float]] = {}
        for step in self.actions:
            for rank in step:
                for a in rank:
                    samples.setdefault((a.stage_index, a.kind), []).append(1e3 * (a.end_s - a.start_s))
        return {key: statistics.median(values) for key, values in samples.items()}

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
        return self._timed("F", fwd_chunk_id, lambda: super(_TimedStage, self).forward_one_chunk(fwd_chunk_id, *args, **kwargs))

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


def _rank_main(rank: int, world_size: int, port: int, cases: list[RunCase], steps: int, warmup_steps: int, out_dir: str):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        numel = cases[0].hidden_size * cases[0].micro_batch_size
        result = {
            "p2p_ms": _measure_p2p_ms(rank=rank, world_size=world_size, numel=numel),
            "cases": [_run_case(c, rank=rank, world_size=world_size, steps=steps, warmup_steps=warmup_steps) for c in cases],
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


# --------------------------------------------------------------------------------------------
# Measured run -> simulator inputs
# --------------------------------------------------------------------------------------------

_READY_MARGIN_S = 1e-3
"""An input that landed this long before the rank went free cannot have delayed the next op."""


def _cross_rank_inputs(action: ActionRecord, present: set, placement: dict[int, int], rank: int, last_stage: int):
    """The ops on other ranks whose output ``action`` consumes (the simulator's dependency rule)."""
    stage, mb = action.stage_index, action.microbatch
    needed = []
    if action.kind == "F" and stage > 0:
        needed.append((stage - 1, "F", mb))
    elif action.kind in ("B", "I") and stage < last_stage:
        needed.append((stage + 1, "B", mb) if (stage + 1, "B", mb) in present else (stage + 1, "I", mb))
    return [key for key in needed if placement[key[0]] != rank]


def runtime_gaps_ms(result: CaseResult) -> tuple[float, float]:
    """(dispatch overhead, message latency) measured from the run's own timeline.

    Dispatch overhead: mean gap between consecutive ops of a rank whose inputs were
    ready before the first op ended (torch's Python between two computes: posting
    sends and receives, loss, bookkeeping). Message latency: mean time from the end of
    the producing op on another rank to the start of an op that waited for it, less the
    dispatch overhead that gap also contains. The overhead is a mean because every op
    pays it; the latency is a median because a few waits are stretched by the schedule
    itself (DualPipeV's runtime posts the send of an overlapped F only after the pair's B).
    """
    case = result.case
    placement = stage_to_rank(case.name, pipeline_model_parallel_size=case.pipeline_model_parallel_size, num_stages=case.num_stages)
    free_gaps, waits = [], []
    for step in result.actions:
        end = {(a.stage_index, a.kind, a.microbatch): a.end_s for rank in step for a in rank}
        present = set(end)
        for rank, actions in enumerate(step):
            for previous, action in zip(actions, actions[1:]):
                inputs = _cross_rank_inputs(action, present, placement, rank, case.num_stages - 1)
                ready = max((end[key] for key in inputs), default=float("-inf"))
                if ready < previous.end_s - _READY_MARGIN_S:
                    free_gaps.append(action.start_s - previous.end_s)
                elif ready > previous.end_s:
                    waits.append(action.start_s - ready)
    overhead = statistics.fmean(free_gaps)
    latency = max(0.0, statistics.median(waits) - overhead) if waits else 0.0
    return 1e3 * overhead, 1e3 * latency


def mean_action_ms(result: CaseResult) -> dict[tuple[int, str], float]:
    """Mean duration of each (stage, kind): step time is a sum of op times, so the mean is the unbiased figure."""
    samples: dict[tuple[int, str], list[float]] = {}
    for step in result.actions:
        for rank in step:
            for a in rank:
                samples.setdefault((a.stage_index, a.kind), []).append(1e3 * (a.end_s - a.start_s))
    return {key: statistics.fmean(values) for key, values in samples.items()}


def measured_stage_times(result: CaseResult, *, overhead_ms: float):
    """megapipe StageTimes from the measured op means, each op charged ``overhead_ms`` of dispatch."""
    from megapipe.simulate import StageTimes

    means = mean_action_ms(result)
    fwd, bwd, wgrad = [], [], []
    for stage in range(result.case.num_stages):
        fwd.append(means[stage, "F"] + overhead_ms)
        split = (stage, "I") in means
        weight = means[stage, "W"] + overhead_ms if split else 0.0
        full = means[stage, "I"] + overhead_ms + weight if split else means[stage, "B"] + overhead_ms
        bwd.append(full)
        wgrad.append(min(weight, full))
    return StageTimes(fwd_ms=tuple(fwd), bwd_ms=tuple(bwd), wgrad_ms=tuple(wgrad))


@dataclass(frozen=True, slots=True)
class Comparison:
    """Simulator prediction against one measured case."""

    name: str
    measured_step_ms: float
    """Median over measured steps of CaseResult.step_time_ms."""
    predicted_step_ms: float
    measured_bubble: float
    """1 - (sum of op times + dispatch overhead per op) / (P * step), median over steps."""
    predicted_bubble: float
    overhead_ms: float
    latency_ms: float
    measured_idle_ms: tuple[float, ...]
    predicted_idle_ms: tuple[float, ...]

    @property
    def step_error(self) -> float:
        return self.predicted_step_ms / self.measured_step_ms - 1.0

    @property
    def bubble_error(self) -> float:
        return self.predicted_bubble - self.measured_bubble


def _one_step(result: CaseResult, index: int) -> CaseResult:
    return CaseResult(
        case=result.case, p2p_ms=result.p2p_ms, step_starts_s=[result.step_starts_s[index]],
        step_ends_s=[result.step_ends_s[index]], actions=[result.actions[index]],
    )


def _compare_step(step: CaseResult, schedule, latency_ms: float | None) -> dict:
    from megapipe.simulate import P2PCost, simulate

    overhead, timeline_latency = runtime_gaps_ms(step)
    latency = timeline_latency if latency_ms is None else latency_ms
    sim = simulate(schedule, measured_stage_times(step, overhead_ms=overhead), p2p=P2PCost(latency_ms=latency))
    step_ms = step.step_time_ms[0]
    busy = [b + overhead * len(ops) for b, ops in zip(step.busy_ms(0), step.actions[0])]
    return {
        "measured_step_ms": step_ms,
        "predicted_step_ms": sim.step_time_ms,
        "measured_bubble": 1.0 - sum(busy) / (len(busy) * step_ms),
        "predicted_bubble": sim.bubble_fraction,
        "overhead_ms": overhead,
        "latency_ms": latency,
        "measured_idle_ms": tuple(step_ms - b for b in busy),
        "predicted_idle_ms": tuple(r.idle_ms for r in sim.ranks),
    }


def compare(result: CaseResult, schedule=None, *, latency_ms: float | None = None) -> Comparison:
    """Simulate ``schedule`` (default: the order the ranks executed) with each measured
    step's own op means, dispatch overhead and latency; every figure is the median over steps.

    ``latency_ms`` overrides the message latency read from the timeline (e.g. the gloo
    ping-pong figure ``result.p2p_ms``).
    """
    case = result.case
    if schedule is None:
        schedule = to_schedule(
            case.name, pipeline_model_parallel_size=case.pipeline_model_parallel_size,
            num_microbatches=case.num_microbatches,
            num_stages_per_rank=case.num_stages // case.pipeline_model_parallel_size,
            orders=result.executed_order(0),
        )
    rows = [_compare_step(_one_step(result, i), schedule, latency_ms) for i in range(len(result.actions))]

    def median(key):
        values = [row[key] for row in rows]
        if isinstance(values[0], tuple):
            return tuple(statistics.median(column) for column in zip(*values))
        return statistics.median(values)

    return Comparison(name=case.label or case.name, **{key: median(key) for key in rows[0]})


# --------------------------------------------------------------------------------------------
# The validation set shared by tests/test_simulate_real_runs.py and scripts/validate_simulator.py
# --------------------------------------------------------------------------------------------

VALIDATION_SCHEDULES: dict[str, tuple[str, str | None, int]] = {
    "GPipe": ("GPipe", "gpipe", 1),
    "1F1B": ("1F1B", "1f1b", 1),
    "Interleaved1F1B": ("Interleaved1F1B", "interleaved_1f1b", 2),
    "InterleavedZeroBubble v=1": ("InterleavedZeroBubble", "zb_h1", 1),
    "InterleavedZeroBubble v=2": ("InterleavedZeroBubble", None, 2),
    "ZBVZeroBubble": ("ZBVZeroBubble", "zb_v", 2),
    "DualPipeV": ("DualPipeV", "dualpipe_v", 2),
}
"""label -> (torch schedule, megapipe schedule, stages per rank); None: megapipe has no
builder for it, the simulator runs torch's order."""

_FWD_MS = (4.0, 6.0, 5.0, 3.0, 5.0, 3.0, 4.0, 6.0)
_INPUT_GRAD_MS = (4.0, 6.0, 5.0, 3.0, 5.0, 3.0, 4.0, 6.0)
_WGRAD_MS = (3.0, 4.0, 4.0, 2.0, 4.0, 2.0, 3.0, 4.0)


def validation_case(label: str, *, pipeline_model_parallel_size: int = 4, num_microbatches: int = 8, scale: float = 1.0) -> RunCase:
    """Uneven per-stage sleeps (ms, times ``scale``), cycling through an 8-stage pattern."""
    name, _, chunks = VALIDATION_SCHEDULES[label]
    stages = pipeline_model_parallel_size * chunks

    def pick(pattern):
        return tuple(scale * pattern[s % len(pattern)] for s in range(stages))

    return RunCase(
        name=name, pipeline_model_parallel_size=pipeline_model_parallel_size, num_microbatches=num_microbatches,
        fwd_ms=pick(_FWD_MS), input_grad_ms=pick(_INPUT_GRAD_MS), wgrad_ms=pick(_WGRAD_MS), label=label,
    )


def megapipe_schedule_for(case: RunCase):
    """megapipe's own schedule for the case, or torch's order where megapipe has no builder."""
    from megapipe.schedules import build

    _, megapipe_name, chunks = VALIDATION_SCHEDULES[case.label]
    pp, m = case.pipeline_model_parallel_size, case.num_microbatches
    if megapipe_name is None:
        return to_schedule(case.name, pipeline_model_parallel_size=pp, num_microbatches=m, num_stages_per_rank=chunks)
    group = m // max(1, m // pp) if megapipe_name == "interleaved_1f1b" else None
    return build(
        megapipe_name, pipeline_model_parallel_size=pp, num_microbatches=m,
        virtual_pipeline_model_parallel_size=chunks, microbatch_group_size_per_vp_stage=group,
    )
