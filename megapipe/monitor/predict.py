"""What the bubble should have been: megapipe's simulator fed with measured stage times.

The hook measures each virtual stage's mean forward and backward time per
microbatch; :func:`simulated_bubble_fraction` builds the same schedule megatron-core
ran (``megapipe.schedules.build``) and times it with ``megapipe.simulate`` using
those measured times and zero p2p cost. Both sides use the flushed bubble of one
step, ``1 - sum(busy) / (P * step_time)`` (Qi et al. 2024, Sec. 3), so a gap
between them is time the simulator does not model: p2p transfer, Python between
ops, stragglers.

When the simulator cannot be imported the closed form for equal stages,
``(P - 1) / (v * m + P - 1)`` (Narayanan et al. 2021, Sec. 2.2), is used instead.
"""

from __future__ import annotations

from megapipe.monitor.metrics import PipelineMetrics

__all__ = ["default_schedule", "closed_form_bubble_fraction", "simulated_bubble_fraction"]


def default_schedule(num_model_chunks: int) -> str:
    """The schedule ``get_forward_backward_func()`` picks: interleaved with virtual stages, else 1F1B."""
    return "interleaved_1f1b" if num_model_chunks > 1 else "1f1b"


def closed_form_bubble_fraction(*, pipeline_model_parallel_size: int, num_microbatches: int, num_model_chunks: int = 1) -> float:
    """(P - 1) / (v m + P - 1): the share of a flushed 1F1B/interleaved step spent idle, equal stages."""
    pp = pipeline_model_parallel_size
    return (pp - 1) / (num_model_chunks * num_microbatches + pp - 1)


def _simulator():
    try:
        from megapipe.simulate import P2PCost, StageTimes, simulate
        try:
            from megapipe.schedules import build
        except ImportError:
            from megapipe.schedules.registry import build
    except Exception:  # simulator missing or broken: fall back to the closed form
        return None
    return build, StageTimes, simulate, P2PCost


def simulated_bubble_fraction(
    metrics: PipelineMetrics,
    *,
    schedule: str | None = None,
    microbatch_group_size_per_vp_stage: int | None = None,
    p2p_latency_ms: float = 0.0,
) -> tuple[float, str]:
    """(bubble fraction, source) predicted from the measured per-stage times.

    ``p2p_latency_ms`` is the cost of one activation/gradient message between
    neighbouring ranks (zero: compute only). ``source`` is ``"simulator"`` or
    ``"closed_form"`` (when megapipe's simulator is unavailable; exact only for
    equal stages and zero message cost).
    """
    pp, chunks, m = metrics.pipeline_model_parallel_size, metrics.num_model_chunks, metrics.num_microbatches
    parts = _simulator()
    if parts is None:
        return closed_form_bubble_fraction(pipeline_model_parallel_size=pp, num_microbatches=m, num_model_chunks=chunks), "closed_form"
    build, stage_times, simulate, p2p_cost = parts
    built = build(
        schedule or default_schedule(chunks),
        pipeline_model_parallel_size=pp,
        num_microbatches=m,
        virtual_pipeline_model_parallel_size=chunks,
        microbatch_group_size_per_vp_stage=microbatch_group_size_per_vp_stage,
    )
    times = stage_times(
        fwd_ms=tuple(metrics.stage_forward_ms),
        bwd_ms=tuple(metrics.stage_backward_ms),
        wgrad_ms=(0.0,) * len(metrics.stage_forward_ms),
    )
    return simulate(built, times, p2p=p2p_cost(latency_ms=p2p_latency_ms)).bubble_fraction, "simulator"
