"""``megapipe pack``: share a cluster between training jobs; each job's nodes, GPU type and plan.

Reads ``cluster`` (node groups, mixed GPU types included), ``jobs`` (a hydra_conf/jobs list) and ``pack``
(objective, node counts, baselines, what-ifs). Writes into the run directory: ``pack.yaml``
(megapipe-pack/1: the assignments, every policy's figures and the gains), ``cluster.png`` (the nodes by
job) and ``jobs/<name>/`` per job, a plan dir as ``megapipe plan`` writes it (plan.yaml, Megatron-LM
arguments and launch script, Megatron-Bridge and NeMo overrides), for the job on its nodes.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

from omegaconf import DictConfig, OmegaConf

from megapipe.commands.common import console, print_json, warn
from megapipe.config import Scenario, recorded_inputs, to_scenario
from megapipe.config.jobs import jobs_of, pack_options
from megapipe.config.options import output_options, search_options
from megapipe.errors import ConfigError
from megapipe.files import atomic_write_text, dump_yaml
from megapipe.plandir import write_plan
from megapipe.pack import gain, pack_jobs
from megapipe.pack.curves import sub_cluster
from megapipe.pack.document import pack_document, utilisation_gain
from megapipe.plan.interval import format_share, throughput_interval
from megapipe.plan.space import pinned_problem
from megapipe.records import JobSpec
from megapipe.options import OutputOptions, PackOptions, SearchOptions

__all__ = ["PackInputs", "prepare", "run"]

@dataclass(frozen=True, slots=True, kw_only=True)
class PackInputs:
    scenario: Scenario
    """The command line's scenario: the jobs share its cluster (each job holds its own model and settings)."""
    jobs: tuple[JobSpec, ...]
    options: PackOptions
    search: SearchOptions
    output: OutputOptions
    inputs: dict


PACK_MAX_VIRTUAL = 4
"""The most chunks per rank each job's searches try unless search.max_virtual_pipeline_model_parallel_size says:
pack searches every job at every node count, and the full VP range multiplies that work several times over."""


def prepare(cfg: DictConfig) -> PackInputs:
    scenario = to_scenario(cfg, search=True)
    search = search_options(cfg)
    if search.max_virtual_pipeline_model_parallel_size is None:
        search = dataclasses.replace(search, max_virtual_pipeline_model_parallel_size=PACK_MAX_VIRTUAL)
    profile = cfg.get("profile")
    if profile:
        raise ConfigError(f"profile={profile} holds one model's layer costs; pack costs each job with the "
                          "cost model (plan one model with a profile in `megapipe plan profile=...`)")
    jobs = jobs_of(cfg, scenario.cluster)
    for index, spec in enumerate(jobs):
        problem = pinned_problem(model=spec.model, cluster=scenario.cluster, fixed=dict(spec.fixed),
                                 options=search)
        if problem:
            raise ConfigError(f"jobs.jobs[{index}] ({spec.name}): {problem}, or drop the job")
    inputs = recorded_inputs(cfg)
    inputs["jobs"] = OmegaConf.to_container(cfg.jobs, resolve=True)
    inputs["pack"] = OmegaConf.to_container(cfg.pack, resolve=True)
    options = pack_options(cfg, jobs)
    pinned = scenario.fixed.get("pipeline_model_parallel_size")
    if pinned is not None:  # the fixed-depth baseline keeps the depth every job is pinned to
        options = dataclasses.replace(options, baseline_pipeline_sizes=(int(pinned),))
    return PackInputs(scenario=scenario, jobs=jobs, options=options, search=search, output=output_options(cfg),
                      inputs=inputs)


def _write_job_dirs(directory: str, job: PackInputs, jobs, options, cluster) -> list[str]:
    written = []
    for spec, option in zip(jobs, options):
        sub = sub_cluster(cluster, option.group, option.nodes)
        path = os.path.join(directory, "jobs", spec.name)
        plan = write_plan(path, result=option.result, model=spec.model, cluster=sub,
                   inputs={"job": spec.name, "pack": job.inputs.get("pack"), "cluster_nodes": option.nodes},
                   bridge_keys=job.output.bridge_keys, extra={"seq_length_source": "the job list"},
                   title=f"megapipe pack: {spec.name} ({spec.model.name}) on {option.nodes} x {sub.gpu.name} nodes")
        emitted = plan.emission.emitted
        for warning in emitted.warnings if emitted else plan.emission.what_if:
            warn(f"job {spec.name}: {warning}")
        written.append(path)
    return written


def run(job: PackInputs, *, directory: str) -> None:
    cluster = job.scenario.cluster
    result = pack_jobs(job.jobs, cluster, job.options, search=job.search)
    packed = result.packed
    document = pack_document(result, cluster, inputs=job.inputs)
    atomic_write_text(os.path.join(directory, "pack.yaml"), dump_yaml(document))
    written = [os.path.join(directory, "pack.yaml")]
    written += _write_job_dirs(directory, job, result.jobs, packed.options, cluster)
    if job.output.pictures:
        from megapipe.report.cluster_map import cluster_map, node_owners

        place = lambda jobs, options: [(s.name, o.group, o.nodes) for s, o in zip(jobs, options)]  # noqa: E731
        panels = [(f"packed ({result.objective})", node_owners(result.capacities, place(result.jobs, packed.options)))]
        if result.what_if is not None:
            panels.append((result.what_if.name + f" ({result.moves} moved)",
                           node_owners(result.capacities, place(result.what_if_jobs, result.what_if.options),
                                       failed=[a - b for a, b in zip(result.capacities, result.what_if_capacities)])))
        written.append(cluster_map(panels, [f"{g.gpu.name}" for g in cluster.node_groups],
                                   os.path.join(directory, "cluster.png")))
    if job.output.json:
        print_json({**document, "files": written})
        return
    _print(result, cluster, directory, max_virtual=job.search.max_virtual_pipeline_model_parallel_size)


def _print(result, cluster, directory: str, *, max_virtual: int | None = None) -> None:
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
        share = utilisation_gain(packed, policy)
        objective_gain = gain(packed, policy, result.objective)
        gains = (f"{objective_gain:+.1f} weight" if result.objective == "deadlines" else f"{objective_gain:+.1%}")
        if share is not None:
            gains += f" ({share:+.1%} utilisation)"
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
    if max_virtual is not None:
        out.print(f"each job's searches try VP up to {max_virtual} (search.max_virtual_pipeline_model_parallel_size; "
                  "`megapipe plan` of one job tries every VP Megatron allows)", markup=False)
    out.print(f"decided in {result.seconds:.1f} s ({result.searches} planner searches in all); files in {directory}: "
              "pack.yaml, cluster.png, jobs/<name>/ (plan.yaml, megatron_args.txt, launch_megatron.sh, launch_slurm.sbatch, "
              "bridge_overrides.txt, nemo2_overrides.txt, nemo1_overrides.txt)")
