"""What the bubble should have been: megapipe's simulator fed with measured stage times.

The hook measures each virtual stage's mean forward and backward time per
microbatch and each rank's median non-compute stretch before a compute call
(``StepMetrics.dispatch_ms``). :func:`predict_bubble` builds the schedule
megatron-core ran (``megapipe.schedules.build``) and times it with
``megapipe.simulate``: every op costs its stage's measured mean plus the dispatch
overhead, and every message between ranks ``p2p_latency_ms``. The overhead is
the smallest rank median (``PipelineMetrics.dispatch_ms``): every rank runs the
same dispatch code, and waits on a neighbour only lengthen stretches, so the rank
that waits least gives the least contaminated figure (a fast rank in an
unbalanced 1F1B pipeline waits before every other op, which puts its own median
on a wait).
The prediction uses the measured side's definition of the flushed bubble,
``1 - sum(measured compute) / (P * step_time)`` (Qi et al. 2024, Sec. 3), so
dispatch overhead counts as idle on both sides; without overhead it equals the
simulator's own ``bubble_fraction``.

Why the overhead matters: with ``overlap_p2p_comm`` (interleaved) megatron-core
posts and waits on its p2p requests between every two compute calls, and on a
loaded host each of those stretches costs 0.3-3 ms. Left out, the simulator put
interleaved v=2 11-18% below the measured bubble; charged per op, within 10%
(docs/validation.md, "Schedule hook on megatron-core"). The same charge is what
made torch.distributed.pipelining runs match the simulator to 3%.
"""

from __future__ import annotations

from dataclasses import dataclass

from megapipe.monitor.metrics import PipelineMetrics
from megapipe.schedules import build, megatron_schedule
from megapipe.simulate import P2PCost, StageTimes, simulate

__all__ = ["BubblePrediction", "predict_bubble"]


@dataclass(frozen=True, slots=True, kw_only=True)
class BubblePrediction:
    """The simulator's view of one measured window."""

    bubble_fraction: float
    step_time_ms: float
    """Simulated step."""
    dispatch_ms: float
    """Overhead charged to every op."""
    p2p_latency_ms: float
    """Charged per message between neighbouring ranks."""


def predict_bubble(
    metrics: PipelineMetrics,
    *,
    schedule: str | None = None,
    microbatch_group_size_per_vp_stage: int | None = None,
    p2p_latency_ms: float = 0.0,
    charge_dispatch: bool = True,
) -> BubblePrediction:
    """Simulate the measured window: stage means plus per-op dispatch, ``p2p_latency_ms`` per message.

    ``charge_dispatch=False`` models compute and messages only (the simulator's plain bubble).
    """
    pp, chunks, m = metrics.pipeline_model_parallel_size, metrics.num_model_chunks, metrics.num_microbatches
    dispatch = metrics.dispatch_ms if charge_dispatch else 0.0
    built = build(
        schedule or megatron_schedule(chunks),
        pipeline_model_parallel_size=pp,
        num_microbatches=m,
        virtual_pipeline_model_parallel_size=chunks,
        microbatch_group_size_per_vp_stage=microbatch_group_size_per_vp_stage,
    )
    times = StageTimes(
        fwd_ms=tuple(f + dispatch for f in metrics.stage_forward_ms),
        bwd_ms=tuple(b + dispatch for b in metrics.stage_backward_ms),
        wgrad_ms=(0.0,) * len(metrics.stage_forward_ms),
    )
    result = simulate(built, times, p2p=P2PCost(latency_ms=p2p_latency_ms))
    # the simulator's compute is the measured compute: stage means x microbatches
    compute_ms = m * (sum(metrics.stage_forward_ms) + sum(metrics.stage_backward_ms))
    total = pp * result.step_time_ms
    bubble = 1.0 - compute_ms / total if total > 0 else 0.0
    return BubblePrediction(bubble_fraction=bubble, step_time_ms=result.step_time_ms,
                            dispatch_ms=dispatch, p2p_latency_ms=p2p_latency_ms)

