"""Layer costs of one (model, cluster) scenario, cached by what they depend on.

The planner's exact evaluation and its closed-form bounds both read these: the full
profile of a candidate (:meth:`LayerCosts.profile`), the same numbers without per-layer
records for the bounds (:meth:`LayerCosts.bound_layers`, :meth:`LayerCosts.runs`), the
model FLOPs per token, and one StageSpec per pipeline rank. Caches are keyed by the
candidate's layer key (TP, SP, CP, micro-batch, recompute, sequence), DP and the GPU.
"""

from __future__ import annotations

from megapipe import cost
from megapipe.cost.layers import profile_of_units, unit_runs
from megapipe.placement import modelled_stage_specs
from megapipe.plan.plans import Candidate
from megapipe.plan.unit_costs import SharedCosts, UnitCosts
from megapipe.records import ClusterSpec, GpuSpec, LayerCost, ModelSpec, Profile, StageSpec

__all__ = ["LayerCosts"]


class LayerCosts:
    """Cost-model (or fixed, measured) layer costs of one scenario; holds its caches, nothing global."""

    def __init__(self, *, model: ModelSpec, cluster: ClusterSpec, profile: Profile | None = None,
                 shared: SharedCosts | None = None):
        """``shared``: unit costs to share with other searches of the same model on the same node group."""
        self.model = model
        self.cluster = cluster
        self.fixed_profile = profile
        """A measured profile used for every candidate instead of the cost model."""
        self._profiles: dict[tuple, Profile] = {}
        self._units: dict[tuple, tuple[LayerCost, ...]] = {}
        self._flops: dict[int, float] = {}
        self._uniform_specs: dict[int, tuple[StageSpec, ...]] = {}
        self._unit_costs = UnitCosts(model=model, cluster=cluster, shared=shared)
        self._unit_keys = tuple(key for key, _ in unit_runs(model))
        self.dominance: dict[tuple, tuple[int, ...]] = shared.dominance if shared is not None and profile is None else {}
        """Feature dominance by a group's sizes and feature sets (:func:`megapipe.plan.dominance.surviving_points`):
        it reads unit costs only, so searches that share them share it."""

    def profile(self, cand: Candidate, gpu: GpuSpec | None = None) -> Profile:
        """The candidate's per-unit costs on ``gpu`` (the cluster's first GPU by default)."""
        if self.fixed_profile is not None:
            return self.fixed_profile
        gpu = gpu or self.cluster.gpu
        key = cand.layer_key + (cand.parallel.data_parallel_size, gpu.name)
        found = self._profiles.get(key)
        if found is None:  # from the units the bounds already costed (the same numbers: tests/test_plan_bounds.py)
            units, _ = self._unit_costs.runs(cand, gpu)
            found = profile_of_units(dict(zip(self._unit_keys, units)), model=self.model, gpu=gpu,
                                     cluster=self.cluster, parallel=cand.parallel, train=cand.train)
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

    def runs(self, cand: Candidate) -> tuple[tuple[LayerCost, ...], tuple[int, ...]]:
        """(distinct units, repeat counts) in profile order on the cluster's first GPU."""
        if self.fixed_profile is not None:
            return self.fixed_profile.layers, (1,) * len(self.fixed_profile.layers)
        return self._unit_costs.runs(cand, self.cluster.gpu)

    def time_runs(self, cand: Candidate) -> tuple[tuple, tuple[int, ...]]:
        """(per distinct unit an object with fwd_ms, bwd_ms and wgrad_ms, repeat counts) in profile order on the
        cluster's first GPU, without sizing a unit (the same numbers as :meth:`runs`)."""
        if self.fixed_profile is not None:
            return self.runs(cand)
        return self._unit_costs.time_runs(cand, self.cluster.gpu)

    def bytes_runs(self, cand: Candidate) -> tuple[tuple[LayerKind, float, float, int], ...]:
        """(kind, static bytes, activation bytes, repeat count) per run of the profile, in order, without timing
        anything (a measured profile: each entry once)."""
        if self.fixed_profile is not None:
            return tuple((layer.kind, layer.static_bytes, layer.act_bytes, 1) for layer in self.fixed_profile.layers)
        return self._unit_costs.bytes_runs(cand)

    def unit_signature(self, cand: Candidate) -> tuple[tuple[float, ...], object]:
        """Each distinct unit's forward, backward and weight-gradient ms on the cluster's first GPU, flat, and a
        token for the units' bytes: candidates that differ only in their runtime features and share the token hold
        the same bytes in every unit at every PP and DP (:meth:`UnitCosts.bytes_key`)."""
        if self.fixed_profile is not None:
            return tuple(x for layer in self.fixed_profile.layers for x in (layer.fwd_ms, layer.bwd_ms,
                                                                            layer.wgrad_ms)), None
        times = self._unit_costs.times(cand, self.cluster.gpu)
        return (tuple(x for timing in times.values() for x in (timing.fwd_ms, timing.bwd_ms, timing.wgrad_ms)),
                self._unit_costs.bytes_key(cand))

    def model_flops_per_token(self, seq_length: int) -> float:
        if seq_length not in self._flops:
            self._flops[seq_length] = cost.model_flops_per_token(self.model, seq_length)
        return self._flops[seq_length]

    def stage_specs(self, cand: Candidate, gpus: tuple[GpuSpec, ...] | None = None, *,
                    layers_of=None) -> tuple[StageSpec, ...]:
        """One StageSpec per rank: memory, and time relative to the profiled GPU (1 on that GPU).

        ``layers_of(cand, gpu)`` gives the layers whose modelled times set a GPU's time scale
        (:func:`megapipe.placement.modelled_stage_specs`); the full profile by default.
        """
        pp = cand.parallel.pipeline_model_parallel_size
        overhead = self.cluster.runtime.microbatch_overhead_ms
        if gpus is None or all(gpu is self.cluster.gpu for gpu in gpus):  # all on the profiled GPU: scale 1
            found = self._uniform_specs.get(pp)
            if found is None:
                found = self._uniform_specs[pp] = modelled_stage_specs(
                    (self.cluster.gpu,) * pp, reference=self.cluster.gpu, layers_of=None,
                    microbatch_overhead_ms=overhead)
            return found
        layers_of = layers_of or (lambda c, gpu=None: self.profile(c, gpu).layers)
        return modelled_stage_specs(gpus, reference=self.cluster.gpu, layers_of=lambda gpu: layers_of(cand, gpu),
                                    microbatch_overhead_ms=overhead)
