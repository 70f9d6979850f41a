"""``megapipe replan RUN_DIR``: a better layout from a monitored run's measurements.

    megapipe replan outputs/run1                      # RUN_DIR holds plan.yaml, profile.yaml, rank-*.jsonl
    megapipe replan outputs/run1 profile=old.yaml model=tiny_gpt cluster=cpu_gloo \
        parallel.tensor_model_parallel_size=1 parallel.pipeline_model_parallel_size=2 train.num_microbatches=4

Reads the run's ``megapipe-monitor/1`` logs (RUN_DIR or RUN_DIR/monitor), the profile the
run was planned with (``profile=FILE``, else RUN_DIR/profile.yaml) and, when present,
RUN_DIR/plan.yaml (model, cluster, parallel sizes, schedule and micro-batches of the run;
without it they come from the config, pipeline sizes and micro-batches from the log).
Attributes each stage's measured time to its layers (:mod:`megapipe.replan`), writes the
corrected profile (``profile.yaml``) and ``replan.yaml`` into the output directory, solves
again and prints the new layout, the predicted gain and the overrides to apply, or why
the current layout stays (gain below ``search.min_gain``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import yaml
from omegaconf import DictConfig, OmegaConf

from megapipe.config import Setup, to_setup
from megapipe.errors import ConfigError
from megapipe.profile.format import Profile, atomic_write_text
from megapipe.profile.match import match_profile
from megapipe.schedules import megatron_schedule
from megapipe.replan import ATTRIBUTIONS, MeasuredRun, Replan, measured_run, replan
from megapipe.stages import stage_specs

__all__ = ["run", "precheck", "result_dict"]


def precheck(cfg: DictConfig) -> None:
    """Before Hydra runs: a run directory is given (the rest depends on its files)."""
    _run_dir(cfg)


def _run_dir(cfg: DictConfig) -> str:
    path = cfg.get("input")
    if not path:
        raise ConfigError("replan needs the monitored run's directory: megapipe replan RUN_DIR [key=value ...]")
    if not os.path.isdir(str(path)):
        raise ConfigError(f"run directory {str(path)!r} does not exist; pass the directory the monitor logged into")
    return str(path)


def _load_plan(run_dir: str) -> dict | None:
    path = os.path.join(run_dir, "plan.yaml")
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as handle:
        try:
            document = yaml.safe_load(handle)
        except yaml.YAMLError:
            raise ConfigError(f"{path} is not valid YAML; restore the plan.yaml `megapipe plan` wrote") from None
    if not isinstance(document, dict) or document.get("format") != "megapipe-plan/1" or "best" not in document:
        raise ConfigError(f"{path} is not a megapipe-plan/1 document; restore the plan.yaml `megapipe plan` wrote")
    return document


def _plan_setup(plan: dict) -> Setup:
    """The planned run's setup: the plan's resolved inputs with its best plan's sizes filled in."""
    inputs = OmegaConf.create(plan.get("inputs") or {})
    OmegaConf.set_struct(inputs, False)
    best = plan["best"]
    for key, value in best["parallel"].items():
        if key != "data_parallel_size":
            inputs.parallel[key] = value
    for key in ("micro_batch_size", "global_batch_size", "seq_length", "recompute_granularity", "num_microbatches"):
        inputs.train[key] = best["train"][key]
    inputs.schedule = {"name": best["schedule"]}
    return to_setup(inputs)


def _config_setup(cfg: DictConfig, measured: MeasuredRun) -> Setup:
    """No plan.yaml: the config, with pipeline sizes and micro-batches the user left null taken from the log."""
    probe = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    OmegaConf.set_struct(probe, False)
    stages = len(measured.stage_forward_ms)
    if probe.parallel.get("pipeline_model_parallel_size") is None:
        probe.parallel.pipeline_model_parallel_size = measured.pipeline_model_parallel_size
    if probe.parallel.get("virtual_pipeline_model_parallel_size") is None:
        probe.parallel.virtual_pipeline_model_parallel_size = stages // measured.pipeline_model_parallel_size
    from_log = probe.train.get("num_microbatches") is None and bool(measured.num_microbatches)
    if from_log:
        probe.train.num_microbatches = measured.num_microbatches
    if probe.schedule.get("name") is None:
        probe.schedule.name = str(megatron_schedule(stages // measured.pipeline_model_parallel_size))
    setup = to_setup(probe)
    if from_log:  # the emitted global batch must agree with the run's micro-batches
        batch = setup.num_microbatches * setup.train.micro_batch_size * setup.parallel.data_parallel_size
        setup = dataclasses.replace(setup, train=dataclasses.replace(setup.train, global_batch_size=batch))
    return setup


def _profile(cfg: DictConfig, run_dir: str, setup: Setup) -> Profile:
    path = cfg.get("profile") or os.path.join(run_dir, "profile.yaml")
    if not os.path.isfile(path):
        raise ConfigError(f"no profile at {path!r}: pass the profile the run was planned with (profile=FILE)")
    return match_profile(Profile.load(path), model=setup.model)


def _check_sizes(setup: Setup, measured: MeasuredRun, plan: dict | None) -> None:
    par = setup.parallel
    if plan is not None and plan["best"].get("layout") and plan["best"]["layout"] != measured.layout:
        raise ConfigError(f"the monitor log is from layout {measured.layout!r} but plan.yaml planned "
                          f"{plan['best']['layout']!r}; replan the run that used the planned layout")
    stages = par.pipeline_model_parallel_size * par.virtual_pipeline_model_parallel_size
    stages_measured = len(measured.stage_forward_ms)
    if measured.pipeline_model_parallel_size != par.pipeline_model_parallel_size or stages_measured != stages:
        raise ConfigError(
            f"the monitor log has {stages_measured} stages on {measured.pipeline_model_parallel_size} "
            f"pipeline ranks but the config has pipeline_model_parallel_size={par.pipeline_model_parallel_size} x "
            f"virtual_pipeline_model_parallel_size={par.virtual_pipeline_model_parallel_size}; set them to the run's"
        )


def result_dict(setup: Setup, measured: MeasuredRun, result: Replan, *, directory: str) -> dict:
    from megapipe.emit import emit

    out = {
        "run_layout": measured.layout,
        "measured_step_time_ms": round(measured.step_time_ms, 6) if math.isfinite(measured.step_time_ms) else None,
        "measured_stage_compute_ms": [round(t, 6) for t in measured.stage_compute_ms],
        "measured_compute_spread_ms": round(measured.compute_spread_ms, 6),
        "schedule": setup.schedule,
        "num_microbatches": setup.num_microbatches,
        "old_layout": result.old.layout,
        "old_stage_time_ms": [round(t, 6) for t in result.old.stage_time_ms],
        "old_step_time_ms": round(result.old_step_ms, 6),
        "new_layout": result.new.layout,
        "new_stage_time_ms": [round(t, 6) for t in result.new.stage_time_ms],
        "new_step_time_ms": round(result.new_step_ms, 6),
        "predicted_gain": round(result.gain, 6),
        "min_gain": result.min_gain,
        "suggest": result.suggest,
        "reason": result.reason,
        "attribution": dict(result.corrected.meta).get("attribution", "stage"),
        "corrected_profile": os.path.join(directory, "profile.yaml"),
    }
    if result.suggest:
        emitted = emit(partition=result.new, parallel=setup.parallel, train=setup.train)
        out.update(megatron_args=emitted.megatron_command, bridge_overrides=list(emitted.bridge_overrides),
                   nemo2_overrides=list(emitted.nemo2_overrides), warnings=list(emitted.warnings))
    return out


def _print(result: dict) -> None:
    from rich.console import Console

    console = Console(soft_wrap=True)
    measured = result["measured_step_time_ms"]
    console.print(f"run layout:    {result['run_layout']}  measured step "
                  f"{'n/a' if measured is None else f'{measured:.1f} ms'}, per-stage compute "
                  f"{', '.join(f'{t:.2f}' for t in result['measured_stage_compute_ms'])} ms/microbatch")
    console.print(f"old layout:    {result['old_layout']}  simulated step {result['old_step_time_ms']:.1f} ms "
                  "(corrected profile)")
    console.print(f"new layout:    {result['new_layout']}  simulated step {result['new_step_time_ms']:.1f} ms, "
                  f"predicted gain {result['predicted_gain']:+.1%}")
    console.print(f"corrected profile: {result['corrected_profile']}")
    if not result["suggest"]:
        console.print(f"no change suggested: {result['reason']}")
        return
    console.print(f"apply:         {result['megatron_args']}")
    console.print(f"Megatron-Bridge: {' '.join(result['bridge_overrides'])}")
    console.print(f"NeMo 2:        {' '.join(result['nemo2_overrides'])}")
    for warning in result["warnings"]:
        console.print(f"warning: {warning}")


def run(cfg: DictConfig) -> None:
    from megapipe.cli import output_dir
    from megapipe.commands.partition import pipeline_p2p
    from megapipe.monitor.jsonl import read_monitor

    run_dir = _run_dir(cfg)
    attribution = str(cfg.search.get("replan_attribution") or "stage")
    if attribution not in ATTRIBUTIONS:
        raise ConfigError(f"search.replan_attribution={attribution!r} is not known; "
                          f"use one of {', '.join(ATTRIBUTIONS)}")
    records = read_monitor(run_dir)
    plan = _load_plan(run_dir)
    measured = measured_run(records, layout=plan["best"].get("layout") if plan else None)
    setup = _plan_setup(plan) if plan is not None else _config_setup(cfg, measured)
    _check_sizes(setup, measured, plan)
    profile = _profile(cfg, run_dir, setup)
    par = setup.parallel
    specs = stage_specs(setup.cluster, pipeline_model_parallel_size=par.pipeline_model_parallel_size)
    result = replan(profile, measured, stages=specs, schedule=setup.schedule,
                    num_microbatches=setup.num_microbatches, p2p=pipeline_p2p(setup),
                    min_gain=float(cfg.search.get("min_gain", 0.02)),
                    microbatch_group_size_per_vp_stage=par.microbatch_group_size_per_vp_stage,
                    attribution=attribution)
    directory = output_dir(cfg)
    result.corrected.save(os.path.join(directory, "profile.yaml"))
    summary = result_dict(setup, measured, result, directory=directory)
    atomic_write_text(os.path.join(directory, "replan.yaml"), yaml.safe_dump(summary, sort_keys=False, width=120))
    if getattr(cfg.output.format, "value", str(cfg.output.format)) == "json":
        print(json.dumps(summary, sort_keys=False))
    else:
        _print(summary)
