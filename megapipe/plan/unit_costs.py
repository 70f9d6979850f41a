"""The cost model's distinct pipeline units per candidate, shared across data-parallel sizes and feature sets.

:func:`megapipe.cost.layer_costs` costs each distinct unit once (a dense and a MoE decoder layer, an MTP
block) and repeats it (:func:`megapipe.cost.layers.unit_runs`), so bounds only need the distinct units,
each with its repeat count. A unit's times depend on the candidate's layer key (TP, SP, CP, micro-batch,
recompute, sequence, EP, ETP, the runtime features, ...) and the GPU, never on PP or DP
(:func:`megapipe.cost.layers.unit_times`); its bytes and parameters on the layer key with only the features
bytes read (:func:`megapipe.cost.layers.bytes_features`), the data-parallel size (the distributed optimizer's
shards) and whether the last stage holds the output weight on PP > 1 (:func:`megapipe.cost.layers.unit_bytes`).
Each is costed once and the two are joined per candidate, so every number equals the full profile's
(tests/test_plan_bounds.py); a search that tries a dozen feature sets at every size sizes each unit once.
Sums over the expanded profile are taken in its order with the built-in ``sum``, so they are the very sums of
the full profile.
"""

from __future__ import annotations

from itertools import chain, repeat

from megapipe.cost.layers import (UnitBytes, UnitSizes, bytes_features, unit_bytes, unit_cost, unit_device, unit_kind,
                                  unit_kinds, unit_runs, unit_sizes, unit_times)
from megapipe.cost.timing import Device, Timing
from megapipe.plan.plans import LAYER_KEY_FEATURES, Candidate
from megapipe.records import ClusterSpec, GpuSpec, LayerCost, LayerKind, ModelSpec

__all__ = ["SharedCosts", "UnitCosts", "repeated_sum"]


def repeated_sum(values, counts) -> float:
    """``sum`` over each value repeated its count, in order: the sum over the expanded sequence."""
    return sum(chain.from_iterable(map(repeat, values, counts)))


class SharedCosts:
    """Unit costs and built schedules that several searches of one job shape share (``megapipe pack``: every
    node count of one node group, and the fixed-depth baselines).

    A unit's costs read the cluster's GPU, links, NVLink domain and runtime, never its node count
    (:func:`megapipe.cost.layers.distinct_units`), so sub-clusters of one node group price every layer key
    alike; the caller shares one only between searches of the same model, batch shape and node group.
    """

    def __init__(self):
        self.timed: dict[tuple, dict[str, Timing]] = {}
        """Unit times by layer key and GPU."""
        self.sized: dict[tuple, dict[str, UnitBytes]] = {}
        """Unit bytes by bytes key, PP > 1, DP size and the distributed optimizer."""
        self.shaped: dict[tuple, UnitSizes] = {}
        """Unit parameters and activation bytes by bytes key and PP > 1."""
        self.priced: dict[tuple, tuple[tuple[LayerCost, ...], tuple[int, ...]]] = {}
        self.schedules: dict[tuple, object] = {}
        """Built schedules by sizes (:meth:`megapipe.plan.evaluator.Evaluator.schedule`)."""
        self.prepared: dict[tuple, object] = {}
        """Partitioned candidates (or the error) by (cluster, options, candidate, GPUs): a node count's main
        search and its fixed-depth searches partition many of the same candidates."""
        self.dominance: dict[tuple, tuple[int, ...]] = {}
        """Dominated positions of a group's feature sets by its sizes and feature sets (unit times and bytes keys
        only)."""
        self.finished: dict[int, object] = {}
        """Simulated plans (or the error) by the id of a prepared candidate held in :attr:`prepared`."""


class UnitCosts:
    """Unit costs of one (model, cluster), timed once per layer key and GPU and sized once per the layer key's
    bytes features (:func:`megapipe.cost.layers.bytes_features`), DP size and whether PP > 1."""

    def __init__(self, *, model: ModelSpec, cluster: ClusterSpec, shared: SharedCosts | None = None):
        self.model = model
        self.cluster = cluster
        self._runs = unit_runs(model)
        self._counts = tuple(count for _, count in self._runs)
        shared = shared or SharedCosts()
        self._timed: dict[tuple, dict[str, Timing]] = shared.timed
        self._sized: dict[tuple, dict[str, UnitBytes]] = shared.sized
        self._shaped: dict[tuple, UnitSizes] = shared.shaped
        self._priced: dict[tuple, tuple[tuple[LayerCost, ...], tuple[int, ...]]] = shared.priced
        self._kinds = unit_kinds(model)
        self._devices: dict[tuple, Device] = {}
        """:func:`~megapipe.cost.layers.unit_device` by the fields it reads: the GPU, TP, CP, tp_comm_overlap and
        sequence parallelism."""

    def runs(self, cand: Candidate, gpu: GpuSpec) -> tuple[tuple[LayerCost, ...], tuple[int, ...]]:
        """(units, repeat counts) in profile order: embedding, decoder, [mtp], output."""
        par = cand.parallel
        key = cand.layer_key + (par.data_parallel_size, par.pipeline_model_parallel_size > 1,
                                par.use_distributed_optimizer, gpu.name)
        found = self._priced.get(key)
        if found is None:
            times, sizes = self.times(cand, gpu), self._sizes(cand)
            units = {key: unit_cost(key, timing, sizes[key]) for key, timing in times.items()}
            found = self._priced[key] = (tuple(units[key] for key, _ in self._runs), self._counts)
        return found

    def layers(self, cand: Candidate, gpu: GpuSpec) -> tuple[LayerCost, ...]:
        """The profile's entries (names aside), each unit repeated by reference."""
        units, counts = self.runs(cand, gpu)
        return tuple(chain.from_iterable(map(repeat, units, counts)))

    def bytes_runs(self, cand: Candidate) -> tuple[tuple[LayerKind, float, float, int], ...]:
        """(kind, static bytes, activation bytes, repeat count) of each run of units in profile order: what memory
        bounds read, without timing a unit (the same numbers as :meth:`runs`' units)."""
        sizes = self._sizes(cand)
        return tuple((unit_kind(key), sizes[key].static_bytes, sizes[key].act_bytes, count) for key, count in self._runs)

    def time_runs(self, cand: Candidate, gpu: GpuSpec) -> tuple[tuple[Timing, ...], tuple[int, ...]]:
        """(unit times, repeat counts) in profile order, without the units' bytes: the times :meth:`runs`' units
        carry."""
        times = self.times(cand, gpu)
        return tuple(times[key] for key, _ in self._runs), self._counts

    def times(self, cand: Candidate, gpu: GpuSpec) -> dict[str, Timing]:
        """Each distinct unit's time by unit key (:func:`megapipe.cost.layers.unit_times`); it reads neither the
        pipeline nor the data-parallel size."""
        key = cand.layer_key + (gpu.name,)
        found = self._timed.get(key)
        if found is None:
            par = cand.parallel
            at = (gpu.name, par.tensor_model_parallel_size, par.context_parallel_size, par.tp_comm_overlap,
                  par.sequence_parallel)
            device = self._devices.get(at)
            if device is None:
                device = self._devices[at] = unit_device(gpu=gpu, cluster=self.cluster, parallel=par)
            found = self._timed[key] = unit_times(model=self.model, gpu=gpu, cluster=self.cluster, parallel=par,
                                                  train=cand.train, kinds=self._kinds, device=device)
        return found

    def bytes_key(self, cand: Candidate) -> tuple:
        """The layer key with its features as the units' bytes read them: candidates of one bytes key and DP size
        hold the same bytes in every unit (and have the same parameters)."""
        key = cand.layer_key
        return key[:LAYER_KEY_FEATURES] + (bytes_features(cand.parallel.features),) + key[LAYER_KEY_FEATURES + 1:]

    def _sizes(self, cand: Candidate) -> dict[str, UnitBytes]:
        par = cand.parallel
        shaped = self.bytes_key(cand) + (par.pipeline_model_parallel_size > 1,)
        key = shaped + (par.data_parallel_size, par.use_distributed_optimizer)
        found = self._sized.get(key)
        if found is None:
            sizes = self._shaped.get(shaped)
            if sizes is None:
                sizes = self._shaped[shaped] = unit_sizes(model=self.model, parallel=par, train=cand.train)
            found = self._sized[key] = unit_bytes(model=self.model, parallel=par, train=cand.train, sizes=sizes)
        return found

