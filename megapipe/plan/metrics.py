"""From a simulated partition to a :class:`~megapipe.plan.plans.Plan`: the figures the ranking reads.

Step time = pipeline + exposed DP sync + optimizer step + the runtime's per-step overhead. MFU (Chowdhery et al. 2022, PaLM
App. B; Narayanan et al. 2021 eq. 3): model FLOPs per token times tokens/s over the sum of the
GPUs' dense bf16 peaks. Warnings: the hazards of :mod:`megapipe.plan.warnings`, then what the
emitters warn about the schedule (megatron-core runs only 1F1B and interleaved 1F1B, and its
layout cannot place V-shaped stages), so every ranked plan says whether Megatron runs it as
planned. Memory spread is (max - min) / mean of the per-rank peaks, memory CV
the population standard deviation over the mean.
"""

from __future__ import annotations

import dataclasses
import math

from megapipe.plan.interval import step_interval
from megapipe.plan.money import cost_per_million_tokens, training_cost
from megapipe.plan.plans import Candidate, Plan, StageUsage
from megapipe.options import SearchOptions
from megapipe.plan.warnings import plan_warnings
from megapipe.records import ClusterSpec, LayerKind, Partition, Recompute, StageSpec
from megapipe.schedules import megatron_runs, megatron_warnings
from megapipe.simulate import SimResult
from megapipe.units import GIB

__all__ = ["plan_record"]

_RECOMPUTE_ORDER = ("none", "selective", "full")


def plan_record(*, cand: Candidate, part: Partition, sim: SimResult, usages: tuple[StageUsage, ...],
                specs: tuple[StageSpec, ...], sync_ms: float, optimizer_ms: float, cluster: ClusterSpec,
                options: SearchOptions, flops_per_token: float, stage_recompute: tuple[str, ...] = (),
                step_overhead_ms: float = 0.0, breakdown: tuple[tuple[str, float], ...] = (),
                dispatcher_bytes: float = 0.0, moe: bool = False) -> Plan:
    """The Plan of one simulated partition: step time, throughput, MFU, memory spread, money, warnings."""
    par, train = cand.parallel, cand.train
    step_s = (sim.step_time_ms + sync_ms + optimizer_ms + step_overhead_ms) / 1e3
    tokens_per_s = train.global_batch_size * train.seq_length / step_s
    num_gpus = cluster.num_gpus
    peak_flops = sum(g.gpu.bf16_tflops * 1e12 * g.num_nodes * cluster.gpus_per_node for g in cluster.node_groups)
    totals = [u.total_bytes for u in usages]
    mean = sum(totals) / len(totals)
    over = max(u.total_bytes - spec.memory_bytes for u, spec in zip(usages, specs))
    over_gib = max(0.0, over / GIB)
    decoder_counts = tuple(sum(1 for kind in kinds if kind == LayerKind.decoder) for kinds in part.stage_kinds)
    warnings = plan_warnings(parallel=par, train=train, cluster=cluster, bubble_fraction=sim.bubble_fraction,
                             num_microbatches=cand.num_microbatches,
                             bubble_warning_range=options.bubble_warning_range, memory_over_gib=over_gib,
                             dispatcher_bytes=dispatcher_bytes,
                             bubble_goal=options.bubble_target[1] if options.bubble_target else None)
    if stage_recompute:
        strongest = max(stage_recompute, key=_RECOMPUTE_ORDER.index)
        train = dataclasses.replace(train, recompute_granularity=Recompute(strongest))
        warnings += (f"per-stage recompute {'/'.join(stage_recompute)}: Megatron applies one setting to every "
                     f"stage, so the emitted flags use recompute_granularity={strongest} (fits, runs slower)",)
    warnings += megatron_warnings(
        cand.schedule, pipeline_model_parallel_size=par.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=par.virtual_pipeline_model_parallel_size)
    return Plan(
        parallel=par, train=train, schedule=cand.schedule, num_microbatches=cand.num_microbatches,
        decoder_layers_per_stage=decoder_counts, layout=part.layout, method=part.method, pipeline_ms=sim.step_time_ms,
        dp_sync_ms=sync_ms, optimizer_ms=optimizer_ms, step_time_s=step_s, tokens_per_s=tokens_per_s,
        tokens_per_s_per_gpu=tokens_per_s / num_gpus,
        mfu=tokens_per_s * flops_per_token / peak_flops,
        bubble_fraction=sim.bubble_fraction, stages=usages,
        memory_spread=(max(totals) - min(totals)) / mean if mean else 0.0,
        memory_cv=math.sqrt(sum((t - mean) ** 2 for t in totals) / len(totals)) / mean if mean else 0.0,
        cost_per_million_tokens=cost_per_million_tokens(tokens_per_s=tokens_per_s, num_gpus=num_gpus,
                                                        price_per_gpu_hour=cluster.price_per_gpu_hour),
        total_cost=training_cost(total_tokens=options.total_tokens, tokens_per_s=tokens_per_s, num_gpus=num_gpus,
                                 price_per_gpu_hour=cluster.price_per_gpu_hour),
        what_if=not megatron_runs(cand.schedule, pipeline_model_parallel_size=par.pipeline_model_parallel_size),
        feasible=over_gib == 0.0, memory_over_gib=over_gib,
        warnings=warnings, stage_gpus=tuple(spec.gpu_name for spec in specs) if cluster.is_heterogeneous else (),
        stage_recompute=stage_recompute, step_overhead_ms=step_overhead_ms, breakdown=breakdown,
        step_time_interval=step_interval(cluster.runtime, moe=moe, architecture=cluster.gpu.architecture,
                                         precision=train.precision),
        partition=part, simulation=sim,
    )
