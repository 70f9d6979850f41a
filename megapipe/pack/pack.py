"""``megapipe pack``: the jobs' options from the planner, the exact packing, the baselines, the what-ifs.

Policies, each scored the same way (:class:`Policy`):

- **packed**: :func:`megapipe.pack.solve.solve_packing` over every job's (group, node count) curve;
- **fixed depth**: the same packing with every job at one pipeline size (each of
  ``baseline_pipeline_sizes`` tried; the best shown): is tuning the depth per job worth it?
- **one after another**: each job alone on the whole cluster at its best, the jobs in turn
  (earliest deadline first), every node idle between nothing;
- **even split**: every job gets an equal share of the nodes (its largest node count within the share).

Concurrent policies run every job at once on its own nodes; their FLOP/s are the sum over jobs and the
makespan the slowest job's. The sequential policy's FLOP/s are the time average over its makespan.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from megapipe.errors import ConfigError, InfeasibleError
from megapipe.pack.curves import CURVE_OPTIONS, CurveCache, Option, curve_requests, job_groups, job_options
from megapipe.pack.solve import solve_packing
from megapipe.pack.timeline import Segment, run_timeline
from megapipe.records import ClusterSpec, JobSpec
from megapipe.options import PackOptions, SearchOptions

__all__ = ["Policy", "PackResult", "pack_jobs", "peak_flops"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Policy:
    """How a policy places the jobs, and what it achieves."""

    name: str
    aim: str
    """How the policy places the jobs and what it optimises, in a few words (the console's and pack.yaml's)."""
    options: tuple[Option | None, ...]
    """Per job its option; None where the policy cannot place the job."""
    weighted_flops_per_s: float
    utilisation: float
    """Model FLOP/s over the whole cluster's peak (idle nodes count)."""
    makespan_h: float
    """Hours until every token budget is done (inf when a job is not placed)."""
    deadlines_met: int
    met_weight: float
    note: str = ""
    order: tuple[int, ...] = ()
    """The sequential policy's job order."""
    finish_h: tuple[float, ...] = ()
    """With repacking when a job finishes (every job has a token budget): each job's finish time."""
    average_utilisation: float | None = None
    """Model FLOPs done over the cluster's peak x the makespan, repacking as jobs finish."""
    average_weighted_flops_per_s: float | None = None
    """Weighted model FLOPs done over the makespan (every job has a token budget): the throughput objective
    over the whole run, which every policy can be compared on (they all do the same work)."""
    repacks: int = 0
    restarts: int = 0
    segments: tuple[Segment, ...] = ()
    """Where each job ran when, repacking as jobs finish (the timeline picture)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PackResult:
    jobs: tuple[JobSpec, ...]
    capacities: tuple[int, ...]
    objective: str
    packed: Policy
    baselines: tuple[Policy, ...]
    alternative: Policy | None = None
    """The packing for deadlines, when the objective is another, the packing misses a deadline, and every job has
    a deadline and a budget."""
    what_if: Policy | None = None
    what_if_jobs: tuple[JobSpec, ...] = ()
    what_if_capacities: tuple[int, ...] = ()
    moves: int = 0
    moved: tuple[str, ...] = ()
    searches: int = 0
    seconds: float = 0.0
    """Wall time of the decision: curves and the exact packing (the what-if excluded; the curves' searches also give
    the fixed-depth baseline's points)."""
    curve_options: tuple[tuple[Option, ...], ...] = field(default=(), repr=False)
    baseline_pipeline_sizes: tuple[int, ...] = ()
    """The pipeline sizes each curve search also answered for (the fixed-depth baseline's)."""


def peak_flops(cluster: ClusterSpec) -> float:
    return math.fsum(group.gpu.bf16_tflops * 1e12 * group.num_nodes * cluster.gpus_per_node
                     for group in cluster.node_groups)


AIMS = {"throughput": "the most weighted model FLOP/s", "makespan": "every token budget done soonest",
        "deadlines": "the most deadline weight met, then FLOP/s"}
"""What each objective optimises."""


def _concurrent(name: str, aim: str, jobs: Sequence[JobSpec], picked: Sequence[Option | None], peak: float,
                note: str = "") -> Policy:
    flops = math.fsum(job.weight * option.flops_per_s for job, option in zip(jobs, picked) if option is not None)
    raw = math.fsum(option.flops_per_s for option in picked if option is not None)
    hours = [option.hours(job.tokens) if option is not None else math.inf
             for job, option in zip(jobs, picked) if job.tokens > 0]
    met = [job for job, option in zip(jobs, picked) if option is not None and job.deadline_hours is not None
           and job.tokens > 0 and option.hours(job.tokens) <= job.deadline_hours]
    return Policy(name=name, aim=aim, options=tuple(picked), weighted_flops_per_s=flops, utilisation=raw / peak,
                  makespan_h=max(hours, default=0.0), deadlines_met=len(met),
                  met_weight=math.fsum(job.weight for job in met), note=note)


def _with_timeline(policy: Policy, jobs: Sequence[JobSpec], decide, peak: float, restart_h: float) -> Policy:
    if not jobs or not all(job.tokens > 0 for job in jobs) or any(option is None for option in policy.options):
        return policy
    run = run_timeline(jobs, decide, peak=peak, restart_h=restart_h)
    met = [job for job, end in zip(jobs, run.finish_h) if job.deadline_hours is not None and end <= job.deadline_hours]
    return dataclasses.replace(policy, finish_h=run.finish_h, average_utilisation=run.average_utilisation,
                               average_weighted_flops_per_s=run.average_weighted_flops_per_s,
                               makespan_h=max(run.finish_h), deadlines_met=len(met),
                               met_weight=math.fsum(job.weight for job in met), repacks=run.repacks,
                               restarts=run.restarts, segments=run.segments)


def _sequential(jobs: Sequence[JobSpec], options: Sequence[Sequence[Option]], peak: float) -> Policy:
    """Each job alone at its fastest option, one after another, earliest deadline first."""
    best = [max(opts, key=lambda option: option.tokens_per_s) for opts in options]
    hours = [option.hours(job.tokens) if job.tokens > 0 else 1.0 for job, option in zip(jobs, best)]
    order = sorted(range(len(jobs)), key=lambda j: (jobs[j].deadline_hours or math.inf, j))
    clock, met, segments = 0.0, [], []
    finish = [0.0] * len(jobs)
    for j in order:
        segments.append(Segment(job=j, group=best[j].group, nodes=best[j].nodes, start_h=clock, restart_h=0.0,
                                end_h=clock + hours[j]))
        clock += hours[j]
        finish[j] = clock
        if jobs[j].deadline_hours is not None and clock <= jobs[j].deadline_hours:
            met.append(jobs[j])
    total = math.fsum(hours)
    flops = math.fsum(job.weight * option.flops_per_s * h for job, option, h in zip(jobs, best, hours)) / total
    raw = math.fsum(option.flops_per_s * h for option, h in zip(best, hours)) / total
    budgets = all(job.tokens > 0 for job in jobs)
    note = "" if budgets else "jobs without a token budget get one hour each"
    return Policy(name="one after another", aim="each job alone at its fastest, earliest deadline first",
                  options=tuple(best), weighted_flops_per_s=flops, utilisation=raw / peak,
                  makespan_h=total if budgets else math.inf, deadlines_met=len(met),
                  met_weight=math.fsum(job.weight for job in met), note=note, order=tuple(order),
                  finish_h=tuple(finish) if budgets else (), average_utilisation=raw / peak if budgets else None,
                  average_weighted_flops_per_s=flops if budgets else None, segments=tuple(segments) if budgets else ())


def _even_options(jobs: Sequence[JobSpec], options: Sequence[Sequence[Option]], cluster: ClusterSpec,
                  capacities: Sequence[int]) -> tuple[list[Option | None], int]:
    """Each job an equal share of the nodes, in the group with the most nodes left that it may use."""
    share = sum(capacities) // len(jobs)
    free = list(capacities)
    picked: list[Option | None] = []
    for job, opts in zip(jobs, options):
        groups = sorted(job_groups(job, cluster), key=lambda g: (-free[g], g))
        choice = None
        for group in groups:
            fitting = [o for o in opts if o.group == group and o.nodes <= min(share, free[group])]
            if fitting:
                choice = max(fitting, key=lambda o: o.nodes)
                break
        if choice is not None:
            free[choice.group] -= choice.nodes
        picked.append(choice)
    return picked, share


def _even_split(jobs: Sequence[JobSpec], options: Sequence[Sequence[Option]], cluster: ClusterSpec,
                capacities: Sequence[int], peak: float, restart_h: float) -> Policy:
    picked, share = _even_options(jobs, options, cluster, capacities)
    missing = [job.name for job, option in zip(jobs, picked) if option is None]
    note = (f"{', '.join(missing)} fit{'s' if len(missing) == 1 else ''} in no even share of {share} nodes, so this "
            "policy cannot run them" if missing else f"{share} nodes per job")
    policy = _concurrent("even split", "all at once, an equal share of nodes each", jobs, picked, peak, note)

    def decide(active):
        chosen, _ = _even_options([jobs[j] for j in active], [options[j] for j in active], cluster, capacities)
        if any(option is None for option in chosen):  # a share too small for a job: the rest wait for nodes
            raise InfeasibleError("even share too small")
        return chosen

    try:
        return _with_timeline(policy, jobs, decide, peak, restart_h)
    except InfeasibleError:
        return policy


def _packing_decider(jobs, curves, capacities, objective):
    def decide(active):
        sub = [jobs[j] for j in active]
        packing = solve_packing(sub, [curves[j] for j in active], capacities, objective=objective)
        return [curves[j][o] for j, o in zip(active, packing.choice)]
    return decide


def _for_deadlines(jobs: Sequence[JobSpec], curves, capacities, peak: float, restart_h: float) -> Policy | None:
    """The packing for the deadlines objective (the most weight of jobs meeting theirs, then the most FLOP/s),
    run to the end, when every job has a deadline and a token budget."""
    if not all(job.deadline_hours is not None and job.tokens > 0 for job in jobs):
        return None
    packing = solve_packing(jobs, curves, capacities, objective="deadlines")
    policy = _concurrent("packed for deadlines", f"all at once, for {AIMS['deadlines']}", jobs,
                         [c[o] for c, o in zip(curves, packing.choice)], peak, "pack.objective=deadlines")
    return _with_timeline(policy, jobs, _packing_decider(jobs, curves, capacities, "deadlines"), peak, restart_h)


def _fixed_size(size: int, jobs, curves, capacities, objective: str, peak: float, restart_h: float) -> Policy | str:
    """Every job at pipeline size ``size``, packed and run to the end; or why that size has no packing."""
    if not all(curves):
        return f"PP{size}: {sum(1 for c in curves if not c)} job(s) have no plan"
    try:
        packing = solve_packing(jobs, curves, capacities, objective=objective)
    except InfeasibleError:
        return f"PP{size}: no packing fits"
    policy = _concurrent(f"fixed PP{size}", f"as packed, every job at PP {size}", jobs,
                         [c[o] for c, o in zip(curves, packing.choice)], peak)
    return _with_timeline(policy, jobs, _packing_decider(jobs, curves, capacities, objective), peak, restart_h)


def _fixed_depth(found: Sequence[Policy | str], options: PackOptions) -> Policy | None:
    """The best of the fixed-size policies (:func:`_fixed_size`, in ``baseline_pipeline_sizes`` order), noting the
    sizes without one."""
    best: Policy | None = None
    tried = []
    for item in found:
        if isinstance(item, str):
            tried.append(item)
        elif best is None or _better(item, best, options.objective):
            best = item
    if best is None:
        return None
    note = "best single pipeline size of " + "/".join(str(s) for s in options.baseline_pipeline_sizes)
    return dataclasses.replace(best, note=note + ("; " + ", ".join(tried) if tried else ""))


def _run_policy(task: tuple):
    """One policy's packing run to the end (a module-level function: a pool pickles it): ``("timeline", policy,
    ...)`` the packing's, ``("fixed", size, ...)`` :func:`_fixed_size`, ``("deadlines", ...)`` :func:`_for_deadlines`."""
    kind, *rest = task
    if kind == "timeline":
        policy, jobs, curves, capacities, objective, peak, restart_h = rest
        return _with_timeline(policy, jobs, _packing_decider(jobs, curves, capacities, objective), peak, restart_h)
    if kind == "fixed":
        return _fixed_size(*rest)
    return _for_deadlines(*rest)


def _better(a: Policy, b: Policy, objective: str) -> bool:
    if objective == "makespan":
        return (a.makespan_h, -a.weighted_flops_per_s) < (b.makespan_h, -b.weighted_flops_per_s)
    if objective == "deadlines":
        return (a.met_weight, a.weighted_flops_per_s) > (b.met_weight, b.weighted_flops_per_s)
    return a.weighted_flops_per_s > b.weighted_flops_per_s


def gain(packed: Policy, baseline: Policy, objective: str) -> float | None:
    """The packing's gain over a baseline in the objective's terms (makespan: how much sooner, as a rate); None
    when the baseline cannot place every job (no gain over a policy that cannot run).

    Throughput compares the weighted FLOP/s over the whole run when both policies run every token budget to
    the end (the one-after-another policy has no other figure: at its start one job holds the cluster), else
    at the start."""
    if any(option is None for option in baseline.options):
        return None
    if objective == "makespan":
        return baseline.makespan_h / packed.makespan_h - 1 if packed.makespan_h > 0 else 0.0
    if objective == "deadlines":
        return packed.met_weight - baseline.met_weight
    ours, theirs = packed.weighted_flops_per_s, baseline.weighted_flops_per_s
    if packed.average_weighted_flops_per_s is not None and baseline.average_weighted_flops_per_s is not None:
        ours, theirs = packed.average_weighted_flops_per_s, baseline.average_weighted_flops_per_s
    return ours / theirs - 1 if theirs else math.inf


def _requests(points: Sequence[tuple[JobSpec, int | None]], cluster: ClusterSpec, options: PackOptions) -> list:
    """The curve points of each (job, fixed pipeline size or None), on every node count pack tries."""
    return [request for job, size in points
            for request in curve_requests(job, cluster, node_counts=options.node_counts, pipeline=size)]


def _capacities_after_failure(cluster: ClusterSpec, options: PackOptions) -> tuple[int, ...]:
    capacities = [group.num_nodes for group in cluster.node_groups]
    if options.fail_group is not None:
        names = [group.gpu.name for group in cluster.node_groups]
        if options.fail_group not in names:
            raise ConfigError(f"pack.fail_group={options.fail_group!r} is no node group's GPU type; use one of {names}")
        for index, name in enumerate(names):
            if name == options.fail_group:
                capacities[index] = 0
    if options.fail_nodes:
        largest = max(range(len(capacities)), key=lambda g: capacities[g])
        if options.fail_nodes > capacities[largest]:
            raise ConfigError(f"pack.fail_nodes={options.fail_nodes} exceeds the largest group's {capacities[largest]} "
                              "nodes")
        capacities[largest] -= options.fail_nodes
    return tuple(capacities)


def pack_jobs(jobs: Sequence[JobSpec], cluster: ClusterSpec, options: PackOptions, *,
              baselines: bool = True, search: SearchOptions = CURVE_OPTIONS, mapper: Callable = map,
              workers: int = 1, decided: Callable[[tuple[JobSpec, ...], Policy], object] | None = None,
              ran: Callable[[Policy, Policy | None], object] | None = None) -> PackResult:
    """Pack the jobs present now (not ``arrives_later``); then the baselines, then the what-if. ``search``: the
    planner's options every job's searches use (``search.*``; each curve point keeps its best plan). ``mapper``
    runs the curves' searches, a batch per job shape, and the policies' runs to the end (a process pool's map of
    ``workers`` processes uses every core; the answer is the same).

    So a caller can draw while the rest is worked out: ``decided`` gets the jobs present and the packing at the start
    (:attr:`PackResult.jobs`, and :attr:`PackResult.packed` without its run to the end) once it is chosen, ``ran``
    the packing run to the end and the packing for deadlines where it is shown (:attr:`PackResult.packed` and
    :attr:`PackResult.alternative`) once both are known, before the fixed-depth baselines' runs end."""
    started = time.perf_counter()
    cache = CurveCache(cluster=cluster, options=dataclasses.replace(search, top_k=1))
    capacities = tuple(group.num_nodes for group in cluster.node_groups)
    present = tuple(job for job in jobs if not job.arrives_later)
    sizes = options.baseline_pipeline_sizes if baselines else ()
    # each curve point's search also gives the fixed-depth baseline's points at that node count
    cache.prefetch(_requests([(job, None) for job in present], cluster, options), mapper, depths=sizes,
                   workers=workers)
    curves = [job_options(job, cache, node_counts=options.node_counts) for job in present]
    packing = solve_packing(present, curves, capacities, objective=options.objective)
    peak = peak_flops(cluster)
    packed = _concurrent("packed", f"all at once, for {AIMS[options.objective]}", present,
                         [c[o] for c, o in zip(curves, packing.choice)], peak)
    seconds = time.perf_counter() - started
    if decided is not None:
        decided(present, packed)
    restart_h = options.restart_minutes / 60.0
    arriving = [(job, None) for job in jobs if job.arrives_later and options.arrive]
    cache.prefetch(_requests([(job, size) for job in present for size in sizes] + arriving, cluster, options), mapper,
                   workers=workers)
    # The policies' packings, each run to the end, side by side through ``mapper``: the packing's own, (when it may
    # be shown: every job has a deadline and a budget) the packing for deadlines, and each fixed pipeline size's.
    objective = options.objective
    tasks: list[tuple] = [("timeline", packed, present, curves, capacities, objective, peak, restart_h)]
    speculative = baselines and objective != "deadlines" and all(
        job.deadline_hours is not None and job.tokens > 0 for job in present)
    if speculative:
        tasks.append(("deadlines", present, curves, capacities, peak, restart_h))
    tasks += [("fixed", size, present, [job_options(job, cache, node_counts=options.node_counts, capacities=capacities,
                                                    pipeline=size) for job in present], capacities, objective, peak,
               restart_h) for size in sizes]
    done = iter(mapper(_run_policy, tasks))
    packed = next(done)
    for_deadlines = next(done) if speculative else None
    missed = packed.deadlines_met < sum(job.deadline_hours is not None for job in present)
    alternative = for_deadlines if missed else None
    if ran is not None:
        ran(packed, alternative)
    fixed_runs = list(done)
    found: list[Policy] = []
    if baselines:
        fixed = _fixed_depth(fixed_runs, options)
        if fixed is not None:
            found.append(fixed)
        found.append(_sequential(present, curves, peak))
        found.append(_even_split(present, curves, cluster, capacities, peak, restart_h))
    what_if = None
    what_if_jobs: tuple[JobSpec, ...] = ()
    after: tuple[int, ...] = ()
    moves, moved = 0, ()
    if options.what_if:
        after = _capacities_after_failure(cluster, options)
        what_if_jobs = tuple(jobs) if options.arrive else present
        where = {job.name: (option.group, option.nodes) for job, option in zip(present, packed.options)}
        after_curves = [job_options(job, cache, node_counts=options.node_counts, capacities=after)
                        for job in what_if_jobs]
        previous = [where.get(job.name) for job in what_if_jobs]
        repack = solve_packing(what_if_jobs, after_curves, after, objective=options.objective, previous=previous,
                               slack=options.move_slack)
        picked = [c[o] for c, o in zip(after_curves, repack.choice)]
        events = []
        if options.fail_group:
            events.append(f"{options.fail_group} nodes fail")
        if options.fail_nodes:
            events.append(f"{options.fail_nodes} nodes fail")
        if options.arrive:
            events.append(", ".join(job.name for job in jobs if job.arrives_later) + " arrive")
        what_if = _concurrent("what-if: " + "; ".join(events), f"repacked for {AIMS[options.objective]}, fewest moves",
                              what_if_jobs, picked, peak)
        moves = repack.moves
        moved = tuple(job.name for job, option, prev in zip(what_if_jobs, picked, previous)
                      if prev is not None and (option.group, option.nodes) != prev)
    return PackResult(jobs=present, capacities=capacities, objective=options.objective, packed=packed,
                      alternative=alternative, baselines=tuple(found), what_if=what_if, what_if_jobs=what_if_jobs,
                      what_if_capacities=after,
                      moves=moves, moved=moved, searches=cache.searches, seconds=seconds,
                      curve_options=tuple(curves), baseline_pipeline_sizes=tuple(sizes))
