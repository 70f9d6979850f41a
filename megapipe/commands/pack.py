"""``megapipe pack``: share a cluster between training jobs; each job's nodes, GPU type and plan.

Reads ``cluster`` (node groups, mixed GPU types included), ``jobs`` (a hydra_conf/jobs list) and ``pack``
(objective, node counts, baselines, what-ifs). Writes into the run directory: ``pack.yaml``
(megapipe-pack/1: the assignments, every policy's figures and the gains), ``cluster.png`` (the nodes by
job) and ``jobs/<name>/`` per job, a plan dir as ``megapipe plan`` writes it (plan.yaml, Megatron-LM
arguments and launch script, Megatron-Bridge and NeMo overrides), for the job on its nodes.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from omegaconf import DictConfig, OmegaConf

from megapipe.commands.common import console, print_json
from megapipe.config import Setup, recorded_inputs, to_setup
from megapipe.config.jobs import jobs_of, pack_options
from megapipe.files import atomic_write_text, dump_yaml
from megapipe.plandir import write_plan
from megapipe.pack import gain, pack_jobs
from megapipe.pack.curves import sub_cluster
from megapipe.plan.interval import format_share, throughput_interval
from megapipe.records import JobSpec
from megapipe.options import PackOptions

__all__ = ["PackJob", "prepare", "run"]

FORMAT = "megapipe-pack/1"


@dataclass(frozen=True, slots=True, kw_only=True)
class PackJob:
    setup: Setup
    jobs: tuple[JobSpec, ...]
    options: PackOptions
    inputs: dict


def prepare(cfg: DictConfig) -> PackJob:
    setup = to_setup(cfg, search=True)
    jobs = jobs_of(cfg, setup.cluster)
    inputs = recorded_inputs(cfg)
    inputs["jobs"] = OmegaConf.to_container(cfg.jobs, resolve=True)
    inputs["pack"] = OmegaConf.to_container(cfg.pack, resolve=True)
    return PackJob(setup=setup, jobs=jobs, options=pack_options(cfg, jobs), inputs=inputs)


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


def _curves(result, cluster) -> list[dict]:
    """Every job's curve: its best plan's throughput at each (GPU type, node count) the packing chose among."""
    out = []
    for spec, options in zip(result.jobs, result.curve_options):
        points = [{"gpu": cluster.node_groups[option.group].gpu.name, "nodes": option.nodes,
                   "tokens_per_s": _number(option.tokens_per_s), **_rate_interval(option),
                   "step_time_s": _number(option.plan.step_time_s),
                   **({"step_time_interval": list(option.plan.step_time_interval)}
                      if option.plan.step_time_interval else {})}
                  for option in options]
        out.append({"job": spec.name, "points": points})
    return out


def _policy(policy, objective: str, packed) -> dict:
    return {
        "name": policy.name, "note": policy.note,
        "weighted_model_pflops_per_s": _number(policy.weighted_flops_per_s / 1e15),
        "utilisation_at_start": _number(policy.utilisation),
        "average_utilisation": _number(policy.average_utilisation) if policy.average_utilisation is not None else None,
        "makespan_h": _number(policy.makespan_h), "deadlines_met": policy.deadlines_met,
        "met_weight": _number(policy.met_weight), "repacks": policy.repacks, "restarts": policy.restarts,
        "gain_of_packing": _number(gain(packed, policy, objective)),
        "utilisation_gain_of_packing": _number(_utilisation_gain(packed, policy)),
    }


def _utilisation_gain(packed, policy) -> float | None:
    ours, theirs = packed.average_utilisation, policy.average_utilisation
    if ours is None or theirs is None or theirs <= 0:
        return None
    return ours / theirs - 1


def _write_job_dirs(directory: str, job: PackJob, jobs, options, cluster) -> list[str]:
    written = []
    for spec, option in zip(jobs, options):
        sub = sub_cluster(cluster, option.group, option.nodes)
        path = os.path.join(directory, "jobs", spec.name)
        write_plan(path, result=option.result, model=spec.model, cluster=sub,
                   inputs={"job": spec.name, "pack": job.inputs.get("pack"), "cluster_nodes": option.nodes},
                   bridge_keys=job.setup.output.bridge_keys, extra={"seq_length_source": "the job list"},
                   title=f"megapipe pack: {spec.name} ({spec.model.name}) on {option.nodes} x {sub.gpu.name} nodes")
        written.append(path)
    return written


def run(job: PackJob, *, directory: str) -> None:
    cluster = job.setup.cluster
    result = pack_jobs(job.jobs, cluster, job.options)
    packed = result.packed
    finish = packed.finish_h or (None,) * len(result.jobs)
    document = {
        "format": FORMAT,
        "cluster": {"name": cluster.name, "gpus_per_node": cluster.gpus_per_node,
                    "node_groups": [{"gpu": g.gpu.name, "num_nodes": g.num_nodes} for g in cluster.node_groups]},
        "objective": result.objective,
        "assignments": [_assignment(spec, option, cluster, end)
                        for spec, option, end in zip(result.jobs, packed.options, finish)],
        "policies": [_policy(policy, result.objective, packed) for policy in (packed, *result.baselines)],
        "curves": _curves(result, cluster),
        "decision": {"planner_searches": result.searches},
        "inputs": job.inputs,
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
    atomic_write_text(os.path.join(directory, "pack.yaml"), dump_yaml(document))
    written = [os.path.join(directory, "pack.yaml")]
    written += _write_job_dirs(directory, job, result.jobs, packed.options, cluster)
    if job.setup.output.pictures:
        from megapipe.report.cluster_map import cluster_map, node_owners

        place = lambda jobs, options: [(s.name, o.group, o.nodes) for s, o in zip(jobs, options)]  # noqa: E731
        panels = [(f"packed ({result.objective})", node_owners(result.capacities, place(result.jobs, packed.options)))]
        if result.what_if is not None:
            panels.append((result.what_if.name + f" ({result.moves} moved)",
                           node_owners(result.capacities, place(result.what_if_jobs, result.what_if.options),
                                       failed=[a - b for a, b in zip(result.capacities, result.what_if_capacities)])))
        written.append(cluster_map(panels, [f"{g.gpu.name}" for g in cluster.node_groups],
                                   os.path.join(directory, "cluster.png")))
    if job.setup.output.json:
        print_json({**document, "files": written})
        return
    _print(result, cluster, directory)


def _print(result, cluster, directory: str) -> None:
    from rich.table import Table

    out = console()
    packed = result.packed
    table = Table(title=f"megapipe pack: {len(result.jobs)} jobs on {cluster.name} "
                        f"({', '.join(f'{g.num_nodes} x {g.gpu.name}' for g in cluster.node_groups)} nodes), "
                        f"objective {result.objective}", title_justify="left")
    for column in ("job", "model", "GPU", "nodes", "TP/PP/DP/CP/VP EP", "mbs", "recompute", "schedule", "tok/s",
                   "h alone", "finish h", "deadline"):
        table.add_column(column, overflow="fold")
    finish = packed.finish_h or (None,) * len(result.jobs)
    for spec, option, end in zip(result.jobs, packed.options, finish):
        par, plan = option.plan.parallel, option.plan
        table.add_row(spec.name, spec.model.name, cluster.node_groups[option.group].gpu.name, str(option.nodes),
                      f"{par.tensor_model_parallel_size}/{par.pipeline_model_parallel_size}/{par.data_parallel_size}/"
                      f"{par.context_parallel_size}/{par.virtual_pipeline_model_parallel_size} "
                      f"EP{par.expert_model_parallel_size}",
                      str(plan.train.micro_batch_size), plan.train.recompute_granularity.value, str(plan.schedule),
                      f"{option.tokens_per_s:,.0f}" + format_share(throughput_interval(plan.step_time_interval)),
                      f"{option.hours(spec.tokens):.1f}" if spec.tokens > 0 else "-",
                      f"{end:.1f}" if end is not None else "-",
                      "-" if spec.deadline_hours is None else
                      f"{spec.deadline_hours:g}" + (" met" if end is not None and end <= spec.deadline_hours else
                                                   " missed" if end is not None else ""))
    out.print(table)
    policies = Table(title="against the baselines (finish h and average utilisation repack the cluster as jobs finish)",
                     title_justify="left")
    for column in ("policy", "weighted PFLOP/s at start", "utilisation at start", "average utilisation", "makespan h",
                   "deadlines met", "packing's gain", "note"):
        policies.add_column(column, overflow="fold")
    for policy in (packed, *result.baselines):
        utilisation_gain = _utilisation_gain(packed, policy)
        objective_gain = gain(packed, policy, result.objective)
        gains = (f"{objective_gain:+.1f} weight" if result.objective == "deadlines" else f"{objective_gain:+.1%}")
        if utilisation_gain is not None:
            gains += f" ({utilisation_gain:+.1%} utilisation)"
        policies.add_row(policy.name, f"{policy.weighted_flops_per_s / 1e15:,.1f}", f"{policy.utilisation:.1%}",
                         "-" if policy.average_utilisation is None else f"{policy.average_utilisation:.1%}",
                         "-" if not math.isfinite(policy.makespan_h) else f"{policy.makespan_h:.1f}",
                         str(policy.deadlines_met), "" if policy is packed else gains, policy.note)
    out.print(policies)
    if result.what_if is not None:
        out.print(f"{result.what_if.name}: {result.moves} job(s) move ({', '.join(result.moved) or 'none'}); "
                  f"weighted {result.what_if.weighted_flops_per_s / 1e15:,.1f} PFLOP/s, utilisation "
                  f"{result.what_if.utilisation:.1%}")
        for spec, option in zip(result.what_if_jobs, result.what_if.options):
            out.print(f"  {spec.name}: {option.nodes} x {cluster.node_groups[option.group].gpu.name}, "
                      f"TP{option.plan.parallel.tensor_model_parallel_size} "
                      f"PP{option.plan.parallel.pipeline_model_parallel_size}, {option.tokens_per_s:,.0f} tok/s")
    out.print(f"decided in {result.seconds:.1f} s ({result.searches} planner searches in all); files in {directory}: "
              "pack.yaml, cluster.png, jobs/<name>/ (plan.yaml, megatron_args.txt, launch_megatron.sh, "
              "bridge_overrides.txt, nemo2_overrides.txt, nemo1_overrides.txt)")
