"""The cost model's distinct pipeline units per candidate, shared across data-parallel sizes.

:func:`megapipe.cost.layer_costs` costs each distinct unit once (a dense and a MoE decoder layer, an MTP
block) and repeats it (:func:`megapipe.cost.layers.unit_runs`), so bounds only need the distinct units,
each with its repeat count. A unit's times
and activation bytes depend on (TP, SP, CP, micro-batch, recompute, sequence), and whether
the last stage holds the output weight on PP > 1; the data-parallel size enters only
``static_bytes`` (:func:`megapipe.cost.params.unit_static_bytes`: the distributed optimizer's
shards), which is recomputed here the same way, so every number equals the full profile's
(tests/test_plan_bounds.py). Sums over the expanded profile are taken in its order with the
built-in ``sum``, so they are the very sums of the full profile.
"""

from __future__ import annotations

from itertools import chain, repeat

from megapipe import cost
from megapipe.cost.layers import distinct_units, unit_runs
from megapipe.cost.params import unit_static_bytes
from megapipe.plan.plans import Candidate
from megapipe.records import ClusterSpec, GpuSpec, LayerCost, ModelSpec

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
        self.timed: dict[tuple, dict[str, LayerCost]] = {}
        self.priced: dict[tuple, tuple[tuple[LayerCost, ...], tuple[int, ...]]] = {}
        self.schedules: dict[tuple, object] = {}
        """Built schedules by sizes (:meth:`megapipe.plan.evaluator.Evaluator.schedule`)."""
        self.prepared: dict[tuple, object] = {}
        """Partitioned candidates (or the error) by (cluster, options, candidate, GPUs): a node count's main
        search and its fixed-depth searches partition many of the same candidates."""
        self.finished: dict[int, object] = {}
        """Simulated plans (or the error) by the id of a prepared candidate held in :attr:`prepared`."""


class UnitCosts:
    """Unit costs of one (model, cluster), costed once per layer key and GPU and priced per DP size."""

    def __init__(self, *, model: ModelSpec, cluster: ClusterSpec, shared: SharedCosts | None = None):
        self.model = model
        self.cluster = cluster
        self._runs = unit_runs(model)
        self._timed: dict[tuple, dict[str, LayerCost]] = {} if shared is None else shared.timed
        self._priced: dict[tuple, tuple[tuple[LayerCost, ...], tuple[int, ...]]] = {} if shared is None else \
            shared.priced

    def runs(self, cand: Candidate, gpu: GpuSpec) -> tuple[tuple[LayerCost, ...], tuple[int, ...]]:
        """(units, repeat counts) in profile order: embedding, decoder, [mtp], output."""
        par = cand.parallel
        key = cand.layer_key + (par.data_parallel_size, par.pipeline_model_parallel_size > 1,
                                par.use_distributed_optimizer, gpu.name)
        found = self._priced.get(key)
        if found is None:
            units = self._timed_units(cand, gpu)
            shapes = cost.shapes_of(model=self.model, parallel=par, train=cand.train)

            def static(unit: LayerCost) -> float:
                return unit_static_bytes(kind=unit.kind, params=unit.param_count, shapes=shapes, parallel=par,
                                         train=cand.train, expert_params=unit.expert_param_count)

            priced = {key: LayerCost(name=unit.name, kind=unit.kind, fwd_ms=unit.fwd_ms, bwd_ms=unit.bwd_ms,
                                     wgrad_ms=unit.wgrad_ms, static_bytes=static(unit), act_bytes=unit.act_bytes,
                                     param_count=unit.param_count, expert_param_count=unit.expert_param_count,
                                     parts=unit.parts) for key, unit in units.items()}
            found = (tuple(priced[key] for key, _ in self._runs), tuple(count for _, count in self._runs))
            self._priced[key] = found
        return found

    def layers(self, cand: Candidate, gpu: GpuSpec) -> tuple[LayerCost, ...]:
        """The profile's entries (names aside), each unit repeated by reference."""
        units, counts = self.runs(cand, gpu)
        return tuple(chain.from_iterable(map(repeat, units, counts)))

    def _timed_units(self, cand: Candidate, gpu: GpuSpec) -> dict[str, LayerCost]:
        par = cand.parallel
        key = cand.layer_key + (par.pipeline_model_parallel_size > 1, gpu.name)
        found = self._timed.get(key)
        if found is None:
            found = distinct_units(model=self.model, gpu=gpu, cluster=self.cluster, parallel=par, train=cand.train)
            self._timed[key] = found
        return found
