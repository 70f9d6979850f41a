"""One candidate, exactly: cost the layers -> solve the partition -> simulate the schedule
-> add data-parallel sync and the optimizer step -> throughput, MFU, memory and money.

Plus a closed-form lower bound on the step time and on the fullest rank's memory, used by
the search to skip candidates that cannot rank (branch and bound). Caches are keyed by
what each step depends on: layer costs by (TP, SP, CP, micro-batch, recompute, sequence,
DP), schedules by (name, PP, VP, microbatches), pipeline p2p links by the rank stride.
:meth:`Evaluator.prepare` partitions and prices everything but the pipeline, with a floor
on the step time; :meth:`Evaluator.finish` simulates; the search runs them apart.

MFU convention (Chowdhery et al. 2022, PaLM App. B; Narayanan et al. 2021 eq. 3): model
FLOPs per token from :func:`megapipe.cost.model_flops_per_token` (6 x parameters plus the
attention score/context matmuls, forward + backward, recompute not counted), divided by
the sum of the GPUs' dense bf16 peaks.
"""

from __future__ import annotations

from dataclasses import dataclass

from megapipe import cost, partition, schedules
from megapipe.partition.memory import chunk_memory_caps, in_flight_counts, stage_ranks
from megapipe.plan.adaptive import per_stage_bound, per_stage_can_fit, per_stage_memory_bound, per_stage_partition
from megapipe.plan.bounds import BOUND_CLASS, least_in_flight, layer_shape, pipeline_floor_ms, split_can_fit, water_level
from megapipe.plan.metrics import GIB, plan_record
from megapipe.plan.records import Candidate, Plan, SearchOptions, StageUsage
from megapipe.plan.sync import dp_sync_ms, optimizer_step_ms
from megapipe.plan.units import UnitCosts, repeated_sum
from megapipe.profile.format import Profile
from megapipe.records import ClusterSpec, GpuSpec, LayerCost, LayerKind, ModelSpec, Partition, StageSpec
from megapipe.simulate import StageTimes, p2p_cost, pipeline_link, simulate, stage_times

__all__ = ["Bound", "Evaluator", "Prepared", "pipeline_link", "GIB"]


@dataclass(frozen=True, slots=True)
class _Totals:
    """Sums over a profile: what bounds need without a partition."""

    fwd_ms: float
    bwd_ms: float
    wgrad_ms: float
    static_bytes: float
    act_bytes: float
    param_count: float
    num_decoders: int
    decoder_min_ms: float
    """The cheapest decoder entry's fwd_ms + bwd_ms."""


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
    sums: _RankSums
    floor_ms: float
    """:func:`pipeline_floor_ms` of the partition plus its exact DP sync and optimizer step."""
    stage_recompute: tuple[str, ...] = ()
    """Recompute setting per pipeline rank, for per-stage recompute candidates."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Bound:
    """Lower bounds valid for every partition of a candidate."""

    step_ms: float
    memory_bytes: float
    """The fullest rank holds at least the mean: (static + one microbatch of activations) / PP."""


class Evaluator:
    """Evaluates candidates of one (model, cluster) scenario; holds its caches, nothing global."""

    def __init__(self, *, model: ModelSpec, cluster: ClusterSpec, options: SearchOptions = SearchOptions(),
                 profile: Profile | None = None):
        self.model = model
        self.cluster = cluster
        self.options = options
        self.fixed_profile = profile
        self._profiles: dict[tuple, Profile] = {}
        self._totals: dict[tuple, _Totals] = {}
        self._schedules: dict[tuple, object] = {}
        self._flops: dict[int, float] = {}
        self._shapes: dict[tuple, object] = {}
        self._units: dict[tuple, tuple[LayerCost, ...]] = {}
        self._forward_shares: dict[tuple, float] = {}
        self._memory_bounds: dict[tuple, float] = {}
        self._dp_terms: dict[tuple, tuple[float, float]] = {}
        self._uniform_specs: dict[int, tuple[StageSpec, ...]] = {}
        self._layouts: dict[tuple, tuple[tuple[int, ...], tuple[int, ...]]] = {}
        self._unit_costs = UnitCosts(model=model, cluster=cluster)

    # -- layer costs -----------------------------------------------------------------
    def profile(self, cand: Candidate, gpu: GpuSpec | None = None) -> Profile:
        if self.fixed_profile is not None:
            return self.fixed_profile
        gpu = gpu or self.cluster.gpu
        key = cand.layer_key + (cand.parallel.data_parallel_size, gpu.name)
        found = self._profiles.get(key)
        if found is None:
            found = cost.layer_costs(model=self.model, gpu=gpu, cluster=self.cluster, parallel=cand.parallel,
                                     train=cand.train)
            self._profiles[key] = found
        return found

    def bound_layers(self, cand: Candidate, gpu: GpuSpec | None = None) -> tuple[LayerCost, ...]:
        """The profile's entries with the same values, for bounds: without the per-layer records.

        The cost model costs one decoder (and one MTP) layer and repeats it
        (:func:`megapipe.cost.layer_costs`), so the costs of a one-layer model, each unit repeated
        num_layers times by reference, hold the same numbers at a fraction of the cost; every sum
        over them is the same sum. tests/test_plan_bounds.py checks the two agree.
        """
        if self.fixed_profile is not None:
            return self.fixed_profile.layers
        gpu = gpu or self.cluster.gpu
        key = cand.layer_key + (cand.parallel.data_parallel_size, gpu.name)
        if key in self._profiles:
            return self._profiles[key].layers
        found = self._units.get(key)
        if found is None:
            found = self._unit_costs.layers(cand, gpu)
            self._units[key] = found
        return found

    def totals(self, cand: Candidate) -> _Totals:
        key = cand.layer_key + (cand.parallel.data_parallel_size,)
        found = self._totals.get(key)
        if found is None:
            if self.fixed_profile is not None:
                units, counts = self.fixed_profile.layers, (1,) * len(self.fixed_profile.layers)
            else:
                units, counts = self._unit_costs.runs(cand, self.cluster.gpu)
            decoders = [(unit.fwd_ms + unit.bwd_ms, count) for unit, count in zip(units, counts)
                        if unit.kind == LayerKind.decoder and count]
            found = _Totals(*(repeated_sum([getattr(unit, name) for unit in units], counts) for name in
                              ("fwd_ms", "bwd_ms", "wgrad_ms", "static_bytes", "act_bytes", "param_count")),
                            num_decoders=sum(count for _, count in decoders),
                            decoder_min_ms=min((ms for ms, _ in decoders), default=0.0))
            self._totals[key] = found
        return found

    def model_flops_per_token(self, seq_length: int) -> float:
        if seq_length not in self._flops:
            self._flops[seq_length] = cost.model_flops_per_token(self.model, seq_length)
        return self._flops[seq_length]

    # -- bounds ----------------------------------------------------------------------
    def bound(self, cand: Candidate, *, min_time_scale: float = 1.0) -> Bound:
        """Closed-form lower bounds, valid for every partition of the candidate.

        Pipeline: rank r cannot start before the first microbatch's forward crossed the ranks
        before it, and runs m microbatches of its share t_r, so step >= m t_r + phi sum_{s<r} t_s,
        where phi is the share of a rank's time that sits on that path: 1 for GPipe/1F1B (the
        fused backward must also drain back through ranks s < r), the forward share
        F / (F + B) of the cheapest unit for ZB-H1/H2, and 0 for interleaved and V-shaped
        schedules. Minimising the max over ranks subject to sum t_r = T gives equal g_r,
        t_{r+1} = q t_r with q = 1 - phi/m, hence step >= m T / sum_{r<p} q^r (the weights
        lambda_s ~ q^(p-1-s) certify it as a bound). For balanced stages and phi = 1 this is
        close to the (m + p - 1) T / p of Narayanan et al. 2021. Layers are whole, so some rank
        also runs ceil(N / p) decoders m times: step >= m ceil(N / p) min_decoder(F + B).
        DP sync: the exposed time max(0, comm_r - backward_r) is convex in the rank's
        (parameters, backward), so its maximum over ranks is at least its value at the mean
        rank (Jensen); the optimizer step is linear in parameters, likewise.
        tests/test_plan_search.py checks bound <= exact over a whole search space.
        """
        if cand.per_stage_recompute:
            return per_stage_bound(self, cand, min_time_scale=min_time_scale)
        return self.bound_terms(cand, min_time_scale=min_time_scale, forward_share=self._forward_share(cand))

    def bound_terms(self, cand: Candidate, *, min_time_scale: float, forward_share: float,
                    include_sync: bool = True) -> Bound:
        """:meth:`bound` with the zero-bubble forward share given; without the DP sync term if asked."""
        totals = self.totals(cand)
        par = cand.parallel
        pp, m = par.pipeline_model_parallel_size, cand.num_microbatches
        total_ms = (totals.fwd_ms + totals.bwd_ms) * min_time_scale
        phi = {"gpipe": 1.0, "1f1b": 1.0, "zb_h1": forward_share, "zb_h2": forward_share}.get(cand.schedule, 0.0)
        ratio = 1.0 - phi / m
        pipeline = m * total_ms / sum(ratio ** r for r in range(pp))
        # Some rank holds ceil(N / p) decoders and runs their F + B for every microbatch in sequence.
        fullest = m * -(-totals.num_decoders // pp) * totals.decoder_min_ms * min_time_scale
        pipeline = max(pipeline, fullest)
        if self.cluster.is_heterogeneous:  # per-type windows and bandwidths: keep the pipeline term only
            return Bound(step_ms=pipeline, memory_bytes=self.memory_bound(cand))
        optimizer, sync = self._dp_step_terms(cand, totals, include_sync)
        return Bound(step_ms=pipeline + optimizer + sync, memory_bytes=self.memory_bound(cand))

    def _dp_step_terms(self, cand: Candidate, totals: _Totals, include_sync: bool) -> tuple[float, float]:
        """Optimizer step and exposed DP sync of the mean rank; they do not depend on VP or the schedule."""
        par = cand.parallel
        key = cand.layer_key + (par.data_parallel_size, include_sync)
        found = self._dp_terms.get(key)
        if found is None:
            pp = par.pipeline_model_parallel_size
            params = totals.param_count / pp
            optimizer = optimizer_step_ms(params_per_gpu=params, gpu=self.cluster.gpu, parallel=par,
                                          precision=cand.train.precision)
            sync = dp_sync_ms(params_per_gpu=params, precision=cand.train.precision, cluster=self.cluster,
                              parallel=par, backward_ms=totals.bwd_ms / pp,
                              forward_ms=totals.fwd_ms / pp) if include_sync else 0.0
            found = self._dp_terms[key] = (optimizer, sync)
        return found

    def forward_share(self, cand: Candidate) -> float:
        """The smallest F / (F + B) over the profile's entries."""
        return self._forward_share(cand)

    def _forward_share(self, cand: Candidate) -> float:
        key = cand.layer_key + (cand.parallel.data_parallel_size,)
        if key not in self._forward_shares:
            layers = (self.fixed_profile.layers if self.fixed_profile is not None
                      else self._unit_costs.runs(cand, self.cluster.gpu)[0])
            self._forward_shares[key] = min((layer.fwd_ms / (layer.fwd_ms + layer.bwd_ms)
                                             for layer in layers if layer.fwd_ms + layer.bwd_ms > 0), default=0.0)
        return self._forward_shares[key]

    def memory_bound(self, cand: Candidate) -> float:
        """A lower bound on the fullest rank's bytes, over every split (water-filling).

        Rank r keeps at least k_r microbatches of each layer it holds (closed forms below), so
        n_r identical decoder layers cost n_r (c + k_r a); the embedding is pinned to the first
        layout stage and the loss to the last, each with its own k. The smallest M with
        sum_r max(0, (M - pinned_r) / (c + k_r a)) >= N is what a fluid split needs; no integer
        split needs less.

        In-flight lower bounds without building the schedule: 1F1B keeps min(p - s, m) on stage
        s and GPipe m (Narayanan et al. 2021); ZB-H1/H2 release at W, after 1F1B's B, so they
        hold at least as many; interleaved and V-shaped schedules are bounded by 1.
        """
        key = cand.layer_key + (cand.parallel.data_parallel_size, cand.num_microbatches,
                                _memory_class(cand.schedule))
        found = self._memory_bounds.get(key)
        if found is None:
            found = self._memory_bounds[key] = self._water_level(cand)
        return found

    def memory_bound_of(self, cand: Candidate) -> float:
        """The memory term of :meth:`bound` (full recompute's for a per-stage recompute candidate)."""
        return per_stage_memory_bound(self, cand) if cand.per_stage_recompute else self.memory_bound(cand)

    def _water_level(self, cand: Candidate) -> float:
        par = cand.parallel
        pp, m = par.pipeline_model_parallel_size, cand.num_microbatches
        least = least_in_flight(cand.schedule, pp, m)
        layers = self.bound_layers(cand)
        decoder = next((layer for layer in layers if layer.kind == LayerKind.decoder), None)
        if decoder is None:
            totals = self.totals(cand)
            return (totals.static_bytes + totals.act_bytes) / pp
        pinned = [0.0] * pp
        last_rank = 0 if cand.schedule in _V_SHAPED else pp - 1
        for layer, rank in ((layers[0], 0), (layers[-1], last_rank)):
            if layer.kind != LayerKind.decoder:
                pinned[rank] += layer.static_bytes + least[rank] * layer.act_bytes
        per_layer = [decoder.static_bytes + k * decoder.act_bytes for k in least]
        return water_level(pinned, per_layer, self.model.num_layers)

    # -- exact -----------------------------------------------------------------------
    def schedule(self, cand: Candidate):
        par = cand.parallel
        key = (cand.schedule, par.pipeline_model_parallel_size, par.virtual_pipeline_model_parallel_size,
               cand.num_microbatches)
        found = self._schedules.get(key)
        if found is None:
            found = schedules.build(cand.schedule, pipeline_model_parallel_size=key[1], num_microbatches=key[3],
                                    virtual_pipeline_model_parallel_size=key[2])
            self._schedules[key] = found
        return found

    def stage_specs(self, cand: Candidate, gpus: tuple[GpuSpec, ...] | None = None, *,
                    layers_of=None) -> tuple[StageSpec, ...]:
        """One StageSpec per rank: memory, and time relative to the profiled GPU (1 on that GPU)."""
        pp = cand.parallel.pipeline_model_parallel_size
        if gpus is None or all(gpu is self.cluster.gpu for gpu in gpus):  # all on the profiled GPU: scale 1
            found = self._uniform_specs.get(pp)
            if found is None:
                gpu = self.cluster.gpu
                found = self._uniform_specs[pp] = (StageSpec(time_scale=1.0, memory_bytes=gpu.usable_memory_bytes,
                                                             gpu_name=gpu.name),) * pp
            return found
        layers_of = layers_of or (lambda c, gpu=None: self.profile(c, gpu).layers)
        ref_ms = None
        specs = []
        for gpu in gpus:
            scale = 1.0
            if gpu != self.cluster.gpu:
                ref_ms = ref_ms if ref_ms is not None else _profile_ms(layers_of(cand))
                scale = _profile_ms(layers_of(cand, gpu)) / ref_ms
            specs.append(StageSpec(time_scale=scale, memory_bytes=gpu.usable_memory_bytes, gpu_name=gpu.name))
        return tuple(specs)

    def partition(self, cand: Candidate, *, method: str = "optimal", gpus: tuple[GpuSpec, ...] | None = None,
                  check_memory: bool = True) -> Partition:
        return partition.solve(
            self.profile(cand), list(self.stage_specs(cand, gpus)), num_microbatches=cand.num_microbatches,
            schedule=cand.schedule, virtual_pipeline_model_parallel_size=cand.parallel.virtual_pipeline_model_parallel_size,
            method=method, check_memory=check_memory,
        )

    def split_can_fit(self, cand: Candidate, gpus: tuple[GpuSpec, ...] | None = None) -> bool:
        """False only when the solver would find no split within memory (closed form, no solve).

        Exact for the cost model's profiles (identical decoders between the embedding and the
        loss); for any other profile it answers True and leaves the verdict to the solver.
        """
        if cand.per_stage_recompute:
            return per_stage_can_fit(self, cand, gpus)
        key = cand.layer_key + (cand.parallel.data_parallel_size,)
        if key not in self._shapes:
            self._shapes[key] = layer_shape(self.bound_layers(cand))
        shape = self._shapes[key]
        if shape is None or self.options.ignore_memory_limit:
            return True
        in_flight, ranks = self._layout_counts(cand)
        specs = self.stage_specs(cand, gpus, layers_of=self.bound_layers)
        caps = chunk_memory_caps(layers=self.bound_layers(cand), stages=specs, in_flight=in_flight, ranks=ranks)
        return split_can_fit(shape=shape, caps=caps, in_flight=in_flight)

    def _layout_counts(self, cand: Candidate) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Peak in-flight microbatches and pipeline rank of every layout stage."""
        par = cand.parallel
        pp, vp = par.pipeline_model_parallel_size, par.virtual_pipeline_model_parallel_size
        key = (cand.schedule, pp, vp, cand.num_microbatches)
        found = self._layouts.get(key)
        if found is None:
            in_flight = in_flight_counts(schedule=cand.schedule, pipeline_model_parallel_size=pp,
                                         num_microbatches=key[3], virtual_pipeline_model_parallel_size=vp)
            ranks = stage_ranks(schedule=cand.schedule, pipeline_model_parallel_size=pp, num_stages=pp * vp)
            found = self._layouts[key] = (in_flight, ranks)
        return found

    def prepare(self, cand: Candidate, *, method: str = "optimal", gpus: tuple[GpuSpec, ...] | None = None,
                check_memory: bool | None = None) -> Prepared:
        """Partition one candidate and price what does not need the simulation; raises InfeasibleError.

        ``check_memory`` None follows ``search.ignore_memory_limit``; False keeps a split that does
        not fit (the plan is then flagged infeasible with the GiB over).
        """
        pp = cand.parallel.pipeline_model_parallel_size
        gpus = gpus or (self.cluster.gpu,) * pp
        if check_memory is None:
            check_memory = not self.options.ignore_memory_limit
        specs = self.stage_specs(cand, gpus)
        if cand.per_stage_recompute:
            part, layers, choices = per_stage_partition(self, cand, specs, check_memory=check_memory)
        else:
            part = self.partition(cand, method=method, gpus=gpus, check_memory=check_memory)
            layers, choices = self.profile(cand).layers, ()
        times = stage_times(layers=layers, layers_per_stage=part.layers_per_stage, stage_to_rank=part.stage_to_rank,
                            specs=specs)
        sums = self._rank_sums(cand, layers, part, times, gpus)
        floor = pipeline_floor_ms(schedule=cand.schedule, stage_to_rank=part.stage_to_rank, fwd_ms=times.fwd_ms,
                                  bwd_ms=times.bwd_ms, num_microbatches=cand.num_microbatches)
        return Prepared(cand=cand, gpus=gpus, partition=part, specs=specs, times=times, sums=sums,
                        floor_ms=floor + sums.sync_ms + sums.optimizer_ms, stage_recompute=choices)

    def finish(self, prepared: Prepared) -> Plan:
        """Simulate a prepared candidate's schedule and price the plan; raises ScheduleError."""
        cand = prepared.cand
        p2p = p2p_cost(model=self.model, cluster=self.cluster, parallel=cand.parallel, train=cand.train)
        sim = simulate(self.schedule(cand), prepared.times, p2p=p2p)
        return self._plan(prepared, sim)

    def evaluate(self, cand: Candidate, *, method: str = "optimal", gpus: tuple[GpuSpec, ...] | None = None,
                 check_memory: bool | None = None) -> Plan:
        """Partition, simulate and price one candidate; raises InfeasibleError / ScheduleError."""
        return self.finish(self.prepare(cand, method=method, gpus=gpus, check_memory=check_memory))

    def _rank_sums(self, cand: Candidate, layers, part: Partition, times: StageTimes, gpus) -> _RankSums:
        par, train = cand.parallel, cand.train
        pp = par.pipeline_model_parallel_size
        static = [0.0] * pp
        params = [0.0] * pp
        fwd = [0.0] * pp
        bwd = [0.0] * pp
        start = 0
        for stage, count in enumerate(part.layers_per_stage):
            rank = part.stage_to_rank[stage]
            chunk = layers[start:start + count]
            start += count
            static[rank] += sum(layer.static_bytes for layer in chunk)
            params[rank] += sum(layer.param_count for layer in chunk)
            fwd[rank] += times.fwd_ms[stage]
            bwd[rank] += times.bwd_ms[stage]
        sync = max(dp_sync_ms(params_per_gpu=params[r], precision=train.precision, cluster=self.cluster,
                              parallel=par, backward_ms=bwd[r], forward_ms=fwd[r]) for r in range(pp))
        optimizer = max(optimizer_step_ms(params_per_gpu=params[r], gpu=gpus[r], parallel=par,
                                          precision=train.precision) for r in range(pp))
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
        return plan_record(cand=cand, part=part, sim=sim, usages=usages, specs=specs, sync_ms=sums.sync_ms,
                           optimizer_ms=sums.optimizer_ms, cluster=self.cluster, options=self.options,
                           flops_per_token=self.model_flops_per_token(cand.train.seq_length),
                           stage_recompute=prepared.stage_recompute)


_V_SHAPED = ("zb_v", "dualpipe_v")
_MEMORY_CLASS = {"zero_bubble": "1f1b"}
"""ZB-H1/H2 have 1F1B's least in-flight counts and loss placement (:func:`least_in_flight`)."""


def _memory_class(schedule: str) -> str:
    bound_class = BOUND_CLASS[schedule]
    return _MEMORY_CLASS.get(bound_class, bound_class)


def _profile_ms(layers) -> float:
    return sum(layer.fwd_ms + layer.bwd_ms for layer in layers)
