"""One candidate, exactly: cost the layers -> solve the partition -> simulate the schedule
-> add data-parallel sync and the optimizer step -> throughput, MFU, memory and money.

The :class:`Evaluator` holds one scenario's :class:`~megapipe.plan.layer_costs.LayerCosts` and
the closed-form lower bounds the search skips candidates with
(:class:`~megapipe.plan.candidate_bounds.CandidateBounds`, over the same costs). Schedules are
cached by (name, PP, VP, microbatches). :meth:`Evaluator.prepare` partitions and prices
everything but the pipeline, with a floor on the step time; :meth:`Evaluator.finish`
simulates; the search runs them apart.

MFU convention (Chowdhery et al. 2022, PaLM App. B; Narayanan et al. 2021 eq. 3): model
FLOPs per token from :func:`megapipe.cost.model_flops_per_token` (6 x parameters plus the
attention score/context matmuls, forward + backward, recompute not counted), divided by
the sum of the GPUs' dense bf16 peaks.
"""

from __future__ import annotations

from dataclasses import dataclass

from megapipe import partition, schedules
from megapipe.errors import MegapipeError
from megapipe.plan.bounds import pipeline_floor_ms
from megapipe.plan.breakdown import step_breakdown
from megapipe.plan.candidate_bounds import CandidateBounds
from megapipe.plan.layer_costs import LayerCosts
from megapipe.plan.unit_costs import SharedCosts
from megapipe.plan.metrics import plan_record
from megapipe.plan.per_stage_recompute import per_stage_partition
from megapipe.plan.plans import Candidate, Plan, StageUsage
from megapipe.options import SearchOptions
from megapipe.cost.memory import dispatcher_transient_bytes
from megapipe.cost.data_parallel import dp_sync_ms, optimizer_step_ms
from megapipe.records import ClusterSpec, GpuSpec, LayerCost, ModelSpec, Partition, Profile, StageSpec
from megapipe.layout import stage_entries
from megapipe.simulate import StageTimes, p2p_cost, relaxed_step_ms, simulate, stage_times
from megapipe.simulate.engine import step_time_ms as simulate_step_ms

__all__ = ["Evaluator", "Prepared", "step_seconds"]


@dataclass(frozen=True, slots=True, kw_only=True)
class _RankSums:
    """Per pipeline rank of one partition: static bytes, per-microbatch times; the slowest rank's sync and step."""

    static_bytes: tuple[float, ...]
    fwd_ms: tuple[float, ...]
    bwd_ms: tuple[float, ...]
    sync_ms: float
    optimizer_ms: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Prepared:
    """A partitioned candidate, before simulation; ``floor_ms`` bounds its step time from below."""

    cand: Candidate
    gpus: tuple[GpuSpec, ...]
    partition: Partition
    specs: tuple[StageSpec, ...]
    times: StageTimes
    layers: tuple[LayerCost, ...]
    """The profile entries the partition splits (per-stage recompute picks them per stage)."""
    sums: _RankSums
    floor_ms: float
    """:func:`pipeline_floor_ms` of the partition plus its exact DP sync and optimizer step."""
    stage_recompute: tuple[str, ...] = ()
    """Recompute setting per pipeline rank, for per-stage recompute candidates."""


class Evaluator:
    """Evaluates candidates of one (model, cluster) scenario; holds its caches, nothing global."""

    def __init__(self, *, model: ModelSpec, cluster: ClusterSpec, options: SearchOptions = SearchOptions(),
                 profile: Profile | None = None, schedules: dict | None = None, shared: SharedCosts | None = None):
        """``schedules``: a cache of built schedules to share with other evaluators (they depend on sizes only);
        ``shared``: unit costs and schedules to share with other searches of the model on one node group."""
        self.model = model
        self.cluster = cluster
        self.options = options
        self.costs = LayerCosts(model=model, cluster=cluster, profile=profile, shared=shared)
        if schedules is None and shared is not None:
            schedules = shared.schedules
        self.bounds = CandidateBounds(costs=self.costs, options=options)
        self._schedules: dict[tuple, object] = {} if schedules is None else schedules
        self._shared = shared if profile is None else None

    # -- exact -----------------------------------------------------------------------
    def schedule(self, cand: Candidate):
        par = cand.parallel
        key = (cand.schedule, par.pipeline_model_parallel_size, par.virtual_pipeline_model_parallel_size,
               cand.num_microbatches, par.microbatch_group_size_per_vp_stage)
        found = self._schedules.get(key)
        if found is None:
            found = schedules.build(cand.schedule, pipeline_model_parallel_size=key[1], num_microbatches=key[3],
                                    virtual_pipeline_model_parallel_size=key[2], microbatch_group_size_per_vp_stage=key[4])
            self._schedules[key] = found
        return found

    def partition(self, cand: Candidate, *, method: str = "optimal", gpus: tuple[GpuSpec, ...] | None = None,
                  check_memory: bool = True, layout: str = "") -> Partition:
        """The solver's split by ``method``, or ``layout``'s (a pipeline_model_parallel_layout) as given."""
        if layout:
            profile = self.costs.profile(cand)
            return partition.given_split(profile, list(self.costs.stage_specs(cand, gpus)),
                                         entries_per_stage=stage_entries(profile, layout),
                                         num_microbatches=cand.num_microbatches, schedule=cand.schedule)
        return partition.solve(
            self.costs.profile(cand), list(self.costs.stage_specs(cand, gpus)), num_microbatches=cand.num_microbatches,
            schedule=cand.schedule, virtual_pipeline_model_parallel_size=cand.parallel.virtual_pipeline_model_parallel_size,
            method=method, check_memory=check_memory,
            microbatch_group_size_per_vp_stage=cand.parallel.microbatch_group_size_per_vp_stage,
        )

    def prepare(self, cand: Candidate, *, method: str = "optimal", gpus: tuple[GpuSpec, ...] | None = None,
                check_memory: bool | None = None, layout: str = "") -> Prepared:
        """Partition one candidate and price what does not need the simulation; raises InfeasibleError.

        ``check_memory`` None follows ``search.ignore_memory_limit``; False keeps a split that does
        not fit (the plan is then flagged infeasible with the GiB over).
        """
        if self._shared is None or method != "optimal" or check_memory is not None or layout:
            return self._prepare(cand, method=method, gpus=gpus, check_memory=check_memory, layout=layout)
        return _remembered(self._shared.prepared, (self.cluster, self.options, cand, gpus),
                           lambda: self._prepare(cand, method=method, gpus=gpus, check_memory=None, layout=""))

    def _prepare(self, cand: Candidate, *, method: str, gpus: tuple[GpuSpec, ...] | None, check_memory: bool | None,
                 layout: str) -> Prepared:
        pp = cand.parallel.pipeline_model_parallel_size
        gpus = gpus or (self.cluster.gpu,) * pp
        if check_memory is None:
            check_memory = not self.options.ignore_memory_limit
        specs = self.costs.stage_specs(cand, gpus)
        if cand.per_stage_recompute:
            part, layers, choices = per_stage_partition(self.costs, cand, specs, check_memory=check_memory)
        else:
            part = self.partition(cand, method=method, gpus=gpus, check_memory=check_memory, layout=layout)
            layers, choices = self.costs.profile(cand).layers, ()
        times, sums, floor = self._floor(cand, layers, part.entries_per_stage, part.stage_to_rank, specs, gpus)
        return Prepared(cand=cand, gpus=gpus, partition=part, specs=specs, times=times, layers=tuple(layers), sums=sums,
                        floor_ms=floor, stage_recompute=choices)

    def _floor(self, cand: Candidate, layers, entries_per_stage, stage_to_rank, specs, gpus
               ) -> tuple[StageTimes, _RankSums, float]:
        """A split's stage times, rank sums and floor on the step (:attr:`Prepared.floor_ms`)."""
        times = stage_times(layers=layers, entries_per_stage=entries_per_stage, stage_to_rank=stage_to_rank, specs=specs)
        sums = self._rank_sums(cand, layers, entries_per_stage, stage_to_rank, times, gpus)
        floor = pipeline_floor_ms(schedule=cand.schedule, stage_to_rank=stage_to_rank, fwd_ms=times.fwd_ms,
                                  bwd_ms=times.bwd_ms, num_microbatches=cand.num_microbatches)
        floor += self.cluster.runtime.step_overhead_ms
        return times, sums, floor + sums.sync_ms + sums.optimizer_ms

    def split_floor_ms(self, cand: Candidate, *, gpus: tuple[GpuSpec, ...] | None = None) -> float | None:
        """``prepare(cand, gpus=gpus).floor_ms``, the same float, where the solver's split is known without solving
        (:func:`megapipe.partition.free_split`); None where it is not, or the candidate is one :meth:`prepare` would
        refuse."""
        if cand.per_stage_recompute:
            return None
        par = cand.parallel
        gpus = gpus or (self.cluster.gpu,) * par.pipeline_model_parallel_size
        specs = self.costs.stage_specs(cand, gpus)
        layers = self.costs.bound_layers(cand)  # the profile's numbers, without its per-layer records
        try:
            found = partition.free_split(
                layers, list(specs), num_microbatches=cand.num_microbatches, schedule=cand.schedule,
                virtual_pipeline_model_parallel_size=par.virtual_pipeline_model_parallel_size,
                microbatch_group_size_per_vp_stage=par.microbatch_group_size_per_vp_stage,
                check_memory=not self.options.ignore_memory_limit)
        except MegapipeError:
            return None
        if found is None:
            return None
        return self._floor(cand, layers, *found, specs, gpus)[2]

    def finish(self, prepared: Prepared) -> Plan:
        """Simulate a prepared candidate's schedule and price the plan; raises ScheduleError."""
        if self._shared is not None and self._shared.prepared.get(
                (self.cluster, self.options, prepared.cand, prepared.gpus)) is prepared:
            return _remembered(self._shared.finished, id(prepared), lambda: self._finish(prepared))
        return self._finish(prepared)

    def _finish(self, prepared: Prepared) -> Plan:
        cand = prepared.cand
        p2p = p2p_cost(model=self.model, cluster=self.cluster, parallel=cand.parallel, train=cand.train)
        sim = simulate(self.schedule(cand), prepared.times, p2p=p2p)
        return self._plan(prepared, sim)

    def relaxed_floor_ms(self, prepared: Prepared, *, enough_ms: float | None = None) -> float:
        """A sharper lower bound on the plan's step than ``prepared.floor_ms``, without simulating: each rank's
        own order timed exactly with every other rank unbounded (:func:`megapipe.simulate.relaxed_step_ms`),
        plus the DP sync, optimizer step and step overhead the plan adds. With ``enough_ms``, the first rank
        whose bound reaches it ends the count (the bound returned is then at least ``enough_ms``)."""
        cand = prepared.cand
        p2p = p2p_cost(model=self.model, cluster=self.cluster, parallel=cand.parallel, train=cand.train)
        par = cand.parallel
        ops = schedules.rank_ops(cand.schedule, pipeline_model_parallel_size=par.pipeline_model_parallel_size,
                                 num_microbatches=cand.num_microbatches,
                                 virtual_pipeline_model_parallel_size=par.virtual_pipeline_model_parallel_size,
                                 microbatch_group_size_per_vp_stage=par.microbatch_group_size_per_vp_stage)
        sums = prepared.sums
        extra = sums.sync_ms + sums.optimizer_ms + self.cluster.runtime.step_overhead_ms
        pipeline = relaxed_step_ms(ops, prepared.partition.stage_to_rank, prepared.times,
                                   num_microbatches=cand.num_microbatches, p2p=p2p,
                                   enough_ms=None if enough_ms is None else enough_ms - extra)
        return pipeline + extra

    def step_time_s(self, prepared: Prepared) -> float:
        """The plan's step time without the rest of its record (:meth:`finish`'s step_time_s, cheaper)."""
        return step_seconds(self.step_parts_ms(prepared), self.cluster.runtime.step_overhead_ms)

    def step_parts_ms(self, prepared: Prepared) -> tuple[float, float, float]:
        """(simulated pipeline, exposed DP sync, optimizer step) of the plan: its step without the per-step overhead
        (:func:`step_seconds` adds it)."""
        cand = prepared.cand
        p2p = p2p_cost(model=self.model, cluster=self.cluster, parallel=cand.parallel, train=cand.train)
        sums = prepared.sums
        return simulate_step_ms(self.schedule(cand), prepared.times, p2p=p2p), sums.sync_ms, sums.optimizer_ms

    def evaluate(self, cand: Candidate, *, method: str = "optimal", gpus: tuple[GpuSpec, ...] | None = None,
                 check_memory: bool | None = None) -> Plan:
        """Partition, simulate and price one candidate; raises InfeasibleError / ScheduleError."""
        return self.finish(self.prepare(cand, method=method, gpus=gpus, check_memory=check_memory))

    def split_step_parts_ms(self, cand: Candidate, entries_per_stage: tuple[int, ...],
                            stage_to_rank: tuple[int, ...]) -> tuple[float, float, float]:
        """:meth:`step_parts_ms` of a split already known (a fit re-prices one run's fixed split many times),
        without the partition record: the same stage times, rank sums and simulation, so the same numbers."""
        gpus = (self.cluster.gpu,) * cand.parallel.pipeline_model_parallel_size
        layers = self.costs.profile(cand).layers
        times = stage_times(layers=layers, entries_per_stage=entries_per_stage, stage_to_rank=stage_to_rank,
                            specs=self.costs.stage_specs(cand, gpus))
        sums = self._rank_sums(cand, layers, entries_per_stage, stage_to_rank, times, gpus)
        p2p = p2p_cost(model=self.model, cluster=self.cluster, parallel=cand.parallel, train=cand.train)
        return simulate_step_ms(self.schedule(cand), times, p2p=p2p), sums.sync_ms, sums.optimizer_ms

    def _rank_sums(self, cand: Candidate, layers, entries_per_stage, stage_to_rank, times: StageTimes,
                   gpus) -> _RankSums:
        par, train = cand.parallel, cand.train
        pp = par.pipeline_model_parallel_size
        static = [0.0] * pp
        params = [0.0] * pp
        experts = [0.0] * pp
        fwd = [0.0] * pp
        bwd = [0.0] * pp
        start = 0
        for stage, count in enumerate(entries_per_stage):
            rank = stage_to_rank[stage]
            held = counted = expert = 0  # the chunk's sums, one pass in entry order (what sum() of each field gives)
            for layer in layers[start:start + count]:
                held += layer.static_bytes
                counted += layer.param_count
                expert += layer.expert_param_count
            start += count
            static[rank] += held
            params[rank] += counted
            experts[rank] += expert
            fwd[rank] += times.fwd_ms[stage]
            bwd[rank] += times.bwd_ms[stage]
        # ranks of equal loads (most of them, with identical decoders) have equal terms: each is priced once
        sync = max(dp_sync_ms(params_per_gpu=rank_params, train=train, cluster=self.cluster, parallel=par,
                              backward_ms=rank_bwd, forward_ms=rank_fwd, expert_params_per_gpu=rank_experts)
                   for rank_params, rank_experts, rank_bwd, rank_fwd in dict.fromkeys(zip(params, experts, bwd, fwd)))
        optimizer = max(optimizer_step_ms(params_per_gpu=rank_params, gpu=gpu, parallel=par,
                                          expert_params_per_gpu=rank_experts)
                        for rank_params, rank_experts, gpu in dict.fromkeys(zip(params, experts, gpus)))
        return _RankSums(static_bytes=tuple(static), fwd_ms=tuple(fwd), bwd_ms=tuple(bwd), sync_ms=sync,
                         optimizer_ms=optimizer)

    def _plan(self, prepared: Prepared, sim) -> Plan:
        cand, part, specs, gpus, sums = prepared.cand, prepared.partition, prepared.specs, prepared.gpus, prepared.sums
        static, fwd, bwd = sums.static_bytes, sums.fwd_ms, sums.bwd_ms
        act = [stats.peak_activation_bytes for stats in sim.ranks]
        usages = tuple(
            StageUsage(time_ms=fwd[r] + bwd[r], static_bytes=static[r], activation_bytes=act[r],
                       total_bytes=static[r] + act[r], gpu_name=gpus[r].name if self.cluster.is_heterogeneous else "")
            for r in range(cand.parallel.pipeline_model_parallel_size)
        )
        step_overhead = self.cluster.runtime.step_overhead_ms
        breakdown = step_breakdown(layers=prepared.layers, part=part, specs=specs, num_microbatches=cand.num_microbatches,
                                   pipeline_ms=sim.step_time_ms, sync_ms=sums.sync_ms, optimizer_ms=sums.optimizer_ms,
                                   step_overhead_ms=step_overhead)
        return plan_record(cand=cand, part=part, sim=sim, usages=usages, specs=specs, sync_ms=sums.sync_ms,
                           optimizer_ms=sums.optimizer_ms, cluster=self.cluster, options=self.options,
                           flops_per_token=self.costs.model_flops_per_token(cand.train.seq_length),
                           stage_recompute=prepared.stage_recompute, step_overhead_ms=step_overhead,
                           breakdown=breakdown,
                           dispatcher_bytes=dispatcher_transient_bytes(model=self.model, parallel=cand.parallel,
                                                                       train=cand.train),
                           moe=self.model.is_moe)


def step_seconds(parts: tuple[float, float, float], step_overhead_ms: float) -> float:
    """A step's seconds from :meth:`Evaluator.step_parts_ms` and the runtime's per-step overhead."""
    pipeline, sync, optimizer = parts
    return (pipeline + sync + optimizer + step_overhead_ms) / 1e3


def _remembered(memo: dict, key, compute):
    """``compute()`` once per key; an error it raises (infeasible, schedule) is raised again for the same key."""
    found = memo.get(key)
    if found is None:
        try:
            found = memo[key] = compute()
        except MegapipeError as error:
            found = memo[key] = error
    if isinstance(found, MegapipeError):
        raise found
    return found
