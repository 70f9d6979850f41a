"""``megapipe pack``: share a cluster between training jobs; each job's nodes, GPU type and plan.

Reads ``cluster`` (node groups, mixed GPU types included; a homogeneous cluster gets the job list's
``jobs.num_nodes`` unless the command line sets ``cluster=`` or ``cluster.num_nodes=``), ``jobs`` (a
hydra_conf/jobs list) and ``pack`` (objective, node counts, baselines, what-ifs); every job is searched with
the command line's ``parallel.*``, ``schedule=``, ``train.*`` and ``search.*`` as ``megapipe plan`` would. Prints
each job's place and plan, then every policy (what it optimises, its throughput over the run, makespan and
deadlines met) beside the packing, and, when the packing misses a deadline and every job has one, the packing
for deadlines too.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

from omegaconf import DictConfig, OmegaConf

from megapipe.commands import painter
from megapipe.commands.common import console, print_json, process_map, process_workers, warn
from megapipe.config import Scenario, recorded_inputs, to_scenario
from megapipe.config.jobs import jobs_of, pack_options, with_jobs_nodes
from megapipe.config.options import output_options, search_options
from megapipe.errors import ConfigError
from megapipe.files import atomic_write_text, dump_yaml
from megapipe.plandir import PLAN_DIR_FILES, write_plan
from megapipe.pack import gain, pack_jobs
from megapipe.pack.curves import sub_cluster
from megapipe.pack.document import pack_document, plan_summary, policies, utilisation_gain
from megapipe.pack.pack import AIMS
from megapipe.pack.solve import uses_dp
from megapipe.plan.interval import format_share, throughput_interval
from megapipe.plan.space import pinned_problem
from megapipe.records import JobSpec
from megapipe.options import OutputOptions, PackOptions, SearchOptions

__all__ = ["PackInputs", "prepare", "run", "CONFIG_KEYS", "FILES"]

CONFIG_KEYS = ("jobs", "pack", "cluster", "runtime", "parallel", "train", "schedule", "search.objective",
               "search.allow_cross_node_tp", "search.max_pipeline_model_parallel_size",
               "search.max_virtual_pipeline_model_parallel_size", "output.format", "output.dir", "output.pictures",
               "output.bridge_keys")
"""What `megapipe pack --help` lists (:mod:`megapipe.config.keys`)."""
FILES = (("pack.yaml", "the packing (megapipe-pack/1): each job's place and plan, every policy's figures and aim, "
                       "every option the packing chose among (options:), the timeline"),
         ("cluster.png", "every node coloured by its job at the start, and after the what-if when there is one"),
         ("timeline.png", "nodes by hours: each job's block until its budget is done, the repacks and restarts"),
         ("jobs/<name>/", "a plan dir per job as megapipe plan writes it, without pictures (megapipe plan --help): "
                          + ", ".join(name for name, _ in PLAN_DIR_FILES[:4]) + ", ..."))
"""What `megapipe pack --help` lists as written."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PackInputs:
    scenario: Scenario
    """The command line's scenario: the jobs share its cluster (each job holds its own model and settings)."""
    jobs: tuple[JobSpec, ...]
    options: PackOptions
    search: SearchOptions
    output: OutputOptions
    inputs: dict
    nodes_source: str | None = None
    """Where the cluster's node count comes from when the job list set it."""


PACK_MAX_VIRTUAL = 4
"""The most chunks per rank each job's searches try unless search.max_virtual_pipeline_model_parallel_size says:
pack searches every job at every node count, and the full VP range multiplies that work several times over."""


def prepare(cfg: DictConfig) -> PackInputs:
    cfg, nodes_source = with_jobs_nodes(cfg)
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
                      inputs=inputs, nodes_source=nodes_source)


def _write_job_dirs(directory: str, job: PackInputs, jobs, options, cluster) -> list[str]:
    written = []
    for spec, option in zip(jobs, options):
        sub = sub_cluster(cluster, option.group, option.nodes)
        path = os.path.join(directory, "jobs", spec.name)
        plan = write_plan(path, result=option.result, model=spec.model, cluster=sub,
                          inputs={"job": spec.name, "pack": job.inputs.get("pack"), "cluster_nodes": option.nodes},
                          bridge_keys=job.output.bridge_keys, extra={"seq_length_source": "the job list"},
                          title=f"megapipe pack: {spec.name} ({spec.model.name}) on {option.nodes} {sub.gpu.name} "
                                f"nodes ({sub.num_gpus} GPUs)")
        emitted = plan.emission.emitted
        for warning in emitted.warnings if emitted else plan.emission.what_if:
            warn(f"job {spec.name}: {warning}")
        written.append(path)
    return written


class _Pictures:
    """cluster.png and timeline.png, each handed to the painter as soon as what it shows is known, while the rest of
    the packing is worked out: the cluster map at the packing's decision (at the end where a what-if adds its
    panel), the timeline once the packing and the packing for deadlines are run to the end."""

    def __init__(self, job: PackInputs, directory: str):
        cluster, options = job.scenario.cluster, job.options
        self.directory, self.objective = directory, options.objective
        self.what_if = options.what_if
        self.capacities = tuple(group.num_nodes for group in cluster.node_groups)
        self.groups = [group.gpu.name for group in cluster.node_groups]
        shown = [spec for spec in job.jobs if options.arrive or not spec.arrives_later]  # the jobs present, the arrivals
        self.coloured = tuple(sorted({spec.name for spec in shown}))  # the painter picks their colours
        self.jobs: tuple[JobSpec, ...] = ()

    def decided(self, jobs, packed) -> None:
        self.jobs = jobs
        if not self.what_if:
            self._cluster_map(packed)

    def ran(self, packed, alternative) -> None:
        from megapipe.report.pack_timeline import timeline_chart

        timelines = [policy for policy in (packed, alternative) if policy is not None and policy.segments]
        if timelines:
            painter.draw(timeline_chart, [(policy.name, policy.aim, policy.segments) for policy in timelines],
                         self.jobs, self.capacities, self.groups, os.path.join(self.directory, "timeline.png"),
                         coloured=self.coloured)

    def finished(self, result) -> None:
        if self.what_if:
            self._cluster_map(result.packed, result)

    def _cluster_map(self, packed, result=None) -> None:
        from megapipe.report.cluster_map import cluster_map, node_owners

        place = lambda jobs, options: [(s.name, o.group, o.nodes) for s, o in zip(jobs, options)]  # noqa: E731
        panels = [(f"packed ({self.objective}): at the start", node_owners(self.capacities,
                                                                            place(self.jobs, packed.options)))]
        if result is not None and result.what_if is not None:
            panels.append((result.what_if.name + f" ({result.moves} moved)",
                           node_owners(self.capacities, place(result.what_if_jobs, result.what_if.options),
                                       failed=[a - b for a, b in zip(self.capacities, result.what_if_capacities)])))
        painter.draw(cluster_map, panels, self.groups, os.path.join(self.directory, "cluster.png"),
                     coloured=self.coloured)


def _import_solver() -> None:
    import scipy.optimize  # noqa: F401  HiGHS, for the packing MILPs (:func:`megapipe.pack.solve.solve_milp`)


def _uses_milp(job: PackInputs) -> bool:
    """Whether the packings go to the MILP (:func:`megapipe.pack.solve.solve_packing`): a what-if's repacking (the
    fewest moves), or node groups too large for the dynamic program."""
    return job.options.what_if or not uses_dp([group.num_nodes for group in job.scenario.cluster.node_groups])


def run(job: PackInputs, *, directory: str) -> None:
    cluster = job.scenario.cluster
    drawn = _Pictures(job, directory) if job.output.pictures else None  # the painter draws while the rest goes on
    # a 405B job's curve against an 8B one's: one at a time; where the packings need the MILP, its solver is imported
    # here once a core is left idle by the curves' searches, and the policies' processes fork after it
    with process_map(len(job.jobs), one_at_a_time=True, meanwhile=_import_solver if _uses_milp(job) else None,
                     collect=False) as mapper:
        result = pack_jobs(job.jobs, cluster, job.options, search=job.search, mapper=mapper,
                           workers=process_workers(len(job.jobs)), decided=drawn and drawn.decided,
                           ran=drawn and drawn.ran)
    if drawn is not None:
        drawn.finished(result)
    document = pack_document(result, cluster, inputs=job.inputs)
    atomic_write_text(os.path.join(directory, "pack.yaml"), dump_yaml(document))
    written = [os.path.join(directory, "pack.yaml")]
    written += _write_job_dirs(directory, job, result.jobs, result.packed.options, cluster)
    pictures = [os.path.join(directory, name) for name in ("cluster.png", "timeline.png")
                if job.output.pictures and (name == "cluster.png" or result.packed.segments)]
    if job.output.json:
        print_json({**document, "files": written + pictures})
    else:
        _print(result, cluster, directory, nodes_source=job.nodes_source, pictures=pictures,
               max_virtual=job.search.max_virtual_pipeline_model_parallel_size)


def _title(result, cluster, nodes_source: str | None) -> str:
    groups = " + ".join(f"{g.num_nodes} {g.gpu.name}" for g in cluster.node_groups)
    source = f"; {nodes_source}" if nodes_source else ""
    return (f"megapipe pack: {len(result.jobs)} jobs on {groups} nodes ({cluster.num_gpus} GPUs, {cluster.gpus_per_node} "
            f"per node{source}), objective {result.objective}: {AIMS[result.objective]}")


def _print(result, cluster, directory: str, *, nodes_source: str | None, pictures: list[str],
           max_virtual: int | None = None) -> None:
    out = console()
    out.print(_jobs_table(result, cluster, nodes_source))
    out.print(_policies_table(result))
    for line in _deadline_notes(result):
        out.print(line, markup=False)
    if result.what_if is not None:
        out.print(f"{result.what_if.name}: {result.moves} job(s) move ({', '.join(result.moved) or 'none'}); "
                  f"weighted {result.what_if.weighted_flops_per_s / 1e15:,.1f} PFLOP/s, utilisation "
                  f"{result.what_if.utilisation:.1%}", markup=False)
        for spec, option in zip(result.what_if_jobs, result.what_if.options):
            out.print(f"  {spec.name}: {option.nodes} {cluster.node_groups[option.group].gpu.name} nodes "
                      f"({option.nodes * cluster.gpus_per_node} GPUs), {plan_summary(option.plan)}, "
                      f"{option.tokens_per_s:,.0f} tok/s", markup=False)
    if max_virtual is not None:
        out.print(f"each job's searches try VP up to {max_virtual} (search.max_virtual_pipeline_model_parallel_size; "
                  "`megapipe plan` of one job tries every VP Megatron allows)", markup=False)
    names = ", ".join(os.path.basename(path) for path in pictures)
    depths = "/".join(str(size) for size in result.baseline_pipeline_sizes)
    each = f", each also at pipeline sizes {depths} for the fixed-depth baseline" if depths else ""
    out.print(f"decided in {result.seconds:.1f} s ({result.searches} planner searches in all{each}); files in {directory}: "
              f"pack.yaml, {names + ', ' if names else ''}jobs/<name>/ (plan.yaml, megatron_args.txt, "
              "launch_megatron.sh, launch_slurm.sbatch, bridge_overrides.txt, nemo2_overrides.txt, "
              "nemo1_overrides.txt)", markup=False)


def _jobs_table(result, cluster, nodes_source: str | None):
    from rich.table import Table

    table = Table(title=_title(result, cluster, nodes_source), title_justify="left")
    for column in ("job", "model", "GPU", "nodes", "GPUs", "TP/PP/DP/CP/VP EP", "mbs", "recompute", "schedule",
                   "tok/s", "h alone", "finish h", "deadline h"):
        table.add_column(column, overflow="fold")
    packed = result.packed
    finish = packed.finish_h or (None,) * len(result.jobs)
    for spec, option, end in zip(result.jobs, packed.options, finish):
        par, plan = option.plan.parallel, option.plan
        table.add_row(spec.name, spec.model.name, cluster.node_groups[option.group].gpu.name, str(option.nodes),
                      str(option.nodes * cluster.gpus_per_node),
                      f"{par.tensor_model_parallel_size}/{par.pipeline_model_parallel_size}/{par.data_parallel_size}/"
                      f"{par.context_parallel_size}/{par.virtual_pipeline_model_parallel_size} "
                      f"EP{par.expert_model_parallel_size}",
                      str(plan.train.micro_batch_size), plan.train.recompute_granularity.value, str(plan.schedule),
                      f"{option.tokens_per_s:,.0f}" + format_share(throughput_interval(plan.step_time_interval)),
                      f"{option.hours(spec.tokens):.1f}" if spec.tokens > 0 else "-",
                      f"{end:.1f}" if end is not None else "-", _deadline_cell(spec, end))
    return table


def _deadline_cell(spec: JobSpec, end: float | None) -> str:
    if spec.deadline_hours is None:
        return "-"
    verdict = "" if end is None else " met" if end <= spec.deadline_hours else " missed"
    return f"{spec.deadline_hours:g}{verdict}"


_GAIN_OF = {"throughput": "weighted FLOP/s over the run", "makespan": "finishing sooner",
            "deadlines": "weight of deadlines met"}


def _policies_table(result):
    from rich.table import Table

    title = ("every policy, run until each job's token budget is done (the cluster repacked as jobs finish; a job "
             "that moves restarts)" if result.packed.segments else
             "every policy, scored at the start (not every job has a token budget to run to the end)")
    table = Table(title=title, title_justify="left")
    for column in ("policy", "what it optimises", "weighted PFLOP/s at start", "over the run",
                   "average utilisation", "makespan h", "deadlines met", f"packing's gain ({_GAIN_OF[result.objective]})",
                   "note"):
        table.add_column(column, overflow="fold")
    packed = result.packed
    for policy in policies(result):
        run = policy.average_weighted_flops_per_s
        table.add_row(policy.name, policy.aim, f"{policy.weighted_flops_per_s / 1e15:,.1f}",
                      "-" if run is None else f"{run / 1e15:,.1f}",
                      "-" if policy.average_utilisation is None else f"{policy.average_utilisation:.1%}",
                      "-" if not math.isfinite(policy.makespan_h) else f"{policy.makespan_h:.1f}",
                      f"{policy.deadlines_met} of {sum(job.deadline_hours is not None for job in result.jobs)}",
                      "" if policy is packed else _gain_cell(packed, policy, result.objective), policy.note)
    return table


def _gain_cell(packed, policy, objective: str) -> str:
    value = gain(packed, policy, objective)
    if value is None:
        return "n/a: it cannot place every job"
    text = f"{value:+.1f} weight" if objective == "deadlines" else f"{value:+.1%}"
    share = utilisation_gain(packed, policy)
    return text + (f" ({share:+.1%} utilisation)" if share is not None else "")


def _deadline_notes(result) -> list[str]:
    """Why the packing meets fewer deadlines than another policy, when it does: its objective is not deadlines."""
    packed = result.packed
    best = max(policies(result), key=lambda policy: (policy.met_weight, policy is packed))
    if result.objective == "deadlines" or best is packed:
        return []
    missed = [job.name for job, end in zip(result.jobs, packed.finish_h or ())
              if job.deadline_hours is not None and end > job.deadline_hours]
    lines = [f"packed meets {packed.deadlines_met} deadlines, {best.name} {best.deadlines_met}: the packing's objective "
             f"is {result.objective} ({AIMS[result.objective]}), not deadlines"
             + (f"; {', '.join(missed)} miss theirs" if missed else "")]
    if result.alternative is not None:
        alternative = result.alternative
        lines.append(f"with pack.objective=deadlines the packing meets {alternative.deadlines_met} (makespan "
                     f"{alternative.makespan_h:.1f} h, weighted {alternative.weighted_flops_per_s / 1e15:,.1f} PFLOP/s "
                     "at start): the row packed for deadlines")
    return lines
