"""The full search: enumerate, prune by closed forms, bound, then partition and simulate
only the candidates that can still rank (branch and bound).

Order of work:

1. :func:`megapipe.plan.space.enumerate_candidates` drops shapes Megatron rejects
   (``divisibility``, ``microbatches``).
2. Each survivor gets closed-form lower bounds (:meth:`Evaluator.bound`); if even the
   mean rank's static + one-microbatch memory exceeds usable memory it is pruned
   (``memory``).
3. Survivors are visited best bound first. Every candidate uses all GPUs for the same
   tokens per step, so throughput per GPU and dollars per token order candidates the
   same way, and a step-time bound is a bound for both objectives. Once ``top_k``
   feasible plans are known and the next bound is no better than the k-th, the rest
   cannot rank and are skipped (``bound``).
4. Memory is decided in closed form from the chunks' capacities
   (:func:`megapipe.plan.bounds.split_can_fit`, exact for identical decoder layers) before
   any solve (``memory``); the solver can still find no split for other profiles.
5. A survivor is partitioned and goes back in line under its partition's step floor
   (every rank's work plus the forward/backward chains it must wait for, with the exact DP
   sync and optimizer step), a sharper bound. It is simulated only when it comes first
   again; once the first in line is no better than the k-th best exact step, the rest are
   skipped (``bound``). Every ranked plan is simulated, so the ranking is exact. The
   schedule can reject sizes (``schedule``).

With ``search.bubble_target`` every micro-batch size of a layout competes on its bubble,
not on its bound, so step 3 is skipped.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import gc
import heapq
import operator
import time
from collections import Counter
from collections.abc import Callable, Mapping

from megapipe.cost.layers import bytes_features
from megapipe.errors import ConfigError, InfeasibleError, MegapipeError, ScheduleError
from megapipe.plan.dominance import surviving_points
from megapipe.plan.evaluator import Evaluator, Prepared
from megapipe.plan.unit_costs import SharedCosts
from megapipe.placement import datasheet_time_scale, gpus_by_name, placements
from megapipe.plan.rank import rank_plans, score
from megapipe.plan.plans import Candidate, Plan, SearchResult, SearchStats
from megapipe.options import Reference, SearchOptions
from megapipe.plan.space import LAYER_SIZES, Point, Space, divisors, enumerate_candidates
from megapipe.records import Profile
from megapipe.records import ClusterSpec, ModelSpec, ParallelSpec, Recompute, TrainSpec
from megapipe.schedules import SPECS, ScheduleName

__all__ = ["search", "search_by_depth", "reference_candidate"]


def search(
    *,
    model: ModelSpec,
    cluster: ClusterSpec,
    train: TrainSpec,
    fixed: Mapping[str, object] | None = None,
    options: SearchOptions = SearchOptions(),
    profile: Profile | None = None,
    use_distributed_optimizer: bool = True,
    microbatch_group_size_per_vp_stage: int | None = None,
    template: ParallelSpec = ParallelSpec(),
    progress: Callable[[int, int], None] | None = None,
    shared: SharedCosts | None = None,
) -> SearchResult:
    """Best plans first, with the equal-split baseline of the best and the reference configuration.

    ``template`` gives the parallel settings the search does not vary (tp_comm_overlap, where sequence
    parallelism allows it, and the DP overlap flags); ``shared``: unit costs and schedules shared with other
    searches of this model and batch shape on sub-clusters of the same node group (the answer is the same)."""
    started = time.perf_counter()
    inputs = dict(model=model, cluster=cluster, train=train, fixed=dict(fixed or {}), options=options, profile=profile,
                  use_distributed_optimizer=use_distributed_optimizer,
                  microbatch_group_size_per_vp_stage=microbatch_group_size_per_vp_stage, template=template,
                  shared=shared)
    with _no_cycle_collection():
        return _Bounded(inputs).result(None, started=started, progress=progress)


@contextlib.contextmanager
def _no_cycle_collection():
    """Python's cycle collector paused while a search runs (and as it was afterwards). A search makes hundreds of
    thousands of small tuples and records that live until it ends (a point per candidate and feature set, the
    bounds' keys), and the collector would walk all of them again each time their number grows by a quarter
    (DeepSeek-V3's search: 3.71 s with it, 3.15 s without, ``scripts/bench_plan.py --moe``). Nothing a search
    makes needs the collector: it drops no reference cycles (``gc.collect()`` finds none after one;
    tests/test_plan_search.py), so pausing the collector costs no memory."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def search_by_depth(*, depths: tuple[int, ...], **inputs) -> dict[int | None, SearchResult | None]:
    """:func:`search` (under the key None), and the result of the same search with ``pipeline_model_parallel_size``
    fixed to each of ``depths``; None where a search finds no plan or its inputs fail (what pack's curves need).

    One enumeration, one set of bounds, and one branch and bound per depth over the points of that depth, with
    partitions and simulations shared. A depth's points are those the fixed search enumerates, in the same order
    and with the same bounds, so its plans are that search's (tests/test_plan_search.py); its stats count the
    shared enumeration and bounds and its own branch and bound, which also skips partitioning a candidate whose
    split is known without solving and whose floor is past the cutoff (:meth:`_PointBounds.split_floor`; only the
    depths' lean results do this, so the whole search's counts are a plain search's). A depth's result is lean
    (:meth:`_Bounded.result`): its equal-split baseline is None where it cannot beat the chosen plan, and it keeps
    no profile. A depth the
    whole search does not try (over ``search.max_pipeline_model_parallel_size`` or the layer count), or every depth
    when the whole search's inputs fail, is searched on its own."""
    with _no_cycle_collection():
        return _search_by_depth(depths=depths, **inputs)


def _search_by_depth(*, depths: tuple[int, ...], **inputs) -> dict[int | None, SearchResult | None]:
    inputs = dict(inputs)
    inputs["fixed"] = dict(inputs.get("fixed") or {})
    if "pipeline_model_parallel_size" in inputs["fixed"]:
        raise ConfigError("search_by_depth varies pipeline_model_parallel_size; do not fix it")
    model, options = inputs["model"], inputs.get("options", SearchOptions())
    limit = min(options.max_pipeline_model_parallel_size or model.num_layers, model.num_layers)
    started = time.perf_counter()
    try:
        bounded = _Bounded(inputs)
    except MegapipeError:
        bounded = None
    out: dict[int | None, SearchResult | None] = {}
    try:
        out[None] = bounded.result(None, started=started) if bounded is not None else None
    except MegapipeError:
        out[None] = None
    for depth in depths:
        try:
            if bounded is not None and depth <= limit:
                # no point of any depth the whole search tries has a plan: neither has one of this depth
                out[depth] = None if bounded.planless else bounded.result(depth, started=time.perf_counter(),
                                                                          lean=True)
            else:
                out[depth] = search(**{**inputs, "fixed": {**inputs["fixed"], "pipeline_model_parallel_size": depth}})
        except MegapipeError:
            out[depth] = None
    return out


class _Bounded:
    """One search's enumeration and bounds, from which a result for every point or for one depth's points is
    drawn."""

    def __init__(self, inputs: dict):
        self.inputs = inputs
        self.options = options = inputs.get("options", SearchOptions())
        model, cluster = inputs["model"], inputs["cluster"]
        _check_cluster(cluster)
        self.evaluator = Evaluator(model=model, cluster=cluster, options=options, profile=inputs.get("profile"),
                                   shared=inputs.get("shared"))
        template = inputs.get("template", ParallelSpec())
        self.space = enumerate_candidates(
            model=model, cluster=cluster, train=inputs["train"], fixed=inputs["fixed"], options=options,
            use_distributed_optimizer=inputs.get("use_distributed_optimizer", True),
            microbatch_group_size_per_vp_stage=inputs.get("microbatch_group_size_per_vp_stage"), template=template)
        self.pruned = Counter(self.space.pruned)
        self.bounded, self.bounds = _bound_all(self.evaluator, self.space, self.pruned)
        self._by_depth: dict[int, list] | None = None
        self._vp_by_depth: dict[int | None, tuple[int, ...]] | None = None
        self.planless = False
        """The branch and bound over every point found no plan, feasible or not."""

    def _virtual_sizes(self, depth: int | None) -> tuple[int, ...]:
        """The VP sizes the points of ``depth`` (None: every point) try, sorted (one pass for every depth asked)."""
        if self._vp_by_depth is None:
            found: dict[int, set[int]] = {}
            for pp, vp in set(map(_PP_VP, self.space.points)):  # the distinct pairs, gathered at C speed
                found.setdefault(pp, set()).add(vp)
            self._vp_by_depth = {pp: tuple(sorted(sizes)) for pp, sizes in found.items()}
            self._vp_by_depth[None] = tuple(sorted(set().union(*found.values())))
        return self._vp_by_depth.get(depth, ())

    def _depths(self) -> dict[int, list]:
        """The bounded entries of each depth, in their order (one pass for every depth asked)."""
        if self._by_depth is None:
            self._by_depth = {}
            for item in self.bounded:
                self._by_depth.setdefault(item[2][0][1].pipeline_model_parallel_size, []).append(item)
        return self._by_depth

    def result(self, depth: int | None, *, started: float, progress: Callable[[int, int], None] | None = None,
               lean: bool = False) -> SearchResult:
        """The search's result over every point (``depth`` None) or one depth's. ``lean``: the same plans, the chosen
        one included, without what only a written plan reads: the equal-split baseline is simulated only where a
        lower bound leaves it able to beat the chosen plan (else None), and no profile is kept."""
        evaluator, space, inputs = self.evaluator, self.space, self.inputs
        model, cluster, train, options = inputs["model"], inputs["cluster"], inputs["train"], self.options
        fixed = inputs["fixed"] if depth is None else {**inputs["fixed"], "pipeline_model_parallel_size": depth}
        bounded = self.bounded if depth is None else self._depths().get(depth, [])
        pruned = Counter(self.pruned)
        plans, work, memory_floor = _branch_and_bound(evaluator, bounded, self.bounds, pruned, progress,
                                                      split_floors=lean)
        if not plans and depth is None:
            self.planless = True
        if not plans:
            raise InfeasibleError(_no_plan_message(model, cluster, train, pruned, memory_floor, fixed))
        ranked = rank_plans(plans, objective=options.objective, top_k=options.top_k,
                            bubble_target=options.bubble_target)
        if options.bubble_target is not None:
            _check_bubble_target(ranked, options.bubble_target)
        chosen = next((plan for plan in ranked if not plan.what_if), None)
        if chosen is None and options.what_if_schedules and "schedule" not in fixed:
            chosen = _best_runnable(**{**inputs, "fixed": fixed})
        chosen = chosen or ranked[0]
        baseline = (_equal_if_faster(evaluator, chosen) if lean else
                    _try(evaluator, _candidate_of(chosen), method="equal", gpus=_gpus_of(evaluator, chosen)))
        if baseline is not None and baseline.feasible and score(baseline, options.objective) < score(
                chosen, options.objective):
            # The equal split simulates faster (the min-max split only bounds the step): plan with it.
            ranked = rank_plans([baseline if plan is chosen else plan for plan in ranked],
                                objective=options.objective, top_k=options.top_k)
            chosen = baseline
        template = inputs.get("template", ParallelSpec())
        reference = _reference(evaluator, options, train, dataclasses.replace(
            template, use_distributed_optimizer=inputs.get("use_distributed_optimizer", True)))
        stats = SearchStats(enumerated=space.enumerated, evaluated=_points(bounded), partitioned=work["partitioned"],
                            simulated=work["simulated"], pruned=tuple(sorted(pruned.items())),
                            seconds=time.perf_counter() - started, virtual_sizes=self._virtual_sizes(depth))
        gain = chosen.tokens_per_s / baseline.tokens_per_s - 1 if baseline is not None else None
        return SearchResult(plans=ranked, chosen=chosen, baseline=baseline, reference=reference, stats=stats,
                            profile=None if lean else evaluator.costs.profile(_candidate_of(chosen)),
                            hetero_gain=gain if cluster.is_heterogeneous else None)


def _best_runnable(*, options: SearchOptions, **inputs) -> Plan | None:
    """The best plan among the schedules megatron-core runs, when every ranked plan is a what-if."""
    try:
        return search(options=dataclasses.replace(options, what_if_schedules=False, top_k=1), **inputs).best
    except InfeasibleError:
        return None


def _check_bubble_target(ranked: tuple[Plan, ...], target: tuple[float, float]) -> None:
    low, high = target
    if not any(low <= plan.bubble_fraction <= high for plan in ranked):
        nearest = min(ranked, key=lambda plan: max(low - plan.bubble_fraction, plan.bubble_fraction - high))
        raise InfeasibleError(
            f"no plan's bubble lies in search.bubble_target=[{low:g}, {high:g}]; the nearest is "
            f"{nearest.bubble_fraction:.1%} ({nearest.schedule}, micro-batch {nearest.train.micro_batch_size}); "
            "widen the range or leave search.bubble_target null")


def _check_cluster(cluster: ClusterSpec) -> None:
    for group in cluster.node_groups:
        if group.gpu.usable_memory_bytes <= 0:
            raise ConfigError(
                f"cluster {cluster.name!r}: gpu {group.gpu.name!r} has memory_gib={group.gpu.memory_gib}; "
                "set a positive cluster.gpu.memory_gib"
            )


class _PointBounds:
    """Each point's bounds, computed when first needed and kept by what they depend on.

    Points whose layer key, data-parallel size and schedule's bound class
    (:attr:`~megapipe.schedules.ScheduleSpec.bound_class`) agree have the same bounds, so each is computed once per
    such key, on one Candidate. Three, each cheaper and weaker than the next: the pipeline term from unit times alone
    (:meth:`CandidateBounds.pipeline_bound`), which orders every point; the memory test; the full step bound
    (:meth:`CandidateBounds.bound`). The branch and bound asks for the last two only of the points it pops, so a
    point the cheap bound already puts past the cutoff is never sized or bounded in full. Keys hold feature sets by
    identity (a space's points share the enumeration's feature-set objects); memory is decided once per the features
    a unit's bytes read (a token per distinct bytes features; ETP and the rest of the sizes kept).
    """

    def __init__(self, evaluator: Evaluator, space: Space):
        self.evaluator, self.space = evaluator, space
        self.memory_cap = max(group.gpu.usable_memory_bytes for group in evaluator.cluster.node_groups)
        self.check_memory = not evaluator.options.ignore_memory_limit
        self.min_scale = _min_time_scale(evaluator)
        self.classes = {name: item.bound_class for name, item in SPECS.items()}
        self._steps: dict[tuple, float] = {}
        self._cheap: dict[tuple, float] = {}
        self._layers: dict[tuple, Candidate] = {}
        self._memory: dict[tuple, bool] = {}
        self._tokens: dict = {}
        self._token_of: dict[int, int] = {}
        self._floors: dict[int, float | None] = {}
        self._split_floors: dict[int, float | None] = {}
        self._placed: dict[int, tuple[tuple[Prepared, ...], Counter, Counter]] = {}

    _SIZES = operator.itemgetter(0, 1, 2, 3, 5, 6, 7, 9, 11, 12)
    """TP, CP, PP, DP, micro-batch, recompute, SP, per-stage recompute, EP, ETP: all of a point but its VP,
    schedule (its bound class stands for it), microbatch count (DP and the batch fix it) and features."""

    def _sizes(self, point: Point) -> tuple:
        return self._SIZES(point) + (self.classes[point[8]],)

    def cheap(self, point: Point) -> float:
        key = self._sizes(point) + (id(point.features),)
        found = self._cheap.get(key)
        if found is None:
            if point.per_stage_recompute:
                found = self.evaluator.bounds.pipeline_bound(self.space.candidate(point), min_time_scale=self.min_scale)
            else:  # one record per layer key (the sizes unit costs read), not one per point
                layer_key = LAYER_SIZES(point) + (id(point.features),)
                layer = self._layers.get(layer_key)
                if layer is None:
                    layer = self._layers[layer_key] = self.space.candidate(point)
                found = self.evaluator.bounds.pipeline_term(
                    layer, pipeline_model_parallel_size=point.pipeline_model_parallel_size,
                    num_microbatches=point.num_microbatches, schedule=point.schedule, min_time_scale=self.min_scale)
            self._cheap[key] = found
        return found

    def fits(self, point: Point) -> bool:
        """May the point fit memory (:meth:`CandidateBounds.memory_bound_of` against the largest usable memory)."""
        if not self.check_memory:
            return True
        token = self._token_of.get(id(point.features))
        if token is None:
            token = self._token_of[id(point.features)] = self._tokens.setdefault(bytes_features(point.features),
                                                                                  len(self._tokens))
        key = self._sizes(point) + (token,)
        found = self._memory.get(key)
        if found is None:
            found = self._memory[key] = (self.evaluator.bounds.memory_bound_of(self.space.candidate(point))
                                         <= self.memory_cap)
        return found

    def memory_floor(self, index: int, point: Point) -> float | None:
        """:meth:`CandidateBounds.memory_floor_ms` of the point at ``index``, once per search (each depth's branch
        and bound asks again of the points it shares with the whole search's)."""
        found = self._floors.get(index, _UNKNOWN)
        if found is _UNKNOWN:
            found = self._floors[index] = self.evaluator.bounds.memory_floor_ms(self.space.candidate(point))
        return found

    def split_floor(self, index: int, point: Point) -> float | None:
        """The floor the point's partition would get (:meth:`Evaluator.split_floor_ms`, with the branch and bound's
        margin), where its split is known without solving; once per search. None elsewhere, and on a mixed cluster
        (several placements)."""
        found = self._split_floors.get(index, _UNKNOWN)
        if found is _UNKNOWN:
            cand = self.space.candidate(point)
            choices = placements(self.evaluator.cluster, cand.parallel)
            floor = self.evaluator.split_floor_ms(cand, gpus=choices[0]) if len(choices) == 1 else None
            found = self._split_floors[index] = None if floor is None else floor * (1 - _FLOOR_MARGIN)
        return found

    def placements(self, index: int, point: Point, pruned: Counter, work: Counter) -> tuple[Prepared, ...]:
        """:func:`_prepare_placements` of the point at ``index``, once per search: a later ask counts the same
        partitions and prunes into ``work`` and ``pruned``."""
        found = self._placed.get(index)
        if found is None:
            own_pruned, own_work = Counter(), Counter()
            placed = tuple(_prepare_placements(self.evaluator, self.space.candidate(point), own_pruned, own_work))
            found = self._placed[index] = (placed, own_pruned, own_work)
        placed, own_pruned, own_work = found
        pruned.update(own_pruned)
        work.update(own_work)
        return placed

    def step(self, point: Point) -> float:
        key = self._sizes(point) + (id(point.features),)
        found = self._steps.get(key)
        if found is None:
            found = self._steps[key] = self.evaluator.bounds.bound(self.space.candidate(point),
                                                                   min_time_scale=self.min_scale).step_ms
        return found


def _bound_all(evaluator: Evaluator, space: Space, pruned: Counter
               ) -> tuple[list[tuple[float, int, tuple[tuple[int, Point], ...]]], _PointBounds]:
    """(cheap step bound, first index, members) of every family of points no other point's runtime features
    dominate (:func:`megapipe.plan.dominance.surviving_points`), best bound first, and the bounds the branch and bound
    asks for the points it pops (:class:`_PointBounds`).

    A family is the points that differ only in their VP, as (index, point) pairs in index order: VP enters neither
    the cheap bound, the memory test nor the full closed-form bound (:class:`_PointBounds`' keys leave it out), so a
    family goes through those three as one entry and splits into its points only where they differ (the memory
    floor and the partition); the points then meet the branch and bound's cutoffs under the same keys as one by
    one."""
    bounds = _PointBounds(evaluator, space)
    survivors = surviving_points(evaluator.costs, space)
    points = space.points
    if len(survivors) < len(points):
        pruned["features"] += len(points) - len(survivors)
    families: dict[tuple, list[tuple[int, Point]]] = {}
    for index in survivors:
        point = points[index]
        families.setdefault(_family(point) + (id(point.features),), []).append((index, point))
    cheap = bounds.cheap
    out = [(cheap(members[0][1]), members[0][0], tuple(members)) for members in families.values()]
    out.sort()  # by bound, then first index (indices differ, so members are never compared)
    return out, bounds


_PP_VP = operator.itemgetter(2, 4)
"""A point's PP and VP (:class:`megapipe.plan.space.Point`)."""

_family = operator.itemgetter(0, 1, 2, 3, 5, 6, 7, 8, 9, 10, 11, 12)
"""A point's fields but its VP and features (:class:`megapipe.plan.space.Point`)."""


def _points(bounded) -> int:
    """How many points the entries of :func:`_bound_all` hold."""
    return sum(len(members) for _, _, members in bounded)


def _min_time_scale(evaluator: Evaluator) -> float:
    """The fastest GPU type relative to the profiled one, from datasheet matmul throughput."""
    ref = evaluator.cluster.gpu
    return min(datasheet_time_scale(group.gpu, ref) for group in evaluator.cluster.node_groups)


def _branch_and_bound(evaluator: Evaluator, bounded, bounds: _PointBounds, pruned: Counter, progress,
                      split_floors: bool = False) -> tuple[list[Plan], Counter, float]:
    """Best first over lower bounds that sharpen: a candidate's cheap pipeline bound, its closed-form bound, its
    memory floor, its partition's floor, then its schedule's relaxed step (:meth:`Evaluator.relaxed_floor_ms`).

    A family of points that differ only in VP (:func:`_bound_all`) popped under its cheap bound is dropped if it
    cannot fit memory, else pushed back under its full closed-form bound; popped again, its points go on one by one,
    each under its memory floor where memory forces an uneven split
    (:meth:`~megapipe.plan.candidate_bounds.CandidateBounds.memory_floor_ms`; with ``split_floors``, where the
    solver's split is known without solving, the floor its partition will have instead,
    :meth:`_PointBounds.split_floor`, which is never below it, so a candidate that floor prunes is never
    partitioned). A popped candidate is then
    partitioned and pushed back under max(bound, floor); popped again, each placement still below the cutoff gets
    the relaxed floor and the candidate goes back under it; popped a third time, it is simulated. Once the
    smallest key is no better than the k-th best exact step, nothing left can rank.
    With ``bubble_target`` everything is evaluated.
    """
    options = evaluator.options
    keep_all = options.bubble_target is not None
    heap = [(bound_ms, index, members, _UNCHECKED) for bound_ms, index, members in bounded]  # sorted, so a heap
    total = _points(bounded)
    plans: list[Plan] = []
    feasible_steps: list[float] = []
    work: Counter = Counter()
    memory_floor = float("inf")
    done = 0
    while heap:
        key, index, point, placed = heap[0]
        cutoff = None if keep_all or len(feasible_steps) < options.top_k else feasible_steps[options.top_k - 1]
        if cutoff is not None and key >= cutoff:
            pruned["bound"] += sum(len(entry[2]) if entry[3] is _UNCHECKED or entry[3] is _BOUNDED else 1
                                   for entry in heap)
            break
        heapq.heappop(heap)
        if placed is _UNCHECKED:  # a family under its cheap bound only: the memory test, then the full bound
            first = point[0][1]
            if not bounds.fits(first):
                pruned["memory"] += len(point)
                continue
            heapq.heappush(heap, (max(key, bounds.step(first)), index, point, _BOUNDED))
            continue
        if placed is _BOUNDED:
            if len(point) > 1:  # the family's points part here: each goes on under its own index
                for member in point:
                    heapq.heappush(heap, (key, member[0], (member,), _BOUNDED))
                continue
            point = point[0][1]
            # its floor before partitioning: the partition's own where its split is known (never below the memory
            # floor, which holds for every split that fits), else the memory floor where memory forces an uneven split
            floor = bounds.split_floor(index, point) if split_floors else None
            if floor is None:
                floor = bounds.memory_floor(index, point)
            if floor is not None and floor > key:
                if floor == float("inf"):
                    pruned["memory"] += 1
                else:
                    heapq.heappush(heap, (floor, index, point, None))
                continue
            placed = None
        if placed is None:
            if progress is not None:
                progress(done, total)
            done += 1
            placed = [_Placed(item) for item in bounds.placements(index, point, pruned, work)]
            if placed and not keep_all:
                heapq.heappush(heap, (max(key, min(item.floor_ms for item in placed)), index, point, placed))
                continue
        elif not keep_all and _sharpen(evaluator, placed, cutoff, pruned):
            if placed:
                heapq.heappush(heap, (max(key, min(item.floor_ms for item in placed)), index, point, placed))
            continue
        plan = _finish_best(evaluator, placed, pruned, work, cutoff) if placed else None
        if plan is None:
            continue
        if not plan.feasible:
            memory_floor = min(memory_floor, plan.memory_over_gib)
        plans.append(plan)
        if plan.feasible:
            bisect.insort(feasible_steps, plan.step_time_s * 1e3)
    return plans, work, memory_floor


@dataclasses.dataclass(slots=True)
class _Placed:
    """One partitioned placement of a candidate in the branch and bound, with its sharpest floor so far."""

    prepared: Prepared
    floor_ms: float = 0.0
    sharpened: bool = False

    def __post_init__(self):
        self.floor_ms = self.prepared.floor_ms * (1 - _FLOOR_MARGIN)


def _sharpen(evaluator: Evaluator, placed: list[_Placed], cutoff_ms: float | None, pruned: Counter) -> bool:
    """Give the relaxed floor to every placement still below the cutoff that lacks it; True when one got it (the
    candidate goes back in line). A schedule the sizes do not allow empties ``placed``."""
    sharpened = False
    for item in placed:
        if item.sharpened or cutoff_ms is not None and item.floor_ms >= cutoff_ms:
            continue
        try:
            # a rank's bound that reaches the cutoff settles it: the rest need not be timed
            enough = None if cutoff_ms is None else cutoff_ms / (1 - _FLOOR_MARGIN)
            relaxed = evaluator.relaxed_floor_ms(item.prepared, enough_ms=enough) * (1 - _FLOOR_MARGIN)
        except ScheduleError:
            pruned["schedule"] += 1
            placed.clear()
            return True
        item.floor_ms, item.sharpened, sharpened = max(item.floor_ms, relaxed), True, True
    return sharpened


_UNKNOWN = object()
"""Not yet computed (where None is an answer)."""

_UNCHECKED = object()
"""A heap entry under its cheap bound only (:meth:`_PointBounds.cheap`)."""

_BOUNDED = object()
"""A heap entry under its full closed-form bound, before its memory floor
(:meth:`~megapipe.plan.candidate_bounds.CandidateBounds.memory_floor_ms`)."""

_FLOOR_MARGIN = 1e-9
"""Partition floors are compared with this relative margin, so float rounding can never prune a plan that ranks."""


def _prepare_placements(evaluator: Evaluator, cand: Candidate, pruned: Counter, work: Counter) -> list[Prepared]:
    """Every placement that fits, partitioned; empty (and counted) when none does.

    Memory is decided in closed form first (:meth:`CandidateBounds.split_can_fit`), so the solver
    runs only where a split exists.
    """
    choices = placements(evaluator.cluster, cand.parallel)
    if not choices:
        pruned["placement"] += 1
        return []
    out, uniform = [], False
    for gpus in choices:
        try:
            if not evaluator.bounds.split_can_fit(cand, gpus):
                continue
            work["partitioned"] += 1
            item = evaluator.prepare(cand, gpus=gpus)
        except InfeasibleError:
            continue
        except ScheduleError:
            pruned["schedule"] += 1
            return []
        if len(set(item.stage_recompute)) == 1:  # one setting everywhere: that is the uniform candidate
            uniform = True
            continue
        out.append(item)
    if not out:
        pruned["per_stage_uniform" if uniform else "memory"] += 1
    return out


def _finish_best(evaluator: Evaluator, placed: list[_Placed], pruned: Counter, work: Counter,
                 cutoff_ms: float | None) -> Plan | None:
    """Simulate the placements whose floor is below the cutoff; the best of them by throughput."""
    results = []
    for item in placed:
        if cutoff_ms is not None and item.floor_ms >= cutoff_ms:
            continue
        try:
            results.append(evaluator.finish(item.prepared))
        except ScheduleError:
            pruned["schedule"] += 1
            return None
        work["simulated"] += 1
    return min(results, key=lambda plan: score(plan, "throughput")) if results else None


def _equal_if_faster(evaluator: Evaluator, chosen: Plan) -> Plan | None:
    """The chosen plan's configuration with layers split equally, simulated only when its partition floor and its
    relaxed step both leave it able to beat the chosen plan's step (the one case where it replaces it); else None."""
    cand, gpus = _candidate_of(chosen), _gpus_of(evaluator, chosen)
    step_ms = chosen.step_time_s * 1e3
    try:
        prepared = evaluator.prepare(cand, method="equal", gpus=gpus, check_memory=False)
        if prepared.floor_ms * (1 - _FLOOR_MARGIN) >= step_ms:
            return None
        enough = step_ms / (1 - _FLOOR_MARGIN)
        if evaluator.relaxed_floor_ms(prepared, enough_ms=enough) * (1 - _FLOOR_MARGIN) >= step_ms:
            return None
        return evaluator.finish(prepared)
    except (InfeasibleError, ScheduleError, ConfigError):
        return None


def _try(evaluator: Evaluator, cand: Candidate, *, method: str, gpus=None) -> Plan | None:
    """A comparison plan, kept (flagged infeasible) even when it does not fit."""
    try:
        return evaluator.evaluate(cand, method=method, gpus=gpus, check_memory=False)
    except (InfeasibleError, ScheduleError, ConfigError):
        return None


def _candidate_of(plan: Plan) -> Candidate:
    return Candidate(parallel=plan.parallel, train=plan.train, schedule=plan.schedule)


def _gpus_of(evaluator: Evaluator, plan: Plan):
    return gpus_by_name(evaluator.cluster, plan.stage_gpus) if plan.stage_gpus else None


def reference_candidate(reference: Reference, *, cluster: ClusterSpec, train: TrainSpec,
                        use_distributed_optimizer: bool = True, template: ParallelSpec | None = None) -> Candidate | None:
    """The reference's TP and PP, DP = the rest, 1F1B, micro-batch 1, no recompute, SP; None if it does not fit."""
    tp, pp = reference.tensor_model_parallel_size, reference.pipeline_model_parallel_size
    if cluster.num_gpus % (tp * pp) or cluster.domain_gpus % tp:
        return None
    dp = cluster.num_gpus // (tp * pp)
    if train.global_batch_size % dp:
        return None
    template = template or ParallelSpec(use_distributed_optimizer=use_distributed_optimizer)
    parallel = dataclasses.replace(
        template, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, data_parallel_size=dp,
        virtual_pipeline_model_parallel_size=1, context_parallel_size=1, sequence_parallel=tp > 1,
        tp_comm_overlap=template.tp_comm_overlap and tp > 1, microbatch_group_size_per_vp_stage=None)
    fixed_train = dataclasses.replace(train, micro_batch_size=1, recompute_granularity=Recompute.none)
    return Candidate(parallel=parallel, train=fixed_train, schedule=ScheduleName.one_f_one_b)


def _reference(evaluator: Evaluator, options: SearchOptions, train: TrainSpec, template: ParallelSpec) -> Plan | None:
    """The reference evaluated as the search evaluates (memory-checked), flagged infeasible only when it cannot fit."""
    if options.reference is None:
        return None
    cand = reference_candidate(options.reference, cluster=evaluator.cluster, train=train,
                               use_distributed_optimizer=template.use_distributed_optimizer, template=template)
    if cand is None or evaluator.model.num_layers < cand.parallel.pipeline_model_parallel_size:
        return None
    choices = placements(evaluator.cluster, cand.parallel)
    if not choices:
        return None
    try:
        return evaluator.evaluate(cand, gpus=choices[0])
    except InfeasibleError:
        return _try(evaluator, cand, method="optimal", gpus=choices[0])
    except MegapipeError:  # the model does not divide over the reference's sizes
        return None


def _no_plan_message(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, pruned: Counter,
                     memory_floor: float, fixed: Mapping[str, object]) -> str:
    reasons = ", ".join(f"{reason}={count}" for reason, count in sorted(pruned.items())) or "none enumerated"
    hint = _no_plan_hint(cluster, train, pruned, fixed)
    if memory_floor != float("inf"):
        hint = f"the closest plan is {memory_floor:.1f} GiB over; " + hint
    return (f"no feasible plan for model={model.name} on {cluster.num_gpus} GPUs of "
            f"{cluster.gpu.memory_gib:g} GiB with global_batch_size={train.global_batch_size} "
            f"(pruned: {reasons}); {hint}")


def _no_plan_hint(cluster: ClusterSpec, train: TrainSpec, pruned: Counter, fixed: Mapping[str, object]) -> str:
    """The fix for what pruned every candidate: the batch split, the shape rules, or memory."""
    memory = sum(count for reason, count in pruned.items() if reason not in ("microbatches", "divisibility"))
    batch = train.global_batch_size
    if memory:
        every = divisors(cluster.num_gpus)
        dps = [d for d in every if batch % d == 0]
        split = (f"global_batch_size={batch} splits evenly only over DP {dps} (a multiple of {cluster.num_gpus} "
                 "splits over every DP); " if len(dps) < len(every) else "")
        return split + "use more GPUs, recompute_granularity=full, or a smaller micro_batch_size"
    if "num_microbatches" in fixed:
        m = int(fixed["num_microbatches"])
        return (f"no micro_batch_size x DP splits global_batch_size={batch} into train.num_microbatches={m} "
                f"microbatches; leave train.num_microbatches null, or set a global batch of {m} x micro_batch_size "
                "x DP")
    if pruned.get("microbatches") and not pruned.get("divisibility"):
        return (f"global_batch_size={batch} is not a multiple of DP x micro_batch_size for any candidate, or leaves "
                f"too few microbatches for the schedule; use a multiple of {cluster.num_gpus} (every DP divides it)")
    return ("the model's layers or heads do not divide over any candidate's sizes (Megatron's shape rules); "
            "pin other sizes or use another GPU count")
