"""Throughput of measured steps with the planner's FLOP convention (pure).

Model FLOPs per token come from :func:`megapipe.cost.model_flops_per_token`
(``6 N + 6 L s q``; Chowdhery et al. 2022, PaLM App. B, causal attention
counted as the lower triangle; recompute not counted), exactly what
``megapipe.plan.evaluate`` uses, so measured and planned MFU compare directly.
MFU = achieved model FLOP/s per GPU / the GPU's dense bf16 peak.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megapipe.errors import ConfigError

__all__ = ["Throughput", "throughput"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Throughput:
    step_time_s: float
    tokens_per_s: float
    tokens_per_s_per_gpu: float
    tflops_per_gpu: float | None
    """Model TFLOP/s per GPU; None without FLOPs per token."""
    mfu: float | None
    """None without FLOPs per token or a peak (e.g. on CPU)."""


def throughput(*, tokens_per_step: float, step_time_s: float, num_gpus: int,
               flops_per_token: float | None = None, peak_tflops_per_gpu: float | None = None) -> Throughput | None:
    """Figures of one step (or a mean step); None when the step time is not a positive number."""
    if not (isinstance(num_gpus, int) and num_gpus >= 1):
        raise ConfigError(f"{num_gpus=} must be an int >= 1 (GPUs of the run)")
    if not (math.isfinite(step_time_s) and step_time_s > 0):
        return None
    tokens_per_s = tokens_per_step / step_time_s
    per_gpu = tokens_per_s / num_gpus
    tflops = per_gpu * flops_per_token / 1e12 if flops_per_token else None
    mfu = tflops / peak_tflops_per_gpu if tflops is not None and peak_tflops_per_gpu else None
    return Throughput(step_time_s=step_time_s, tokens_per_s=tokens_per_s, tokens_per_s_per_gpu=per_gpu,
                      tflops_per_gpu=tflops, mfu=mfu)
