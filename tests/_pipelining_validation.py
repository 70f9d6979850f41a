"""Test helper: measured torch pipeline runs -> megapipe simulator inputs and comparison.

Shared by tests/test_simulate_real_runs.py and scripts/validate_simulator.py. A
``CaseResult`` from ``_torch_pipelining.run_pipeline`` gives, per step, every op's
interval on every rank; from it come the per-stage mean op times, the runtime's
dispatch overhead per op and the message latency, which feed
``megapipe.simulate.simulate`` with a megapipe schedule.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from _torch_pipelining import ActionRecord, CaseResult, RunCase, stage_to_rank, to_schedule
from megapipe.schedules import build
from megapipe.simulate import P2PCost, StageTimes, simulate

__all__ = [
    "runtime_gaps_ms",
    "mean_action_ms",
    "measured_stage_times",
    "Comparison",
    "compare",
    "VALIDATION_SCHEDULES",
    "validation_case",
    "megapipe_schedule_for",
]

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
    placement = stage_to_rank(
        case.name, pipeline_model_parallel_size=case.pipeline_model_parallel_size, num_stages=case.num_stages
    )
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


def validation_case(
    label: str, *, pipeline_model_parallel_size: int = 4, num_microbatches: int = 8, scale: float = 1.0
) -> RunCase:
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
    _, megapipe_name, chunks = VALIDATION_SCHEDULES[case.label]
    pp, m = case.pipeline_model_parallel_size, case.num_microbatches
    if megapipe_name is None:
        return to_schedule(case.name, pipeline_model_parallel_size=pp, num_microbatches=m, num_stages_per_rank=chunks)
    group = m // max(1, m // pp) if megapipe_name == "interleaved_1f1b" else None
    return build(
        megapipe_name, pipeline_model_parallel_size=pp, num_microbatches=m,
        virtual_pipeline_model_parallel_size=chunks, microbatch_group_size_per_vp_stage=group,
    )
