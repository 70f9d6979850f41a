"""Monitored runs of the user's own cluster, predicted as they ran and fitted: ``megapipe calibrate RUN_DIR``.

A monitored run (:class:`~megapipe.plan.replan.MeasuredRun`: each layout stage's forward and backward per
microbatch, the mean step) is predicted by the validation's predictor with its own layout, sizes and runtime
features. The fit moves the runtime's in-training scales for the run GPU's architecture (GEMM, attention)
and the per-step overhead so that the predicted stage times and step times match: log errors, each run's
stages together weighing as much as its step, by Levenberg-Marquardt in log coordinates
(:func:`megapipe.validation.fit.fit_residual`). What the runs cannot tell apart (attention from GEMMs when
every stage mixes them alike) keeps its starting value: the fit steps only along the directions the runs
determine. Pure: records in, records out.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from megapipe.plan.replan import MeasuredRun
from megapipe.records import ModelSpec, ParallelSpec, RuntimeSpec, TrainSpec
from megapipe.validation.fit import RunSet, field_value, fit_residual
from megapipe.validation.predict import Resolved
from megapipe.validation.runs import PublishedRun

__all__ = ["RunErrors", "RunCalibration", "calibration_fields", "monitored_resolved", "run_errors", "calibrate_runs",
           "field_change"]


def calibration_fields(architecture: str) -> tuple[str, ...]:
    """What a monitored run fits: its GPU generation's GEMM and attention scales, and the per-step overhead."""
    return (f"gemm_efficiency_scale.{architecture}", f"attention_efficiency_scale.{architecture}", "step_overhead_ms")


@dataclass(frozen=True, slots=True, kw_only=True)
class RunErrors:
    """One run's predicted over measured, minus 1: the step, and each layout stage's forward + backward."""

    predicted_step_ms: float
    step: float
    stages: tuple[float, ...]

    @property
    def mean_abs_stage(self) -> float:
        return math.fsum(abs(error) for error in self.stages) / len(self.stages)


@dataclass(frozen=True, slots=True, kw_only=True)
class RunCalibration:
    runtime: RuntimeSpec
    """The start with the fitted fields set."""
    fields: tuple[str, ...]
    identified: tuple[str, ...]
    """Fields the runs determine; the others kept their starting value."""
    before: tuple[RunErrors, ...]
    """Each run's errors with the starting runtime."""
    after: tuple[RunErrors, ...]


def monitored_resolved(*, name: str, cluster: str, model: ModelSpec, parallel: ParallelSpec, train: TrainSpec,
                       gpus_per_node: int, measured: MeasuredRun) -> Resolved:
    """A monitored run as the validation's predictor takes it: every setting stated, the run's own layout."""
    run = PublishedRun(
        id=name, set="monitored", source=name, framework="megatron-core", cluster=cluster,
        num_gpus=parallel.world_size, gpus_per_node=min(gpus_per_node, parallel.world_size), model=model,
        parallel=parallel, train=train, unknown=(), step_time_s=measured.step_time_ms / 1e3,
        how="megapipe-monitor/1: mean step time of the logged steps after warm-up")
    return Resolved(run=run, parallel=parallel, train=train, layout=measured.layout)


def _errors(runs: RunSet, index: int, runtime: RuntimeSpec, measured: MeasuredRun) -> RunErrors:
    step_s, stage_ms = runs.times(index, runtime)
    return RunErrors(predicted_step_ms=step_s * 1e3, step=step_s * 1e3 / measured.step_time_ms - 1.0,
                     stages=tuple(p / m - 1.0 for p, m in zip(stage_ms, measured.stage_compute_ms)))


def run_errors(runs: RunSet, runtime: RuntimeSpec, measured: Sequence[MeasuredRun]) -> tuple[RunErrors, ...]:
    return tuple(_errors(runs, index, runtime, item) for index, item in enumerate(measured))


def _residual(runs: RunSet, measured: Sequence[MeasuredRun]):
    logs = [(np.log(np.asarray(item.stage_compute_ms, dtype=float)), math.log(item.step_time_ms / 1e3))
            for item in measured]

    def residual(runtime: RuntimeSpec) -> np.ndarray:
        parts = []
        for index, (stage_log, step_log) in enumerate(logs):
            step_s, stage_ms = runs.times(index, runtime)
            parts.append((np.log(np.asarray(stage_ms, dtype=float)) - stage_log) / math.sqrt(len(stage_log)))
            parts.append(np.array([math.log(step_s) - step_log]))
        return np.concatenate(parts)

    return residual


def calibrate_runs(runs: RunSet, measured: Sequence[MeasuredRun], *, start: RuntimeSpec,
                   fields: Sequence[str]) -> RunCalibration:
    """``start`` with ``fields`` fitted to the runs' stage and step times (``runs``: one resolved run each)."""
    if len(runs) != len(measured):
        raise ValueError("one measured run per resolved run")
    fitted = fit_residual(_residual(runs, measured), start=start, fields=fields)
    return RunCalibration(runtime=fitted.runtime, fields=tuple(fields), identified=fitted.identified,
                          before=run_errors(runs, start, measured), after=run_errors(runs, fitted.runtime, measured))


def field_change(calibration: RunCalibration, start: RuntimeSpec) -> tuple[tuple[str, float, float, bool], ...]:
    """(field, start value, fitted value, determined) of each fitted field: determined when the runs fix it,
    or moved it (an overhead the runs drive to its floor of 0 no longer acts, so it is no longer identified)."""
    out = []
    for name in calibration.fields:
        old, new = field_value(start, name), field_value(calibration.runtime, name)
        moved = abs(math.log(max(new, 1e-300) / max(old, 1e-300))) > 0.01
        out.append((name, old, new, name in calibration.identified or moved))
    return tuple(out)
