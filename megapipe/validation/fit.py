"""Fit the runtime's fields to measured runs, and leave-one-out: predicted against measured step times.

The model's kernels come from microbenchmarks (the cluster files); what training adds to them is a
:class:`~megapipe.records.RuntimeSpec`: in-training scales on the GEMM, attention and collective
efficiencies, and the framework's time per microbatch and per step. :func:`fit_runtime` picks the
fields that minimise the squared log error of step time over the runs (log, so a 1 s and a 100 s
step weigh alike) by Levenberg-Marquardt (:mod:`megapipe.least_squares`) in log coordinates, so
scales and overheads stay positive. :func:`leave_one_out` refits without each run in turn and
predicts it. :func:`leave_one_source_out` refits without every run of one source (a table, paper or
write-up) and predicts those runs: what a new source can expect, since runs of one source share their
software, cluster and way of measuring, so a run left out while the rest of its source stays in says
little about a source the fit has never seen. Pure: records in, records out.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from megapipe.errors import ConfigError
from megapipe.least_squares import identified, jacobian, kept_directions, levenberg_marquardt
from megapipe.plan.plans import Plan
from megapipe.records import ClusterSpec, RuntimeSpec
from megapipe.plan.evaluator import step_seconds
from megapipe.validation.predict import Resolved, predict, predict_step_parts, predict_times, run_cluster

__all__ = ["FIT_FIELDS", "DEFAULT_FIT", "MOE_FIT", "with_values", "field_value", "RunSet", "Fitted", "Stage",
           "fit_stages", "fit_residual", "fit_runtime", "leave_one_out", "leave_one_source_out", "source_of", "stages_of", "staged_leave_one_out"]

_TABLES = {"gemm_efficiency_scale": "gemm_efficiency_by_architecture",
           "attention_efficiency_scale": "attention_efficiency_by_architecture",
           "host_kernel_us": "host_kernel_us_by_cpu"}
FIT_FIELDS = ("gemm_efficiency_scale.ampere", "gemm_efficiency_scale.hopper", "gemm_efficiency_scale.blackwell",
              "attention_efficiency_scale.ampere", "attention_efficiency_scale.hopper",
              "attention_efficiency_scale.blackwell", "gemm_efficiency_scale", "attention_efficiency_scale",
              "comm_efficiency_scale", "microbatch_overhead_ms", "step_overhead_ms", "host_kernel_us", "host_kernel_us.grace", "host_sync_us",
              "moe_dropless_imbalance")
"""What can be fitted: ``<scale>.<architecture>`` is that generation's entry of the runtime's per-architecture
table (RuntimeSpec.gemm_efficiency_by_architecture, attention_efficiency_by_architecture)."""
DEFAULT_FIT = ("gemm_efficiency_scale.ampere", "gemm_efficiency_scale.hopper", "gemm_efficiency_scale.blackwell",
               "attention_efficiency_scale.hopper", "attention_efficiency_scale.blackwell", "step_overhead_ms")
"""What `megapipe validate` fits: per generation, GEMMs and attention in training against their microbenchmarks
(A100 runs spend ~2% in attention, too little to fix its scale), and the per-step overhead. The collectives keep
nccl-tests' measured bus bandwidth (scale 1), and the per-microbatch overhead stays 0: the public runs do not
determine it (a fit puts it at 0)."""
MOE_FIT = ("host_kernel_us", "host_kernel_us.grace", "moe_dropless_imbalance")
"""What the MoE runs fit, with the kernels' scales fixed by the dense runs: the host's time per launched kernel
(which only a MoE layer's token-count sync exposes) and dropless routing's imbalance. Fitting the kernels' scales
on MoE runs too would let whatever a MoE layer's model misses bend the constants every dense plan uses."""
_OVERHEAD_START = {"microbatch_overhead_ms": 1.0, "step_overhead_ms": 10.0, "host_kernel_us": 20.0, "host_sync_us": 20.0,
                   "moe_dropless_imbalance": 1.3}
"""Where a zero overhead starts its fit (log coordinates cannot start at 0)."""
_STEP = 1e-3
"""Finite-difference step in log coordinates: 0.1%, wide enough to see past the model's max() kinks."""


class RunSet:
    """Resolved runs and their clusters; predicts every run's step time for a runtime (schedules cached)."""

    def __init__(self, resolved: Sequence[Resolved], clusters: Sequence[ClusterSpec]):
        if len(resolved) != len(clusters):
            raise ValueError("one cluster per resolved run")
        self.resolved = tuple(resolved)
        self.clusters = tuple(clusters)
        self._schedules: list[dict] = [{} for _ in self.resolved]
        self._parts: list[dict] = [{} for _ in self.resolved]
        """Per run: its step before the per-step overhead, by the runtime as the run reads it (:func:`seen_by`)."""
        self._splits: list[tuple | None] = [None] * len(self.resolved)
        """Per run: its split, where it does not depend on the layer times (priced without partitioning again)."""

    def __len__(self) -> int:
        return len(self.resolved)

    def __getstate__(self) -> dict:
        """What a pool's worker receives: the built schedules stay behind (megabytes of lowered programs the worker
        finds again in its own schedule cache); the runs, their fixed splits and their prices travel."""
        return {**self.__dict__, "_schedules": [{} for _ in self.resolved]}

    def plan(self, index: int, runtime: RuntimeSpec) -> Plan:
        run = self.resolved[index]
        cluster = run_cluster(run.run, self.clusters[index], runtime)
        return predict(run, cluster, schedules=self._schedules[index])

    def step_time_s(self, index: int, runtime: RuntimeSpec) -> float:
        """The run's predicted step, priced once per runtime as the run reads it: a fit that moves another
        generation's scale, or only the per-step overhead, finds it already priced (the same seconds)."""
        run = self.resolved[index]
        cluster = run_cluster(run.run, self.clusters[index], runtime)
        seen = seen_by(runtime, cluster, moe=run.run.model.is_moe)
        parts = self._parts[index].get(seen)
        if parts is None:
            parts, self._splits[index] = predict_step_parts(run, dataclasses.replace(cluster, runtime=seen),
                                                            schedules=self._schedules[index], split=self._splits[index])
            self._parts[index][seen] = parts
        return step_seconds(parts, runtime.step_overhead_ms)

    def times(self, index: int, runtime: RuntimeSpec) -> tuple[float, tuple[float, ...]]:
        """(step time s, each layout stage's forward + backward per microbatch ms)."""
        run = self.resolved[index]
        return predict_times(run, run_cluster(run.run, self.clusters[index], runtime), schedules=self._schedules[index])

    def step_times(self, runtime: RuntimeSpec, indices: Sequence[int]) -> np.ndarray:
        return np.array([self.step_time_s(index, runtime) for index in indices])

    def measured(self, indices: Sequence[int]) -> np.ndarray:
        return np.array([self.resolved[index].run.step_time_s for index in indices])


def seen_by(runtime: RuntimeSpec, cluster: ClusterSpec, *, moe: bool) -> RuntimeSpec:
    """``runtime`` as a run on ``cluster`` (one GPU type) reads it, less its per-step overhead: its generation's
    GEMM and attention scales and its host CPU's kernel cost in place of the tables, no step-time intervals, and a
    dense model's MoE imbalance at 1 (only MoE layers read it). The cost model reads the scales only through
    ``RuntimeSpec.gemm_scale``, ``attention_scale`` and ``host_kernel``, so a prediction on this runtime is the
    one on ``runtime`` without its step overhead (tests/test_validation.py compares them)."""
    architecture = cluster.gpu.architecture
    return dataclasses.replace(
        runtime, gemm_efficiency_scale=runtime.gemm_scale(architecture), gemm_efficiency_by_architecture=(),
        attention_efficiency_scale=runtime.attention_scale(architecture), attention_efficiency_by_architecture=(),
        host_kernel_us=runtime.host_kernel(cluster.host_cpu), host_kernel_us_by_cpu=(), step_time_intervals=(),
        step_overhead_ms=0.0, moe_dropless_imbalance=runtime.moe_dropless_imbalance if moe else 1.0)


@dataclass(frozen=True, slots=True, kw_only=True)
class Fitted:
    runtime: RuntimeSpec
    identified: tuple[str, ...]
    """Fields the runs determine; the others keep their starting value."""
    rms_log_error: float
    iterations: int


def _known(name: str) -> bool:
    """A FIT_FIELDS name, or ``<scale>.<architecture>`` / ``host_kernel_us.<cpu>`` of a generation they lack."""
    scale, _, key = name.partition(".")
    return name in FIT_FIELDS or (bool(key) and scale in _TABLES)


def field_value(runtime: RuntimeSpec, name: str) -> float:
    """The value of a fit field (FIT_FIELDS spelling) in ``runtime``."""
    scale, _, architecture = name.partition(".")
    if architecture:
        return dict(getattr(runtime, _TABLES[scale])).get(architecture, getattr(runtime, scale))
    return getattr(runtime, name)


def _start(runtime: RuntimeSpec, name: str) -> float:
    """Where a field starts its fit: its value, or off the kinks where it does not act yet (an overhead of 0, an
    imbalance of exactly 1, a host cost the GPU still hides), which a finite difference would read as no effect."""
    value = field_value(runtime, name)
    if name.partition(".")[0] in ("host_kernel_us", "moe_dropless_imbalance"):  # they act only past a kink
        return max(value, _OVERHEAD_START[name.partition(".")[0]])
    if name in _OVERHEAD_START and not value:
        return _OVERHEAD_START[name]
    return value


_KINKED_GRID = (0.5, 1.0, 2.0, 4.0)
"""Multiples of a kinked field's start tried before the local fit: a host cost acts only once it exceeds the
GPU's work, so where it starts hidden its finite difference is 0 and Levenberg-Marquardt would never move it."""


_IMBALANCE_GRID = (1.05, 1.25, 1.5, 2.0)
"""Dropless imbalances tried before the local fit (below 1 the random-routing spread takes over: no effect)."""


def _coarse_start(residual, start: RuntimeSpec, fields: Sequence[str]) -> np.ndarray:
    """The start with each kinked field (host costs, dropless imbalance) set to the best of a coarse grid."""
    theta = _to_free(start, fields)
    for position, name in enumerate(fields):
        if name.partition(".")[0] not in ("host_kernel_us", "moe_dropless_imbalance"):
            continue
        best, best_cost = theta[position], None
        grid = ([np.log(value) for value in _IMBALANCE_GRID] if name == "moe_dropless_imbalance"
                else [theta[position] + np.log(factor) for factor in _KINKED_GRID])
        for value in grid:
            trial = theta.copy()
            trial[position] = value
            error = residual(trial)
            cost = float(error @ error)
            if best_cost is None or cost < best_cost:
                best, best_cost = trial[position], cost
        theta[position] = best
    return theta


def _to_free(runtime: RuntimeSpec, fields: Sequence[str]) -> np.ndarray:
    values = [_start(runtime, name) for name in fields]
    return np.log(np.asarray(values, dtype=float))


def with_values(runtime: RuntimeSpec, values: dict[str, float]) -> RuntimeSpec:
    """``runtime`` with the named fields (FIT_FIELDS spelling) set."""
    plain = {name: value for name, value in values.items() if "." not in name}
    tables = {table: dict(getattr(runtime, table)) for table in _TABLES.values()}
    for name, value in values.items():
        scale, _, architecture = name.partition(".")
        if architecture:
            tables[_TABLES[scale]][architecture] = value
    return dataclasses.replace(runtime, **plain, **{table: tuple(pairs.items()) for table, pairs in tables.items()})


def _from_free(runtime: RuntimeSpec, fields: Sequence[str], theta: np.ndarray) -> RuntimeSpec:
    return with_values(runtime, {name: float(math.exp(value)) for name, value in zip(fields, theta)})


def _residual(runs: RunSet, start: RuntimeSpec, fields: Sequence[str], indices: Sequence[int]
              ) -> Callable[[np.ndarray], np.ndarray]:
    measured = np.log(runs.measured(indices))

    def residual(theta: np.ndarray) -> np.ndarray:
        return np.log(runs.step_times(_from_free(start, fields, theta), indices)) - measured

    return residual


@dataclass(frozen=True, slots=True, kw_only=True)
class Stage:
    """One step of the fit: these fields, fitted on these runs, the earlier stages' fields held."""

    name: str
    fields: tuple[str, ...]
    indices: tuple[int, ...]


def stages_of(resolved: Sequence[Resolved], *, dense: Sequence[str] = DEFAULT_FIT,
              moe: Sequence[str] = MOE_FIT) -> tuple[Stage, ...]:
    """The kernels' scales on the dense runs, then the MoE fields on the MoE runs (fitted runs only)."""
    fitted = fit_indices(resolved)
    return (Stage(name="dense", fields=tuple(dense),
                  indices=tuple(i for i in fitted if not resolved[i].run.model.is_moe)),
            Stage(name="moe", fields=tuple(moe), indices=tuple(i for i in fitted if resolved[i].run.model.is_moe)))


def fit_stages(runs: RunSet, *, start: RuntimeSpec, stages: Sequence[Stage], max_iter: int = 30,
               neutral: RuntimeSpec | None = None) -> RuntimeSpec:
    """Each stage fitted in turn from ``start``; with ``neutral``, fields a stage's runs do not determine take
    its value (a held-out fold must not keep what the left-out runs fixed)."""
    runtime = start
    for stage in stages:
        if not stage.fields or len(stage.indices) < len(stage.fields):
            if neutral is not None:
                runtime = with_values(runtime, {name: field_value(neutral, name) for name in stage.fields})
            continue
        result = fit_runtime(runs, start=runtime, fields=stage.fields, indices=stage.indices, max_iter=max_iter)
        runtime = result.runtime
        if neutral is not None:
            unfixed = {name: field_value(neutral, name) for name in stage.fields if name not in result.identified}
            runtime = with_values(runtime, unfixed) if unfixed else runtime
    return runtime


def staged_leave_one_out(runs: RunSet, *, start: RuntimeSpec, stages: Sequence[Stage], mapper: Callable = map
                         ) -> tuple[float, ...]:
    """Leave-one-run-out over the stages: a run is refitted out of its own stage (a dense run's prediction does
    not read the MoE fields, and a MoE run is in the last stage), the rest predicted with ``start``."""
    out = [runs.step_time_s(index, start) for index in range(len(runs))]
    for stage in stages:
        if not stage.fields or len(stage.indices) <= len(stage.fields):
            continue
        held = leave_one_out(runs, start=start, fields=stage.fields, mapper=mapper, indices=stage.indices)
        for index in stage.indices:
            out[index] = held[index]
    return tuple(out)


def fit_indices(resolved: Sequence[Resolved]) -> tuple[int, ...]:
    """The runs the runtime constants are fitted on: all but those marked validation-only (``fit: false``) and
    those of models with features megapipe does not model (``ModelSpec.not_modelled``)."""
    return tuple(index for index, item in enumerate(resolved) if item.run.fit and not item.run.model.not_modelled)


def fit_residual(residual_of: Callable[[RuntimeSpec], np.ndarray], *, start: RuntimeSpec, fields: Sequence[str],
                 max_iter: int = 30, identify: bool = True) -> Fitted:
    """``start`` with ``fields`` set to minimise ``|residual_of(runtime)|^2`` (log errors of whatever was measured)."""
    unknown = [name for name in fields if not _known(name)]
    if unknown:
        raise ConfigError(f"cannot fit {unknown}; fit a subset of {list(FIT_FIELDS)}")

    def residual(theta: np.ndarray) -> np.ndarray:
        return residual_of(_from_free(start, fields, theta))

    theta, iterations = levenberg_marquardt(residual, _coarse_start(residual, start, fields), max_iter=max_iter,
                                            step=_STEP, tolerance=1e-6)
    final = residual(theta)
    determined = identified(jacobian(residual, theta, final, step=_STEP), fields) if identify else tuple(fields)
    return Fitted(runtime=_from_free(start, fields, theta), identified=tuple(determined),
                  rms_log_error=float(np.sqrt(np.mean(final**2))), iterations=iterations)


def fit_runtime(runs: RunSet, *, start: RuntimeSpec = RuntimeSpec(), fields: Sequence[str] = DEFAULT_FIT,
                indices: Sequence[int] | None = None, max_iter: int = 30, identify: bool = True) -> Fitted:
    """The runtime that best predicts the step times of the runs at ``indices`` (all by default), from ``start``."""
    indices = tuple(range(len(runs))) if indices is None else tuple(indices)
    if len(indices) < len(fields):
        raise ConfigError(f"{len(indices)} runs cannot fix {len(fields)} fields; give at least as many runs")
    measured = np.log(runs.measured(indices))
    return fit_residual(lambda runtime: np.log(runs.step_times(runtime, indices)) - measured, start=start,
                        fields=fields, max_iter=max_iter, identify=identify)


def leave_one_out(runs: RunSet, *, start: RuntimeSpec, fields: Sequence[str] = DEFAULT_FIT, max_iter: int = 0,
                  mapper: Callable = map, indices: Sequence[int] | None = None) -> tuple[float, ...]:
    """Each run's predicted step time (s) with the runtime refitted without it.

    ``indices``: the runs the fit uses (all by default); a run outside them is never fitted on, so its
    held-out prediction is the one with ``start``. ``start`` is the fit on those runs. Each fold moves it by one
    Gauss-Newton step without the held-out run (the full fit's Jacobian with that row deleted: the fold's optimum
    to first order, exact for a fit linear in its log-parameters), then, with ``max_iter``, refits on the other
    runs by Levenberg-Marquardt. ``mapper`` runs the folds (``map``, or a process pool's).
    """
    everyone = tuple(range(len(runs)) if indices is None else indices)
    residual = _residual(runs, start, fields, everyone)
    theta = _to_free(start, fields)
    base = residual(theta)
    full = jacobian(residual, theta, base, step=_STEP)
    folds = [_Fold(index=index, rows=everyone, start=start, fields=tuple(fields), theta=theta, base=base,
                   jacobian=full, max_iter=max_iter) for index in everyone]
    held_out = dict(zip(everyone, mapper(functools.partial(_fold_prediction, runs), folds)))
    return tuple(held_out[index] if index in held_out else runs.step_time_s(index, start)
                 for index in range(len(runs)))


@dataclass(frozen=True, slots=True)
class _Fold:
    index: int
    rows: tuple[int, ...]
    """The fitted runs, in the Jacobian's row order."""
    start: RuntimeSpec
    fields: tuple[str, ...]
    theta: np.ndarray
    base: np.ndarray
    jacobian: np.ndarray
    max_iter: int


def _fold_prediction(runs: RunSet, fold: _Fold) -> float:
    rest = [other for other in fold.rows if other != fold.index]
    kept = [row for row, other in enumerate(fold.rows) if other != fold.index]
    u, singular, vt = kept_directions(fold.jacobian[kept])
    shift = -vt.T @ ((u.T @ fold.base[kept]) / singular) if singular.size else np.zeros_like(fold.theta)
    fitted = _from_free(fold.start, fold.fields, fold.theta + shift)
    if fold.max_iter:
        fitted = fit_runtime(runs, start=fitted, fields=fold.fields, indices=rest, max_iter=fold.max_iter).runtime
    return runs.step_time_s(fold.index, fitted)


def source_of(resolved: Resolved) -> str:
    """The source a run comes from: its ``set`` (one table, paper or write-up), or its id when it has none."""
    return resolved.run.set or resolved.run.id


def leave_one_source_out(runs: RunSet, *, start: RuntimeSpec, stages: Sequence[Stage],
                         neutral: RuntimeSpec = RuntimeSpec(), max_iter: int = 2, mapper: Callable = map
                         ) -> tuple[float, ...]:
    """Each run's predicted step time (s) with the runtime refitted without every run of its source.

    ``start`` is the fit on every run. A fold refits every stage that held one of the source's runs: one
    Gauss-Newton step from ``start`` on the stage's Jacobian without the source's rows, then ``max_iter``
    Levenberg-Marquardt iterations on the stage's other runs. A field those rows cannot determine takes its
    ``neutral`` value (the microbenchmarks' 1.0, no overhead), never the value the left-out source helped fix. A
    MoE stage is refitted after a dense one only for a source with MoE runs (dense predictions do not read it).
    """
    sources = [source_of(item) for item in runs.resolved]
    jacobians = {}
    for stage in stages:
        if stage.fields and len(stage.indices) > len(stage.fields):
            residual = _residual(runs, start, stage.fields, stage.indices)
            theta = _to_free(start, stage.fields)
            base = residual(theta)
            jacobians[stage.name] = (theta, base, jacobian(residual, theta, base, step=_STEP))
    folds = []
    for source in sorted(set(sources)):
        targets = tuple(i for i, name in enumerate(sources) if name == source)
        left = frozenset(targets)
        moe_targets = any(runs.resolved[i].run.model.is_moe for i in targets)
        kept, changed = [], False
        for stage in stages:
            changed = changed or bool(left & set(stage.indices))
            changed = changed and (stage.name != "moe" or moe_targets)  # MoE fields move MoE runs only
            if changed:
                kept.append(Stage(name=stage.name, fields=stage.fields,
                                  indices=tuple(i for i in stage.indices if i not in left)))
        folds.append(_SourceFold(source=source, targets=targets, start=start, neutral=neutral, stages=tuple(kept),
                                 full=tuple(stages), jacobians=jacobians, max_iter=max_iter))
    predicted: dict[int, float] = {}
    for fold, times in zip(folds, mapper(functools.partial(_source_fold_prediction, runs), folds)):
        predicted.update(zip(fold.targets, times))
    return tuple(predicted[index] for index in range(len(runs)))


@dataclass(frozen=True, slots=True)
class _SourceFold:
    source: str
    targets: tuple[int, ...]
    """The source's runs, fitted or not."""
    start: RuntimeSpec
    neutral: RuntimeSpec
    stages: tuple[Stage, ...]
    """The stages to refit, the source's runs removed."""
    full: tuple[Stage, ...]
    jacobians: dict
    """Per stage name: (theta, residual, Jacobian) at ``start`` over the stage's runs."""
    max_iter: int


def _source_fold_prediction(runs: RunSet, fold: _SourceFold) -> tuple[float, ...]:
    runtime = fold.start
    full = {stage.name: stage for stage in fold.full}
    for stage in fold.stages:
        if len(stage.indices) < len(stage.fields) or stage.name not in fold.jacobians:
            runtime = with_values(runtime, {name: field_value(fold.neutral, name) for name in stage.fields})
            continue
        theta, base, matrix = fold.jacobians[stage.name]
        rows = [row for row, index in enumerate(full[stage.name].indices) if index in set(stage.indices)]
        u, singular, vt = kept_directions(matrix[rows])
        shift = -vt.T @ ((u.T @ base[rows]) / singular) if singular.size else np.zeros_like(theta)
        stage_start = _from_free(runtime, stage.fields, _to_free(fold.start, stage.fields) + shift)
        determined = identified(matrix[rows], stage.fields)
        if fold.max_iter:
            stage_start = fit_runtime(runs, start=stage_start, fields=stage.fields, indices=stage.indices,
                                      max_iter=fold.max_iter, identify=False).runtime
        unfixed = {name: field_value(fold.neutral, name) for name in stage.fields if name not in determined}
        runtime = with_values(stage_start, unfixed) if unfixed else stage_start
    return tuple(runs.step_time_s(index, runtime) for index in fold.targets)
