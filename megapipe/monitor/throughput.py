"""Throughput of measured steps with the planner's FLOP convention (pure).

Model FLOPs per token come from :func:`megapipe.cost.model_flops_per_token`
(``6 N + 6 L s q``; Chowdhery et al. 2022, PaLM App. B, causal attention
counted as the lower triangle; recompute not counted), exactly what
``megapipe.plan.evaluator`` uses, so measured and planned MFU compare directly.
MFU = achieved model FLOP/s per GPU / the GPU's dense bf16 peak.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megapipe.errors import ConfigError

__all__ = ["Throughput", "throughput", "PlanRates", "plan_rates"]


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


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanRates:
    """What a plan.yaml fixes for throughput: the planner's own MFU inputs."""

    tokens_per_step: float
    """global_batch_size x seq_length of the best plan's train section."""
    flops_per_token: float
    """``model_flops_per_token`` of the plan's model section at that seq_length."""
    peak_tflops_per_gpu: float | None
    """Dense bf16 peak per GPU, averaged over the cluster's node groups (as the planner's MFU)."""


def plan_rates(document: dict) -> PlanRates | None:
    """Throughput inputs from a ``megapipe-plan/1`` document; None when it has no model section."""
    import dataclasses

    from megapipe.cost import model_flops_per_token
    from megapipe.records import Activation, AttentionBackend, ModelSpec

    model = document.get("model")
    if not isinstance(model, dict):
        return None
    train = document["best"].get("train") or {}
    names = {f.name for f in dataclasses.fields(ModelSpec)}
    try:
        fields = {key: value for key, value in model.items() if key in names}
        fields["num_query_groups"] = fields.get("num_query_groups") or fields["num_attention_heads"]
        for key, kind in (("activation", Activation), ("attention_backend", AttentionBackend)):
            if key in fields:
                fields[key] = kind(fields[key])
        spec = ModelSpec(**fields)
        seq_length = int(train.get("seq_length") or spec.seq_length)
        tokens = float(train["global_batch_size"]) * seq_length
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"plan.yaml model/train section is incomplete ({exc!r}); pass the plan.yaml that "
                          "`megapipe plan` wrote, or tokens_per_step= and flops_per_token= explicitly") from None
    return PlanRates(tokens_per_step=tokens, flops_per_token=model_flops_per_token(spec, seq_length),
                     peak_tflops_per_gpu=_peak_tflops(document.get("cluster") or {}))


def _peak_tflops(cluster: dict) -> float | None:
    groups = [g for g in cluster.get("node_groups") or () if isinstance(g, dict) and "gpu" in g]
    nodes = sum(int(g.get("num_nodes", 1)) for g in groups)
    if not groups or nodes <= 0:
        return None
    return sum(float(g["gpu"]["bf16_tflops"]) * int(g.get("num_nodes", 1)) for g in groups) / nodes
