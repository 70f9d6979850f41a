"""Each job's throughput against its node count: one planner search per (job shape, node group, node count).

A job runs on the nodes of one node group (one GPU type); on ``n`` of them it gets the planner's best plan
for that sub-cluster (same links and runtime, ``n`` nodes). Jobs of one shape (model, batch, sequence,
precision, micro-batch limit) share their curve, so a list of jobs costs one search per shape and point.
With ``pipeline_model_parallel_size`` fixed the curve is the fixed-depth baseline's.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from megapipe.cost import model_flops_per_token
from megapipe.cost.params import parameter_count
from megapipe.errors import MegapipeError
from megapipe.features import SEARCHED, feature_variants
from megapipe.plan.plans import Plan, SearchResult
from megapipe.options import SearchOptions
from megapipe.plan.search import search, search_by_depth
from megapipe.plan.unit_costs import SharedCosts
from megapipe.records import ClusterSpec, JobSpec, NodeGroup

__all__ = ["Option", "CurveCache", "curve_requests", "default_node_counts", "job_options", "sub_cluster"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Option:
    """A job on ``nodes`` nodes of node group ``group``, with the planner's best plan there."""

    group: int
    nodes: int
    tokens_per_s: float
    flops_per_s: float
    """Model FLOP/s as Megatron-LM counts them (tokens/s x FLOPs per token)."""
    plan: Plan = field(compare=False, repr=False)
    result: SearchResult = field(compare=False, repr=False)

    @property
    def pipeline_model_parallel_size(self) -> int:
        return self.plan.parallel.pipeline_model_parallel_size

    def hours(self, tokens: float) -> float:
        """Wall-clock hours to process ``tokens``."""
        return tokens / self.tokens_per_s / 3600.0


def default_node_counts(num_nodes: int) -> tuple[int, ...]:
    """The powers of two below ``num_nodes``, and ``num_nodes`` itself."""
    counts, power = [], 1
    while power < num_nodes:
        counts.append(power)
        power *= 2
    return (*counts, num_nodes)


def sub_cluster(cluster: ClusterSpec, group: int, nodes: int) -> ClusterSpec:
    """``nodes`` nodes of node group ``group`` as a cluster of their own (links and runtime kept)."""
    return dataclasses.replace(cluster, name=f"{cluster.name}[{cluster.node_groups[group].gpu.name} x {nodes}]",
                               node_groups=(NodeGroup(gpu=cluster.node_groups[group].gpu, num_nodes=nodes),))


CURVE_OPTIONS = SearchOptions(top_k=1)
"""A curve point needs the best plan only."""


@dataclass
class CurveCache:
    """Search results by (job shape, group, nodes, fixed pipeline size); None where nothing fits.

    Each result keeps its plans without their simulations (the op-by-op timelines): a curve point needs the
    plan's figures and a job directory its plan record, and results travel between processes
    (:meth:`prefetch`), where a simulation weighs about 35 times the rest."""

    cluster: ClusterSpec
    options: SearchOptions = CURVE_OPTIONS
    found: dict = field(default_factory=dict)
    searches: int = 0
    costs: dict = field(default_factory=dict)
    """SharedCosts by (job shape, group): every node count and pipeline size of a shape prices its layers once."""

    def best(self, job: JobSpec, group: int, nodes: int, pipeline: int | None = None) -> SearchResult | None:
        shape, key = _keys(job, group, nodes, pipeline)
        if key not in self.found:
            self.searches += 1
            self.found.update(_searched(self.cluster, self.options, job, group, nodes, pipeline,
                                        self.costs.setdefault(shape, SharedCosts())))
        return self.found[key]

    def prefetch(self, requests: Sequence[tuple[JobSpec, int, int, int | None]], mapper: Callable = map, *,
                 depths: Sequence[int] = (), workers: int = 1) -> None:
        """Run the searches of ``requests`` ((job, group, nodes, fixed pipeline size) each) not yet run, in batches of
        one job shape through ``mapper`` (a process pool's map of ``workers`` processes runs them side by side), the
        heaviest first (:func:`_weight`) so the processes end together. One batch per shape, whose searches share
        its unit costs; with several processes, fewer than two shapes per process go as two batches each (one
        heavy shape keeps two processes busy), and otherwise all but the ``workers`` heaviest shapes go one search
        a batch, so the last searches fill the processes evenly (a process prices a shape's units once, however many
        of its batches it runs: :data:`_PROCESS_COSTS`). Each search is the one :meth:`best` runs, so the curves do
        not depend on how they were run. With ``depths``, a request without a fixed pipeline size also gives the
        curve points at each of them (:func:`megapipe.plan.search.search_by_depth`: the same results as searching
        each depth alone, from one search)."""
        batches: dict[tuple, dict[tuple, tuple]] = {}
        for job, group, nodes, pipeline in requests:
            shape, key = _keys(job, group, nodes, pipeline)
            if key not in self.found:
                wanted = tuple(depth for depth in depths if _keys(job, group, nodes, depth)[1] not in self.found
                               ) if pipeline is None else ()
                batches.setdefault(shape, {})[key] = (job, group, nodes, pipeline, wanted)
        def heaviest_first(parts):  # (shape, its searches) each
            return sorted(parts, key=lambda part: _weight(part[1][0][1][0]) * len(part[1]), reverse=True)

        shapes = heaviest_first((shape, tuple(batch.items())) for shape, batch in batches.items())
        if workers < 2:
            parts = shapes
        elif len(shapes) < 2 * workers:
            parts = heaviest_first((shape, half) for shape, items in shapes for half in _halves(items))
        else:
            parts = shapes[:workers] + [(shape, (item,)) for shape, items in shapes[workers:] for item in items]
        try:
            for found in mapper(_search_batch, [(self.cluster, self.options, shape, items) for shape, items in parts]):
                for results in found:
                    self.searches += 1
                    self.found.update(results)
        finally:
            _PROCESS_COSTS.clear()  # what the batches run here (no pool) kept


def _weight(job: JobSpec) -> float:
    """A rough cost of one of the job's searches, to hand the heaviest batches out first (the answer does not depend
    on it): the square root of the model's parameters (a larger model has more pipeline sizes and wider layers, not
    proportionally more candidates), doubled where its searches try several runtime feature sets (a MoE model's
    dozen, each costed and compared)."""
    free = frozenset(SEARCHED) - set(dict(job.fixed))
    several = len(feature_variants(job.template.features, model=job.model, free=free)) > 1
    return math.sqrt(parameter_count(job.model)) * (2.0 if several else 1.0)


def _halves(items: tuple) -> tuple[tuple, ...]:
    """A shape's searches as two batches (alternate node counts), so one heavy shape keeps two cores busy; each half
    still prices its units once."""
    return tuple(part for part in (items[0::2], items[1::2]) if part)


def _keys(job: JobSpec, group: int, nodes: int, pipeline: int | None) -> tuple[tuple, tuple]:
    """(job shape, curve point): what a search's answer depends on."""
    shape = (job.model, job.train, job.max_micro_batch_size, job.template, job.fixed, group)
    return shape, (*shape, nodes, pipeline)


_PROCESS_COSTS: dict[tuple, SharedCosts] = {}
"""SharedCosts by (cluster, job shape) in the process that runs :func:`_search_batch`: a shape's searches that reach
one pool process in several batches price its units there once (the answer is the same)."""


def _search_batch(batch) -> list[dict[tuple, SearchResult | None]]:
    """The searches of one job shape, sharing its unit costs (a module-level function: a pool pickles it): per search,
    its curve points' results."""
    cluster, options, shape, items = batch
    shared = _PROCESS_COSTS.setdefault((cluster, shape), SharedCosts())
    return [_searched(cluster, options, job, group, nodes, pipeline, shared, depths)
            for _, (job, group, nodes, pipeline, depths) in items]


def _searched(cluster: ClusterSpec, options: SearchOptions, job: JobSpec, group: int, nodes: int,
              pipeline: int | None, shared: SharedCosts, depths: Sequence[int] = ()) -> dict[tuple, SearchResult | None]:
    """The planner's search for one curve point, and with ``depths`` the points of each fixed pipeline size at the
    same node count, by curve point; plans without simulations, None where nothing fits."""
    if job.max_micro_batch_size is not None:
        sizes = tuple(size for size in options.micro_batch_sizes if size <= job.max_micro_batch_size)
        options = dataclasses.replace(options, micro_batch_sizes=sizes or (job.max_micro_batch_size,))
    fixed = dict(job.fixed)
    if pipeline is not None:
        fixed["pipeline_model_parallel_size"] = pipeline
    template = job.template
    inputs = dict(model=job.model, cluster=sub_cluster(cluster, group, nodes), train=job.train, fixed=fixed,
                  options=options, template=template, use_distributed_optimizer=template.use_distributed_optimizer,
                  microbatch_group_size_per_vp_stage=template.microbatch_group_size_per_vp_stage, shared=shared)
    if depths and "pipeline_model_parallel_size" not in fixed:
        found = search_by_depth(depths=tuple(depths), **inputs)
    else:
        try:
            found = {pipeline: search(**inputs)}
        except MegapipeError:
            found = {pipeline: None}

    def lean(plan: Plan | None) -> Plan | None:
        return None if plan is None else dataclasses.replace(plan, simulation=None)

    return {_keys(job, group, nodes, depth)[1]: None if result is None else dataclasses.replace(
                result, plans=tuple(lean(plan) for plan in result.plans), chosen=lean(result.chosen),
                baseline=lean(result.baseline), reference=lean(result.reference))
            for depth, result in found.items()}


def curve_requests(job: JobSpec, cluster: ClusterSpec, *, node_counts: Sequence[int] | None = None,
                   capacities: Sequence[int] | None = None, pipeline: int | None = None
                   ) -> tuple[tuple[JobSpec, int, int, int | None], ...]:
    """The curve points :func:`job_options` reads: (job, group, nodes, pipeline) for each group the job may run
    on and each node count up to its capacity."""
    capacities = tuple(group.num_nodes for group in cluster.node_groups) if capacities is None else tuple(capacities)
    out = []
    for group in job_groups(job, cluster):
        counts = default_node_counts(cluster.node_groups[group].num_nodes) if node_counts is None else node_counts
        out.extend((job, group, nodes, pipeline) for nodes in sorted({count for count in counts
                                                                       if count <= capacities[group]}))
    return tuple(out)


def job_groups(job: JobSpec, cluster: ClusterSpec) -> tuple[int, ...]:
    """The node groups a job may run on: its pinned GPU type's, else all."""
    return tuple(index for index, group in enumerate(cluster.node_groups) if job.gpu in (None, group.gpu.name))


def job_options(job: JobSpec, cache: CurveCache, *, node_counts: Sequence[int] | None = None,
                capacities: Sequence[int] | None = None, pipeline: int | None = None) -> tuple[Option, ...]:
    """Every (group, node count) on which the job has a plan, with that plan's throughput."""
    flops_per_token = model_flops_per_token(job.model, job.train.seq_length)
    out = []
    for _, group, nodes, _ in curve_requests(job, cache.cluster, node_counts=node_counts, capacities=capacities,
                                             pipeline=pipeline):
        result = cache.best(job, group, nodes, pipeline)
        if result is None or not result.best.feasible:
            continue
        plan = result.best
        out.append(Option(group=group, nodes=nodes, tokens_per_s=plan.tokens_per_s,
                          flops_per_s=plan.tokens_per_s * flops_per_token, plan=plan, result=result))
    return tuple(out)
