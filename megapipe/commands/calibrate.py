"""``megapipe calibrate``: fit the cost model to measurements of the user's own cluster.

Two forms, by what the paths are:

``megapipe calibrate RUN_DIR [RUN_DIR ...]``: monitored runs (the ``megapipe-monitor/1`` logs of a run with
the training monitor attached, RUN_DIR or RUN_DIR/monitor, and its plan.yaml when it has one; without it the
config gives the model, cluster and sizes, as for ``megapipe replan``). Each run is predicted as it ran (its
layout, sizes and runtime features) and the runtime's in-training scales for its GPU's architecture (GEMM,
attention) and the per-step overhead are fitted to its per-stage forward + backward times and step time
(:mod:`megapipe.validation.monitored`), starting from the runtime in use (``runtime=``). Writes
``runtime.yaml`` (a ``hydra_conf/runtime`` file: plan, pack and validate take it as ``runtime=FILE``) and
``calibration.json``, and prints each run's error before and after.

``megapipe calibrate PROFILE [PROFILE ...]``: profiles written by ``megapipe profile`` (shapes in their meta;
the prior is the selected cluster's GPU). Fits the GPU's efficiency fields and writes
``<output dir>/calibration/<gpu>.yaml``, a Hydra overlay used as::

    megapipe plan cluster=... hydra.searchpath=[file://<output dir>] +calibration=<gpu>

(or pass the printed ``cluster.gpu.*=`` overrides), and ``calibration.json`` with the fitted values, the
error before/after and, for two or more profiles, leave-one-out cross-validation.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass

from omegaconf import DictConfig

from megapipe.commands.common import MonitoredRun, console, print_json, read_monitored_run
from megapipe.config import Scenario, runtime_of, to_scenario
from megapipe.config.options import output_options
from megapipe.cost.calibrate import FIELDS, cross_validate, fit_gpu, overlay_yaml, sample_from_profile
from megapipe.errors import ConfigError, ProfileError
from megapipe.files import atomic_write_text
from megapipe.options import OutputOptions
from megapipe.profile.format import load_profile
from megapipe.records import RuntimeSpec
from megapipe.validation.fit import RunSet
from megapipe.validation.monitored import (
    RunErrors,
    calibrate_runs,
    calibration_fields,
    field_change,
    monitored_resolved,
)
from megapipe.validation.report import runtime_yaml

__all__ = ["CalibrateInputs", "CalibrateRunsInputs", "prepare", "run", "CONFIG_KEYS"]

CONFIG_KEYS = ("input", "runtime", "model", "cluster", "parallel", "train", "schedule", "output.format", "output.dir")
"""What `megapipe calibrate --help` lists (:mod:`megapipe.config.keys`): the runtime to start from for RUN_DIRs
(model to schedule when a run has no plan.yaml), the cluster's GPU as the prior for PROFILEs."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CalibrateInputs:
    """``calibrate PROFILE ...``: the cluster whose GPU is fitted and the profiles to fit it to."""

    scenario: Scenario
    paths: tuple[str, ...]
    output: OutputOptions


@dataclass(frozen=True, slots=True, kw_only=True)
class CalibrateRunsInputs:
    """``calibrate RUN_DIR ...``: the monitored runs, read, and the runtime the fit starts from."""

    runs: tuple[MonitoredRun, ...]
    start: RuntimeSpec
    json: bool


def _inputs(cfg: DictConfig) -> list[str]:
    paths = [path for path in str(cfg.get("input") or "").split(os.pathsep) if path]
    if not paths:
        raise ConfigError("no input given; run `megapipe calibrate RUN_DIR [RUN_DIR ...]` (monitored runs) or "
                          "`megapipe calibrate PROFILE [PROFILE ...]` (megapipe profile's files)")
    kinds = {os.path.isdir(path) for path in paths}
    if len(kinds) > 1:
        raise ConfigError(f"calibrate got both run directories and files ({', '.join(paths)}); give monitored "
                          "run directories or profiles, not both")
    return paths


def _paths(cfg: DictConfig) -> list[str]:
    if not cfg.get("input"):
        raise ConfigError("no profile given; run `megapipe calibrate PROFILE [PROFILE ...]`")
    return [path for path in str(cfg.get("input")).split(os.pathsep) if path]


def prepare(cfg: DictConfig) -> CalibrateInputs | CalibrateRunsInputs:
    paths = _inputs(cfg)
    if os.path.isdir(paths[0]):
        runs = tuple(read_monitored_run(cfg, command="calibrate", run_dir=path) for path in paths)
        for item in runs:
            if not math.isfinite(item.measured.step_time_ms):
                raise ConfigError(f"the monitor log of {item.run_dir!r} has no step times; calibrate from a run "
                                  "whose monitor logged its steps (attach_monitor, log_every)")
        return CalibrateRunsInputs(runs=runs, start=runtime_of(cfg), json=output_options(cfg).json)
    scenario = to_scenario(cfg)
    return CalibrateInputs(scenario=scenario, paths=tuple(_paths(cfg)), output=output_options(cfg))


def run(job: CalibrateInputs | CalibrateRunsInputs, *, directory: str) -> None:
    if isinstance(job, CalibrateRunsInputs):
        _run_monitored(job, directory=directory)
        return
    gpu = job.scenario.cluster.gpu
    samples = []
    for path in job.paths:
        profile = load_profile(path)
        if profile.device != gpu.name:
            raise ProfileError(
                f"{path} was measured on {profile.device!r} but cluster GPU is {gpu.name!r}; "
                "pick the cluster of that GPU (cluster=...) or profile with extra.device_name set to it"
            )
        samples.append(sample_from_profile(profile, source=path))
    calibration = fit_gpu(samples=samples, gpu=gpu)
    folds = cross_validate(samples=samples, gpu=gpu) if len(samples) > 1 else ()
    overlay = os.path.join(directory, "calibration", f"{gpu.name}.yaml")
    atomic_write_text(overlay, overlay_yaml(calibration, comment=f"megapipe calibrate on {len(samples)} profile(s)"))
    result = {
        "gpu": gpu.name,
        "overlay": overlay,
        "fitted": {name: getattr(calibration.gpu, name) for name in FIELDS},
        "prior": {name: getattr(gpu, name) for name in FIELDS},
        "identified": list(calibration.identified),
        "mean_abs_rel_error_before": calibration.mean_abs_rel_error_before,
        "mean_abs_rel_error_after": calibration.mean_abs_rel_error_after,
        "cross_validation": [
            {"label": fold.label, "mean_abs_rel_error_before": fold.mean_abs_rel_error_before,
             "mean_abs_rel_error_after": fold.mean_abs_rel_error_after,
             "fitted": {name: getattr(fold.gpu, name) for name in FIELDS}}
            for fold in folds
        ],
        "overrides": [f"cluster.gpu.{name}={float(f'{getattr(calibration.gpu, name):.6g}')!r}" for name in FIELDS],
    }
    atomic_write_text(os.path.join(directory, "calibration.json"), json.dumps(result, indent=2) + "\n")
    if job.output.json:
        print_json(result)
        return
    _print(result, directory=directory)


def _print(result: dict, *, directory: str) -> None:
    from rich.table import Table

    table = Table(title=f"calibration of {result['gpu']}")
    for column in ("field", "prior", "fitted"):
        table.add_column(column, justify="left" if column == "field" else "right")
    for name, value in result["fitted"].items():
        fitted = f"{value:.4g}" if name in result["identified"] else f"{value:.4g} (not identified)"
        table.add_row(name, f"{result['prior'][name]:.4g}", fitted)
    out = console()
    out.print(table)
    out.print(
        f"mean |predicted/measured - 1|: {result['mean_abs_rel_error_before']:.1%} before, "
        f"{result['mean_abs_rel_error_after']:.1%} after"
    )
    for fold in result["cross_validation"]:
        out.print(
            f"  held out {fold['label']}: {fold['mean_abs_rel_error_before']:.1%} -> "
            f"{fold['mean_abs_rel_error_after']:.1%}"
        )
    name = os.path.splitext(os.path.basename(result["overlay"]))[0]
    out.print(f"use: hydra.searchpath=[file://{os.path.abspath(directory)}] +calibration={name}",
                  markup=False, soft_wrap=True)
    out.print("or:  " + " ".join(result["overrides"]), markup=False, soft_wrap=True)


# ---------------------------------------------------------------------- monitored runs

def _run_set(job: CalibrateRunsInputs) -> RunSet:
    resolved, clusters = [], []
    for item in job.runs:
        scenario = item.scenario
        resolved.append(monitored_resolved(
            name=item.run_dir, cluster=scenario.cluster.name, model=scenario.model, parallel=scenario.parallel,
            train=scenario.train, gpus_per_node=scenario.cluster.gpus_per_node, measured=item.measured))
        clusters.append(scenario.cluster)
    return RunSet(resolved, clusters)


def _fields(job: CalibrateRunsInputs) -> tuple[str, ...]:
    names: list[str] = []
    for item in job.runs:
        names += [name for name in calibration_fields(item.scenario.cluster.gpu.architecture) if name not in names]
    return tuple(names)


def _errors_dict(errors: RunErrors) -> dict:
    return {"predicted_step_ms": round(errors.predicted_step_ms, 6), "step_error": round(errors.step, 6),
            "stage_errors": [round(value, 6) for value in errors.stages],
            "mean_abs_stage_error": round(errors.mean_abs_stage, 6)}


def _run_monitored(job: CalibrateRunsInputs, *, directory: str) -> None:
    runs = _run_set(job)
    calibration = calibrate_runs(runs, [item.measured for item in job.runs], start=job.start, fields=_fields(job))
    fitted = dataclasses.replace(calibration.runtime, name=f"{job.start.name}_calibrated")
    changes = field_change(calibration, job.start)
    path = os.path.join(directory, "runtime.yaml")
    atomic_write_text(path, runtime_yaml(fitted, comment=(
        f"{job.start.name} calibrated by megapipe calibrate on {len(job.runs)} monitored run(s):\n"
        + "\n".join(f"  {item.run_dir}" for item in job.runs) + "\n"
        + "fitted: " + ", ".join(f"{name} {old:.4g} -> {new:.4g}" + ("" if determined else " (not determined: kept)")
                                 for name, old, new, determined in changes)
        + f"\nUse it with: megapipe plan runtime={path}")))
    result = {
        "runtime": path,
        "start": job.start.name,
        "fields": [{"name": name, "start": old, "fitted": new, "determined": determined}
                   for name, old, new, determined in changes],
        "runs": [
            {"run_dir": item.run_dir, "layout": item.measured.layout, "gpu": item.scenario.cluster.gpu.name,
             "measured_step_ms": round(item.measured.step_time_ms, 6),
             "measured_stage_compute_ms": [round(value, 6) for value in item.measured.stage_compute_ms],
             "steps": item.measured.num_steps,
             "before": _errors_dict(before), "after": _errors_dict(after)}
            for item, before, after in zip(job.runs, calibration.before, calibration.after)
        ],
    }
    atomic_write_text(os.path.join(directory, "calibration.json"), json.dumps(result, indent=2) + "\n")
    if job.json:
        print_json(result)
        return
    _print_monitored(result)


def _print_monitored(result: dict) -> None:
    from rich.table import Table

    out = console()
    table = Table(title=f"{result['start']} calibrated on {len(result['runs'])} monitored run(s)")
    for column in ("run", "layout", "measured step", "step error before", "after",
                   "stage |error| before", "after "):
        table.add_column(column, justify="left" if column in ("run", "layout") else "right")
    for item in result["runs"]:
        before, after = item["before"], item["after"]
        table.add_row(item["run_dir"], item["layout"], f"{item['measured_step_ms']:.1f} ms",
                      f"{before['step_error']:+.1%}", f"{after['step_error']:+.1%}",
                      f"{before['mean_abs_stage_error']:.1%}", f"{after['mean_abs_stage_error']:.1%}")
    out.print(table)
    for change in result["fields"]:
        note = "" if change["determined"] else "  (these runs do not determine it: kept)"
        out.print(f"  {change['name']}: {change['start']:.4g} -> {change['fitted']:.4g}{note}", markup=False)
    out.print(f"runtime file: {result['runtime']}", markup=False, soft_wrap=True)
    out.print(f"use: megapipe plan runtime={result['runtime']}  (pack and validate take it too)", markup=False,
              soft_wrap=True)
