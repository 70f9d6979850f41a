"""Closed-form lower bounds of one candidate, over every partition: what the search prunes with.

:class:`CandidateBounds` bounds the step time (:meth:`~CandidateBounds.bound`), the fullest
rank's memory (:meth:`~CandidateBounds.memory_bound`) and decides memory feasibility in closed
form (:meth:`~CandidateBounds.split_can_fit`) from the layer costs alone
(:class:`~megapipe.plan.layer_costs.LayerCosts`, shared with the exact evaluation), with the
formulas of :mod:`megapipe.plan.bounds`. Its caches are keyed by what each bound depends on:
the layer key (TP, SP, CP, micro-batch, recompute, sequence) and DP, plus the schedule's bound
class where it enters. Per-stage recompute candidates are bounded by the options' extremes.
"""

from __future__ import annotations

import math

import numpy as np

import dataclasses
from dataclasses import dataclass

from megapipe.partition.memory import in_flight_counts, stage_ranks
from megapipe.partition.coupled import UniformShape, uniform_may_fit, uniform_rank_totals, uniform_shape
from megapipe.partition.pinned import PinnedShape, pinned_may_fit, pinned_rank_totals, pinned_shape
from megapipe.plan.bounds import least_in_flight, split_can_fit, stage_capacities, water_level
from megapipe.plan.layer_costs import LayerCosts
from megapipe.plan.per_stage_recompute import RECOMPUTE_OPTIONS, variant
from megapipe.plan.plans import Candidate
from megapipe.options import SearchOptions
from megapipe.cost.data_parallel import dp_sync_ms, optimizer_step_ms
from megapipe.plan.unit_costs import repeated_sum
from megapipe.records import GpuSpec, LayerKind
from megapipe.schedules import PathShare, rank_in_flight_profiles, spec

__all__ = ["Bound", "CandidateBounds"]


@dataclass(frozen=True, slots=True)
class _Totals:
    """Sums over a profile: what bounds need without a partition."""

    fwd_ms: float
    bwd_ms: float
    wgrad_ms: float
    static_bytes: float
    act_bytes: float
    param_count: float
    expert_param_count: float
    num_decoders: int
    decoder_min_ms: float
    """The cheapest decoder entry's fwd_ms + bwd_ms."""



@dataclass(frozen=True, slots=True, kw_only=True)
class Bound:
    """Lower bounds valid for every partition of a candidate."""

    step_ms: float
    memory_bytes: float
    """The fullest rank holds at least the mean: (static + one microbatch of activations) / PP."""


class CandidateBounds:
    """Lower bounds valid for every partition of a candidate, cached per scenario."""

    def __init__(self, *, costs: LayerCosts, options: SearchOptions):
        self.costs = costs
        self.cluster = costs.cluster
        self.options = options
        self._totals: dict[tuple, _Totals] = {}
        self._shapes: dict[tuple, object] = {}
        self._forward_shares: dict[tuple, float] = {}
        self._memory_bounds: dict[tuple, float] = {}
        self._busiest: dict[tuple, float] = {}
        self._dp_terms: dict[tuple, tuple[float, float]] = {}
        self._layouts: dict[tuple, tuple[int, ...]] = {}
        self._kinds: dict[tuple, tuple] = {}
        self._time_totals: dict[tuple, tuple[float, float, float]] = {}

    def totals(self, cand: Candidate) -> _Totals:
        key = cand.layer_key + (cand.parallel.data_parallel_size,)
        found = self._totals.get(key)
        if found is None:
            units, counts = self.costs.runs(cand)
            decoders = [(unit.fwd_ms + unit.bwd_ms, count) for unit, count in zip(units, counts)
                        if unit.kind == LayerKind.decoder and count]
            found = _Totals(*(repeated_sum([getattr(unit, name) for unit in units], counts) for name in
                              ("fwd_ms", "bwd_ms", "wgrad_ms", "static_bytes", "act_bytes", "param_count",
                               "expert_param_count")),
                            num_decoders=sum(count for _, count in decoders),
                            decoder_min_ms=min((ms for ms, _ in decoders), default=0.0))
            self._totals[key] = found
        return found


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
            return self._per_stage_bound(cand, min_time_scale=min_time_scale)
        return self.bound_terms(cand, min_time_scale=min_time_scale, forward_share=self._forward_share(cand))

    def pipeline_bound(self, cand: Candidate, *, min_time_scale: float = 1.0) -> float:
        """A cheaper, weaker :meth:`bound`: the first term of its pipeline bound (m T / sum_r q^r, below) and the
        step overhead, from the units' times alone (no bytes, DP terms or busiest rank), so never above
        ``bound().step_ms`` (the same floats where they agree). What the search orders every point by before it
        sizes any."""
        if cand.per_stage_recompute:
            return self._per_stage_bound(cand, min_time_scale=min_time_scale).step_ms
        return self.pipeline_term(cand, pipeline_model_parallel_size=cand.parallel.pipeline_model_parallel_size,
                                  num_microbatches=cand.num_microbatches, schedule=cand.schedule,
                                  min_time_scale=min_time_scale)

    def pipeline_term(self, layer: Candidate, *, pipeline_model_parallel_size: int, num_microbatches: int,
                      schedule: str, min_time_scale: float = 1.0) -> float:
        """:meth:`pipeline_bound` of a candidate with ``layer``'s layer key and these sizes and schedule (the search
        asks it per point without building each point's record)."""
        key = layer.layer_key
        found = self._time_totals.get(key)
        if found is None:
            units, counts = self.costs.time_runs(layer)
            found = self._time_totals[key] = (
                repeated_sum([unit.fwd_ms for unit in units], counts), repeated_sum([unit.bwd_ms for unit in units],
                                                                                    counts),
                min((unit.fwd_ms / (unit.fwd_ms + unit.bwd_ms) for unit in units if unit.fwd_ms + unit.bwd_ms > 0),
                    default=0.0))
        fwd_ms, bwd_ms, forward_share = found
        return (_pipeline_ms((fwd_ms + bwd_ms) * min_time_scale, pp=pipeline_model_parallel_size, m=num_microbatches,
                             schedule=schedule, forward_share=forward_share)
                + self.cluster.runtime.step_overhead_ms)

    def bound_terms(self, cand: Candidate, *, min_time_scale: float, forward_share: float,
                    include_sync: bool = True) -> Bound:
        """:meth:`bound` with the zero-bubble forward share given; without the DP sync term if asked."""
        totals = self.totals(cand)
        par = cand.parallel
        pp, m = par.pipeline_model_parallel_size, cand.num_microbatches
        pipeline = _pipeline_ms((totals.fwd_ms + totals.bwd_ms) * min_time_scale, pp=pp, m=m, schedule=cand.schedule,
                                forward_share=forward_share)
        # Some rank holds ceil(N / p) decoders and runs their F + B for every microbatch in sequence.
        fullest = m * -(-totals.num_decoders // pp) * totals.decoder_min_ms * min_time_scale
        pipeline = max(pipeline, fullest, m * self._busiest_rank_ms(cand) * min_time_scale)
        pipeline += self.cluster.runtime.step_overhead_ms  # every plan's step carries it
        if self.cluster.is_heterogeneous:  # per-type windows and bandwidths: keep the pipeline term only
            return Bound(step_ms=pipeline, memory_bytes=self.memory_bound(cand))
        optimizer, sync = self._dp_step_terms(cand, totals, include_sync)
        return Bound(step_ms=pipeline + optimizer + sync, memory_bytes=self.memory_bound(cand))

    def _busiest_rank_ms(self, cand: Candidate) -> float:
        """A lower bound on the busiest rank's F + B per microbatch, over every split (water-filling, as
        :meth:`memory_bound`): the embedding is pinned to the first rank and the loss to the schedule's loss
        rank, every decoder weighs at least the lightest decoder kind, and a rank runs all its chunks for
        every microbatch, so the step is at least m times it. It matters where one unit outweighs several
        decoders (a 150k-vocabulary head over small MoE layers)."""
        pp = cand.parallel.pipeline_model_parallel_size
        key = cand.layer_key + (cand.parallel.data_parallel_size, pp, spec(cand.schedule).loss_rank(pp))
        found = self._busiest.get(key)
        if found is None:
            layers = self.costs.bound_layers(cand)
            decoders = [layer.fwd_ms + layer.bwd_ms for layer in layers if layer.kind == LayerKind.decoder]
            if not decoders:
                found = 0.0
            else:
                pinned = [0.0] * pp
                for layer, rank in ((layers[0], 0), (layers[-1], spec(cand.schedule).loss_rank(pp))):
                    if layer.kind != LayerKind.decoder:
                        pinned[rank] += layer.fwd_ms + layer.bwd_ms
                lightest = min(decoders)
                found = _integer_level(pinned, lightest, len(decoders)) if lightest > 0 else max(pinned)
            self._busiest[key] = found
        return found

    def _dp_step_terms(self, cand: Candidate, totals: _Totals, include_sync: bool) -> tuple[float, float]:
        """Optimizer step and exposed DP sync of the mean rank; they do not depend on VP or the schedule."""
        par = cand.parallel
        key = cand.layer_key + (par.data_parallel_size, par.pipeline_model_parallel_size, include_sync)
        found = self._dp_terms.get(key)
        if found is None:
            pp = par.pipeline_model_parallel_size
            params, experts = totals.param_count / pp, totals.expert_param_count / pp
            optimizer = optimizer_step_ms(params_per_gpu=params, gpu=self.cluster.gpu, parallel=par,
                                          expert_params_per_gpu=experts)
            sync = dp_sync_ms(params_per_gpu=params, train=cand.train, cluster=self.cluster,
                              parallel=par, backward_ms=totals.bwd_ms / pp, forward_ms=totals.fwd_ms / pp,
                              expert_params_per_gpu=experts) if include_sync else 0.0
            found = self._dp_terms[key] = (optimizer, sync)
        return found

    def forward_share(self, cand: Candidate) -> float:
        """The smallest F / (F + B) over the profile's entries."""
        return self._forward_share(cand)

    def _forward_share(self, cand: Candidate) -> float:
        key = cand.layer_key + (cand.parallel.data_parallel_size,)
        if key not in self._forward_shares:
            layers = self.costs.runs(cand)[0]
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
                                spec(cand.schedule).memory_class)
        found = self._memory_bounds.get(key)
        if found is None:
            found = self._memory_bounds[key] = self._water_level(cand)
        return found

    def memory_bound_of(self, cand: Candidate) -> float:
        """The memory term of :meth:`bound` (full recompute's for a per-stage recompute candidate)."""
        return self._per_stage_memory_bound(cand) if cand.per_stage_recompute else self.memory_bound(cand)

    def _water_level(self, cand: Candidate) -> float:
        par = cand.parallel
        pp, m = par.pipeline_model_parallel_size, cand.num_microbatches
        least = least_in_flight(cand.schedule, pp, m)
        ends, kinds = self._decoder_kinds(cand)
        if not kinds:
            totals = self.totals(cand)
            return (totals.static_bytes + totals.act_bytes) / pp
        pinned = [0.0] * pp
        last_rank = spec(cand.schedule).loss_rank(pp)
        for (kind, static, act), rank in zip(ends, (0, last_rank)):
            if kind != LayerKind.decoder:
                pinned[rank] += static + least[rank] * act
        # For each decoder kind d (dense, MoE): the layers at least as heavy as d, each costed as d, must
        # fit on their own (the other layers only add), so every such water level bounds the fullest rank.
        return max(water_level(pinned, [static + k * act for k in least], heavier) for static, act, heavier in kinds)

    def _decoder_kinds(self, cand: Candidate) -> tuple[tuple, tuple[tuple[float, float, int], ...]]:
        """(kind, static, act) of the profile's first and last entries and, per distinct decoder unit, (static
        bytes, activation bytes, how many decoders are at least as heavy in both); per bytes, from the units'
        bytes alone (a candidate the memory bound prunes is never timed)."""
        runs = self.costs.bytes_runs(cand)
        found = self._kinds.get(runs)
        if found is None:
            decoders = [(static, act, count) for kind, static, act, count in runs if kind == LayerKind.decoder]
            distinct = dict.fromkeys((static, act) for static, act, _ in decoders)
            ends = (runs[0][:3], runs[-1][:3])
            found = self._kinds[runs] = (ends, tuple(
                (static, act, sum(count for s, a, count in decoders if s >= static and a >= act))
                for static, act in distinct))
        return found

    def split_can_fit(self, cand: Candidate, gpus: tuple[GpuSpec, ...] | None = None) -> bool:
        """False only when the solver would find no split within memory (closed form, no solve).

        Exact for the cost model's profiles: identical decoders between the embedding and the loss, and, where
        ranks hold several chunks, a few entries at each end around identical decoders (a MoE model's dense
        layers and MTP blocks: :func:`~megapipe.partition.pinned.pinned_may_fit`); for any other profile it
        answers True and leaves the verdict to the solver.
        """
        if cand.per_stage_recompute:
            return self._per_stage_can_fit(cand, gpus)
        shape = self._shape(cand)
        if shape is None or self.options.ignore_memory_limit:
            return True
        ranks = self._layout_ranks(cand)
        pp = cand.parallel.pipeline_model_parallel_size
        if len(ranks) == pp and not isinstance(shape, UniformShape):
            return True  # one stage per rank: the solver's split is cheap
        specs = self.costs.stage_specs(cand, gpus, layers_of=self.costs.bound_layers)
        if len(ranks) == pp:
            in_flight = in_flight_counts(schedule=cand.schedule, pipeline_model_parallel_size=pp,
                                         num_microbatches=cand.num_microbatches)
            return split_can_fit(shape=shape, caps=[specs[rank].memory_bytes for rank in ranks], in_flight=in_flight)
        # Ranks hold several chunks: their coupled memory, decided for all ranks at once (the solver settles the
        # rounding cases exactly).
        par = cand.parallel
        profiles = rank_in_flight_profiles(
            cand.schedule, pipeline_model_parallel_size=pp, num_microbatches=cand.num_microbatches,
            virtual_pipeline_model_parallel_size=par.virtual_pipeline_model_parallel_size,
            microbatch_group_size_per_vp_stage=par.microbatch_group_size_per_vp_stage)
        if isinstance(shape, PinnedShape):
            return pinned_may_fit(shape=shape, stages=specs, ranks=ranks, profiles=profiles)
        return uniform_may_fit(shape=shape, stages=specs, ranks=ranks, profiles=profiles)

    def memory_floor_ms(self, cand: Candidate) -> float | None:
        """A lower bound on the step of every split that fits memory, sharper than :meth:`bound` where memory forces
        an uneven split; None where it does not apply (a profile other than identical decoders between the
        embedding and the loss or a few entries at each end around identical decoders (:meth:`_pinned_floor_ms`), a
        mixed cluster, per-stage recompute, memory ignored); inf where no split fits.

        Each rank holds between its fewest and its largest decoder total under its memory (one stage per rank:
        :func:`~megapipe.plan.bounds.stage_capacities`; several: their coupled memory,
        :func:`~megapipe.partition.coupled.uniform_rank_totals`), the embedding's F + B sits on the first stage's
        rank and the loss's on the last's, and every decoder costs at least the lightest's F + B. The busiest rank
        of any fitting split is then at least the level L at which the ranks' capped shares hold every decoder
        (water-filling, relaxed to fractions), and it runs its work for each of the m microbatches in turn: step
        >= m L + the step overhead + the mean rank's optimizer step and exposed DP sync (as in :meth:`bound`).
        tests/test_plan_bounds.py checks it against every partition floor of a search."""
        if cand.per_stage_recompute or self.options.ignore_memory_limit or self.cluster.is_heterogeneous:
            return None
        shape = self._shape(cand)
        par = cand.parallel
        pp = par.pipeline_model_parallel_size
        ranks = self._layout_ranks(cand)
        if isinstance(shape, PinnedShape):
            return self._pinned_floor_ms(cand, shape, ranks)
        if not isinstance(shape, UniformShape):
            return None
        specs = self.costs.stage_specs(cand, None, layers_of=self.costs.bound_layers)
        if len(ranks) == pp:  # one stage per rank: each stage's capacity under its own in-flight count
            in_flight = in_flight_counts(schedule=cand.schedule, pipeline_model_parallel_size=pp,
                                         num_microbatches=cand.num_microbatches)
            found = stage_capacities(shape=shape, caps=[specs[rank].memory_bytes for rank in ranks],
                                     in_flight=in_flight)
            if found is None:
                return math.inf
            fewest, largest = np.zeros(pp), np.zeros(pp)
            for stage, rank in enumerate(ranks):
                fewest[rank] += found[0][stage]
                largest[rank] += found[1][stage]
        else:
            profiles = rank_in_flight_profiles(
                cand.schedule, pipeline_model_parallel_size=pp, num_microbatches=cand.num_microbatches,
                virtual_pipeline_model_parallel_size=par.virtual_pipeline_model_parallel_size,
                microbatch_group_size_per_vp_stage=par.microbatch_group_size_per_vp_stage)
            found = uniform_rank_totals(shape=shape, stages=specs, ranks=ranks, profiles=profiles)
            if found is None:
                return None
            if found is False:
                return math.inf
            fewest, largest = found
        totals = self.totals(cand)
        per_decoder = totals.decoder_min_ms
        if per_decoder <= 0:
            return None
        pinned = np.zeros(pp)
        for entry, rank in ((shape.head, ranks[0]), (shape.tail, ranks[-1])):
            if entry is not None:
                pinned[rank] += entry.fwd_ms + entry.bwd_ms
        level = _capped_level(pinned, per_decoder, fewest, largest, shape.num_decoders)
        if level is None:
            return math.inf
        optimizer, sync = self._dp_step_terms(cand, totals, True)
        return cand.num_microbatches * level * (1 - 1e-9) + self.cluster.runtime.step_overhead_ms + optimizer + sync

    def _pinned_floor_ms(self, cand: Candidate, shape: PinnedShape, ranks: tuple[int, ...]) -> float | None:
        """:meth:`memory_floor_ms` of a profile with a few entries at its ends around identical decoders, on ranks of
        several stages: the least water level over the placements of the ends megatron-core takes, each rank holding
        its pinned entries' F + B and between its fewest and its largest decoders under its coupled memory
        (:func:`~megapipe.partition.pinned.pinned_rank_totals`)."""
        par = cand.parallel
        pp = par.pipeline_model_parallel_size
        per_decoder = shape.decoder.fwd_ms + shape.decoder.bwd_ms
        if per_decoder <= 0:
            return None
        profiles = rank_in_flight_profiles(
            cand.schedule, pipeline_model_parallel_size=pp, num_microbatches=cand.num_microbatches,
            virtual_pipeline_model_parallel_size=par.virtual_pipeline_model_parallel_size,
            microbatch_group_size_per_vp_stage=par.microbatch_group_size_per_vp_stage)
        specs = self.costs.stage_specs(cand, None, layers_of=self.costs.bound_layers)
        found = pinned_rank_totals(shape=shape, stages=specs, ranks=ranks, profiles=profiles)
        if found is None:
            return None
        levels = [_capped_level(pinned, per_decoder, fewest, largest, shape.num_decoders)
                  for pinned, fewest, largest in zip(*found)]
        level = min((found for found in levels if found is not None), default=None)
        if level is None:
            return math.inf
        optimizer, sync = self._dp_step_terms(cand, self.totals(cand), True)
        return cand.num_microbatches * level * (1 - 1e-9) + self.cluster.runtime.step_overhead_ms + optimizer + sync

    def _shape(self, cand: Candidate) -> UniformShape | PinnedShape | None:
        """The bound profile's shape: identical decoders between the embedding and the loss, else a few entries at
        each end around a run of identical decoders; per layer key and DP."""
        key = cand.layer_key + (cand.parallel.data_parallel_size,)
        if key not in self._shapes:
            layers = self.costs.bound_layers(cand)
            self._shapes[key] = uniform_shape(layers) or pinned_shape(layers)
        return self._shapes[key]

    def _layout_ranks(self, cand: Candidate) -> tuple[int, ...]:
        """The pipeline rank of every layout stage."""
        par = cand.parallel
        key = (cand.schedule, par.pipeline_model_parallel_size, par.virtual_pipeline_model_parallel_size)
        found = self._layouts.get(key)
        if found is None:
            found = self._layouts[key] = stage_ranks(schedule=cand.schedule, pipeline_model_parallel_size=key[1],
                                                     num_stages=key[1] * key[2])
        return found

    # -- per-stage recompute: bounds valid for every per-rank choice ----------------------
    def _per_stage_bound(self, cand: Candidate, *, min_time_scale: float) -> Bound:
        """Recompute adds time and removes activation bytes, so the pipeline and optimizer terms of no
        recompute (with the smallest forward share of any option) and the memory of full recompute bound
        every mix; the exposed DP sync, which shrinks as the backward grows, is bounded by 0.
        """
        variants = [variant(cand, option) for option in RECOMPUTE_OPTIONS]
        share = min(self.forward_share(item) for item in variants)
        step = self.bound_terms(variants[0], min_time_scale=min_time_scale, forward_share=share, include_sync=False)
        return dataclasses.replace(step, memory_bytes=self._per_stage_memory_bound(cand))

    def _per_stage_memory_bound(self, cand: Candidate) -> float:
        """Full recompute everywhere holds the fewest activation bytes, so its memory bound bounds every mix."""
        return self.memory_bound(variant(cand, RECOMPUTE_OPTIONS[-1]))

    def _per_stage_can_fit(self, cand: Candidate, gpus: tuple[GpuSpec, ...] | None) -> bool:
        """False only if even full recompute on every rank cannot fit (when it holds the fewest bytes entry by entry)."""
        lightest = variant(cand, RECOMPUTE_OPTIONS[-1])
        others = [self.costs.bound_layers(variant(cand, option)) for option in RECOMPUTE_OPTIONS[:-1]]
        least = self.costs.bound_layers(lightest)
        if not all(low.static_bytes <= entry.static_bytes and low.act_bytes <= entry.act_bytes
                   for layers in others for low, entry in zip(least, layers)):
            return True
        return self.split_can_fit(lightest, gpus)


def _pipeline_ms(total_ms: float, *, pp: int, m: int, schedule: str, forward_share: float) -> float:
    """The pipeline term m T / sum_{r<p} q^r of :meth:`CandidateBounds.bound` (q = 1 - phi/m, phi the share of a
    rank's time on the schedule's fill path)."""
    phi = {PathShare.whole: 1.0, PathShare.forward: forward_share}.get(spec(schedule).path_share, 0.0)
    ratio = 1.0 - phi / m
    return m * total_ms / sum(ratio ** r for r in range(pp))


def _capped_level(pinned, per_layer: float, fewest, largest, num_layers: int) -> float | None:
    """The least L with sum_r clip((L - pinned_r) / per_layer, fewest_r, largest_r) >= num_layers and no less than any
    rank's pinned work plus its fewest layers (fractions allowed, so no integer split's busiest rank is below it);
    None when the largest totals cannot hold every layer. The sum is piecewise linear in L with its corners where a
    rank reaches its fewest or its largest: evaluated at every corner, then solved on the segment where it crosses
    num_layers."""
    if float(largest.sum()) < num_layers:
        return None
    # sorted, repeats kept: a repeat cannot be the crossing's left end (``held`` would already reach num_layers there),
    # and np.sort spares the first search np.unique's import of numpy.ma
    corners = np.sort(np.concatenate([pinned + fewest * per_layer, pinned + largest * per_layer]))
    held = np.clip((corners[:, None] - pinned[None, :]) / per_layer, fewest[None, :], largest[None, :]).sum(axis=1)
    at = int(np.searchsorted(held, num_layers - 1e-9))  # the first corner that holds them all
    least = float((pinned + fewest * per_layer).max())  # every rank runs at least its fewest layers
    if at == 0:
        return max(least, float(corners[0]))
    low, high = corners[at - 1], corners[at]
    below, above = held[at - 1], held[at]
    return max(least, float(low + (high - low) * (num_layers - below) / (above - below)))


def _integer_level(pinned: list[float], per_layer: float, num_layers: int) -> float:
    """The smallest M at which whole layers of ``per_layer`` each fill the ranks to ``num_layers``: rank r
    holds floor((M - pinned_r) / per_layer) of them. Starts from the fluid level (a lower bound on it)."""
    level = water_level(pinned, [per_layer] * len(pinned), num_layers)
    for _ in range(len(pinned) + 1):
        held = sum(max(0, math.floor((level - pin) / per_layer + 1e-9)) for pin in pinned)
        if held >= num_layers:
            return level
        level = min(pin + (max(0, math.floor((level - pin) / per_layer + 1e-9)) + 1) * per_layer for pin in pinned)
    return level
