"""What a ``megapipe-plan/1`` document predicts for a run, and how far measurements drift from it (pure).

Drift of a time or a memory figure is relative, ``|measured - predicted| /
predicted``; drift of the bubble fraction (already a share of the step) is the
absolute difference. A figure drifts when that exceeds the threshold (default
0.1). Per-stage memory drift is the largest over the pipeline ranks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


__all__ = ["PlanExpectation", "Drift", "expectation", "drifts", "advice"]


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanExpectation:
    """The best plan's predictions (``best`` of plan.yaml) and its assumed topology."""

    step_time_s: float
    bubble_fraction: float
    stage_bytes: tuple[float, ...]
    """Predicted peak bytes per pipeline rank."""
    stage_time_ms: tuple[float, ...]
    """Predicted forward + backward per microbatch per pipeline rank."""
    layout: str
    decoder_layers_per_stage: tuple[int, ...]
    schedule: str
    pipeline_model_parallel_size: int
    num_microbatches: int
    topology: dict
    """``intra_node`` / ``inter_node`` link records and ``gpus_per_node``."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Drift:
    figure: str
    """``step_time_s``, ``bubble_fraction`` or ``stage_memory_bytes``."""
    measured: float
    predicted: float
    drift: float
    relative: bool


def expectation(document: dict) -> PlanExpectation:
    """Read a plan document (the parsed plan.yaml, checked by :func:`megapipe.plandir.checked_plan_document`)."""
    best = document["best"]
    stages = best.get("stages") or []
    return PlanExpectation(
        step_time_s=float(best["step_time_s"]),
        bubble_fraction=float(best["bubble_fraction"]),
        stage_bytes=tuple(float(s["total_bytes"]) for s in stages),
        stage_time_ms=tuple(float(s["time_ms"]) for s in stages),
        layout=str(best.get("layout", "")),
        decoder_layers_per_stage=tuple(int(x) for x in best.get("decoder_layers_per_stage", ())),
        schedule=str(best.get("schedule", "")),
        pipeline_model_parallel_size=int(best["parallel"]["pipeline_model_parallel_size"]),
        num_microbatches=int(best["train"]["num_microbatches"]),
        topology=dict(document.get("topology") or {}),
    )


def _finite(x: float | None) -> bool:
    return x is not None and math.isfinite(x)


def drifts(plan: PlanExpectation, *, step_time_s: float | None, bubble_fraction: float | None,
           stage_peak_bytes: Sequence[float] | None) -> list[Drift]:
    """Every figure that can be compared (measured figure finite, prediction positive)."""
    out = []
    if _finite(step_time_s) and plan.step_time_s > 0:
        out.append(Drift(figure="step_time_s", measured=step_time_s, predicted=plan.step_time_s,
                         drift=abs(step_time_s - plan.step_time_s) / plan.step_time_s, relative=True))
    if _finite(bubble_fraction):
        out.append(Drift(figure="bubble_fraction", measured=bubble_fraction, predicted=plan.bubble_fraction,
                         drift=abs(bubble_fraction - plan.bubble_fraction), relative=False))
    if stage_peak_bytes is not None and len(stage_peak_bytes) == len(plan.stage_bytes):
        pairs = [(m, p) for m, p in zip(stage_peak_bytes, plan.stage_bytes) if _finite(m) and p > 0]
        if pairs:
            measured, predicted = max(pairs, key=lambda mp: abs(mp[0] - mp[1]) / mp[1])
            out.append(Drift(figure="stage_memory_bytes", measured=measured, predicted=predicted,
                             drift=abs(measured - predicted) / predicted, relative=True))
    return out


def advice(drift: Drift, *, threshold: float, run_dir: str | None) -> str:
    """The one-line warning for a drifting figure, with the command that re-plans from the measurement."""
    unit = "relative" if drift.relative else "absolute"
    where = run_dir or "RUN_DIR"
    return (f"drift: measured {drift.figure} {drift.measured:.4g} vs plan {drift.predicted:.4g} "
            f"({unit} drift {drift.drift:.3f} > threshold {threshold:g}); re-plan from the measurement: "
            f"`megapipe replan {where}` (re-partitions and writes the measured profile.yaml to its output dir) "
            f"or `megapipe plan ... profile=<measured profile.yaml>`")
