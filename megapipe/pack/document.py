"""The ``megapipe-pack/1`` document (pack.yaml): the assignments, every policy's figures, every job's options, the
what-if.

Pure: records in, plain dicts out, the same inputs giving the same dict (beside the plan document,
:mod:`megapipe.plan.document`, which each job's plan dir holds).
"""

from __future__ import annotations

import math

from megapipe.pack.pack import PackResult, gain
from megapipe.plan.interval import throughput_interval
from megapipe.records import ClusterSpec, JobSpec

__all__ = ["FORMAT", "pack_document", "plan_summary", "policies", "utilisation_gain"]

FORMAT = "megapipe-pack/1"


def _number(value: float) -> float | None:
    return None if value is None or not math.isfinite(value) else float(f"{value:.6g}")


def _assignment(job: JobSpec, option, cluster, finish: float | None) -> dict:
    plan, par = option.plan, option.plan.parallel
    return {
        "job": job.name, "model": job.model.name, "gpu": cluster.node_groups[option.group].gpu.name,
        "nodes": option.nodes, "gpus": option.nodes * cluster.gpus_per_node,
        "tensor_model_parallel_size": par.tensor_model_parallel_size,
        "pipeline_model_parallel_size": par.pipeline_model_parallel_size,
        "virtual_pipeline_model_parallel_size": par.virtual_pipeline_model_parallel_size,
        "context_parallel_size": par.context_parallel_size, "data_parallel_size": par.data_parallel_size,
        "expert_model_parallel_size": par.expert_model_parallel_size,
        "micro_batch_size": plan.train.micro_batch_size, "recompute_granularity": plan.train.recompute_granularity.value,
        "schedule": str(plan.schedule), "layout": plan.layout,
        "tokens_per_s": _number(option.tokens_per_s), **_rate_interval(option),
        "model_tflops_per_s": _number(option.flops_per_s / 1e12),
        "hours_for_budget_alone_on_these_nodes": _number(option.hours(job.tokens)) if job.tokens > 0 else None,
        "finish_h_with_repacking": _number(finish) if finish is not None else None,
        "deadline_hours": job.deadline_hours,
    }


def _rate_interval(option) -> dict:
    """tokens/s's interval (from the plan's step-time interval), when the runtime carries intervals."""
    interval = throughput_interval(option.plan.step_time_interval)
    return {} if interval is None else {"tokens_per_s_interval": list(interval)}


def plan_summary(plan) -> str:
    """A plan in one line: TP, PP, DP, CP, VP and EP, micro-batch, recompute and schedule."""
    par = plan.parallel
    return (f"TP{par.tensor_model_parallel_size} PP{par.pipeline_model_parallel_size} DP{par.data_parallel_size} "
            f"CP{par.context_parallel_size} VP{par.virtual_pipeline_model_parallel_size} "
            f"EP{par.expert_model_parallel_size}, mbs {plan.train.micro_batch_size}, recompute "
            f"{plan.train.recompute_granularity.value}, {plan.schedule}")


def _options(result, cluster) -> list[dict]:
    """Every option the packing chose among: per job, node group and node count, the planner's best plan there and
    its throughput; ``packed`` marks the one the packing took."""
    out = []
    for spec, options, taken in zip(result.jobs, result.curve_options, result.packed.options):
        for option in options:
            entry = {"job": spec.name, "gpu": cluster.node_groups[option.group].gpu.name, "nodes": option.nodes,
                     "tokens_per_s": _number(option.tokens_per_s), **_rate_interval(option),
                     "model_tflops_per_s": _number(option.flops_per_s / 1e12), "plan": plan_summary(option.plan),
                     "step_time_s": _number(option.plan.step_time_s)}
            if taken is not None and (option.group, option.nodes) == (taken.group, taken.nodes):
                entry["packed"] = True
            out.append(entry)
    return out


def _policy(policy, objective: str, packed) -> dict:
    run = policy.average_weighted_flops_per_s
    return {
        "name": policy.name, "aim": policy.aim, "note": policy.note,
        "weighted_model_pflops_per_s": _number(policy.weighted_flops_per_s / 1e15),
        "weighted_model_pflops_per_s_over_the_run": _number(run / 1e15) if run is not None else None,
        "utilisation_at_start": _number(policy.utilisation),
        "average_utilisation": _number(policy.average_utilisation) if policy.average_utilisation is not None else None,
        "makespan_h": _number(policy.makespan_h), "deadlines_met": policy.deadlines_met,
        "met_weight": _number(policy.met_weight), "repacks": policy.repacks, "restarts": policy.restarts,
        "gain_of_packing": _number(gain(packed, policy, objective)) if policy is not packed else None,
        "utilisation_gain_of_packing": _number(utilisation_gain(packed, policy)),
    }


def utilisation_gain(packed, policy) -> float | None:
    ours, theirs = packed.average_utilisation, policy.average_utilisation
    if ours is None or theirs is None or theirs <= 0:
        return None
    return ours / theirs - 1


def _timeline(result: PackResult, cluster) -> list[dict]:
    """Where each job of the packing ran when, repacking as jobs finish (empty without token budgets)."""
    return [{"job": result.jobs[segment.job].name, "gpu": cluster.node_groups[segment.group].gpu.name,
             "nodes": segment.nodes, "start_h": _number(segment.start_h), "restart_h": _number(segment.restart_h),
             "end_h": _number(segment.end_h)} for segment in result.packed.segments]


def policies(result: PackResult) -> tuple:
    """The packing, the packing for deadlines when there is one, then the baselines: the order tables list them."""
    return (result.packed, *((result.alternative,) if result.alternative is not None else ()), *result.baselines)


def pack_document(result: PackResult, cluster: ClusterSpec, *, inputs: dict) -> dict:
    """pack.yaml's content; ``inputs`` is the resolved config the packing was made from."""
    packed = result.packed
    finish = packed.finish_h or (None,) * len(result.jobs)
    document = {
        "format": FORMAT,
        "cluster": {"name": cluster.name, "gpus_per_node": cluster.gpus_per_node,
                    "node_groups": [{"gpu": g.gpu.name, "num_nodes": g.num_nodes} for g in cluster.node_groups]},
        "objective": result.objective,
        "assignments": [_assignment(spec, option, cluster, end)
                        for spec, option, end in zip(result.jobs, packed.options, finish)],
        "policies": [_policy(policy, result.objective, packed) for policy in policies(result)],
        "options": _options(result, cluster),
        "timeline": _timeline(result, cluster),
        "decision": {"planner_searches": result.searches},
        "inputs": inputs,
    }
    if result.what_if is not None:
        document["what_if"] = {
            "event": result.what_if.name, "moves": result.moves, "moved": list(result.moved),
            "node_groups": [{"gpu": g.gpu.name, "num_nodes": n} for g, n in
                            zip(cluster.node_groups, result.what_if_capacities)],
            "assignments": [_assignment(spec, option, cluster, None)
                            for spec, option in zip(result.what_if_jobs, result.what_if.options)],
            "policy": _policy(result.what_if, result.objective, result.what_if),
        }
    return document
