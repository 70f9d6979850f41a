"""``megapipe replan RUN_DIR``: a better layout from a monitored run's measurements.

    megapipe replan outputs/run1                      # RUN_DIR holds plan.yaml, profile.yaml, rank-*.jsonl
    megapipe replan outputs/run1 profile=old.yaml model=tiny_gpt cluster=cpu_gloo \
        parallel.tensor_model_parallel_size=1 parallel.pipeline_model_parallel_size=2 train.num_microbatches=4

Reads the run's ``megapipe-monitor/1`` logs (RUN_DIR or RUN_DIR/monitor), the profile the
run was planned with (``profile=FILE``, else RUN_DIR/profile.yaml) and, when present,
RUN_DIR/plan.yaml (model, cluster, parallel sizes, schedule and micro-batches of the run;
without it they come from the config, pipeline sizes and micro-batches from the log).
Attributes each stage's measured time to its layers (:mod:`megapipe.plan.replan`), writes the
corrected profile (``profile.yaml``) and ``replan.yaml`` into the output directory, solves
again and prints the new layout, the predicted gain and the overrides to apply, or why
the current layout stays (gain below ``search.min_gain``).
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

from omegaconf import DictConfig, OmegaConf

from megapipe.commands.common import console, pipeline_p2p, print_json, setup_stage_specs
from megapipe.config import OutputOptions, ReplanOptions, Setup, to_setup
from megapipe.config.options import output_options, replan_options
from megapipe.errors import ConfigError
from megapipe.io import PLAN_FILE, atomic_write_text, dump_yaml, load_profile, read_plan, save_profile
from megapipe.monitor.jsonl import FORMAT as MONITOR_FORMAT
from megapipe.monitor.jsonl import read_monitor
from megapipe.monitor.measured import measured_run
from megapipe.placement import default_gpus, gpus_by_name
from megapipe.plan.replan import MeasuredRun, Replan, replan
from megapipe.profile.match import match_profile
from megapipe.records import Profile
from megapipe.schedules import megatron_schedule

__all__ = ["ReplanJob", "prepare", "run", "result_dict"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplanJob:
    """A monitored run, read once: its setup, measurements, recorded plan and the profile it was planned with."""

    run_dir: str
    setup: Setup
    measured: MeasuredRun
    plan: dict | None
    """The run's plan.yaml (megapipe-plan/1), when it has one."""
    profile: Profile
    options: ReplanOptions
    output: OutputOptions


def _run_dir(cfg: DictConfig) -> str:
    path = cfg.get("input")
    if not path:
        raise ConfigError("replan needs the monitored run's directory: megapipe replan RUN_DIR [key=value ...]")
    if not os.path.isdir(str(path)):
        raise ConfigError(f"run directory {str(path)!r} does not exist; pass the directory the monitor logged into")
    return str(path)


def _plan_setup(plan: dict) -> Setup:
    """The planned run's setup: the plan's recorded inputs, searched dimensions filled with its best plan's."""
    best = plan["best"]
    fill = {key: value for key, value in best["parallel"].items() if key != "data_parallel_size"}
    fill.update({key: best["train"][key] for key in ("micro_batch_size", "recompute_granularity", "num_microbatches")})
    fill["schedule"] = best["schedule"]
    return to_setup(OmegaConf.create(plan.get("inputs") or {}), fill=fill)


def _config_setup(cfg: DictConfig, measured: MeasuredRun) -> Setup:
    """No plan.yaml: the config, with pipeline sizes and micro-batches the user left null taken from the log."""
    pp = measured.pipeline_model_parallel_size
    chunks = len(measured.stage_forward_ms) // pp
    fill = {"pipeline_model_parallel_size": pp, "virtual_pipeline_model_parallel_size": chunks,
            "schedule": megatron_schedule(chunks), "num_microbatches": measured.num_microbatches}
    setup = to_setup(cfg, fill=fill)
    if cfg.train.num_microbatches is None and measured.num_microbatches:
        # the emitted global batch must agree with the run's micro-batches
        batch = setup.num_microbatches * setup.train.micro_batch_size * setup.parallel.data_parallel_size
        setup = dataclasses.replace(setup, train=dataclasses.replace(setup.train, global_batch_size=batch))
    return setup


def _profile(cfg: DictConfig, run_dir: str, setup: Setup) -> Profile:
    path = cfg.get("profile") or os.path.join(run_dir, "profile.yaml")
    if not os.path.isfile(path):
        raise ConfigError(f"no profile at {path!r}: pass the profile the run was planned with (profile=FILE)")
    return match_profile(load_profile(path), model=setup.model)


def prepare(cfg: DictConfig) -> ReplanJob:
    """Read the run directory: monitor logs, plan.yaml when present, and the profile."""
    run_dir = _run_dir(cfg)
    options = replan_options(cfg)
    plan = read_plan(run_dir) if os.path.isfile(os.path.join(run_dir, PLAN_FILE)) else None
    measured = measured_run(read_monitor(run_dir), layout=plan["best"].get("layout") if plan else None)
    setup = _plan_setup(plan) if plan is not None else _config_setup(cfg, measured)
    _check_sizes(setup, measured, plan)
    return ReplanJob(run_dir=run_dir, setup=setup, measured=measured, plan=plan,
                     profile=_profile(cfg, run_dir, setup), options=options, output=output_options(cfg))


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


def result_dict(setup: Setup, measured: MeasuredRun, result: Replan, *, directory: str, gpus) -> dict:
    from megapipe.emit import BridgeKeys, emit

    out = {
        "run_layout": measured.layout,
        "measured_step_time_ms": round(measured.step_time_ms, 6) if math.isfinite(measured.step_time_ms) else None,
        "measured_stage_compute_ms": [round(t, 6) for t in measured.stage_compute_ms],
        "measured_compute_spread_ms": round(measured.compute_spread_ms, 6),
        "schedule": str(setup.schedule),
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
        emitted = emit(partition=result.new, parallel=setup.parallel, train=setup.train, model=setup.model,
                       gpus=gpus, bridge_keys=BridgeKeys(setup.output.bridge_keys),
                       domain_gpus=setup.cluster.domain_gpus)
        out.update(megatron_args=emitted.megatron_command, bridge_overrides=list(emitted.bridge_overrides),
                   nemo2_overrides=list(emitted.nemo2_overrides), warnings=list(emitted.warnings))
    return out


def _print(result: dict) -> None:
    out = console(soft_wrap=True)
    measured = result["measured_step_time_ms"]
    out.print(f"run layout:    {result['run_layout']}  measured step "
                  f"{'n/a' if measured is None else f'{measured:.1f} ms'}, per-stage compute "
                  f"{', '.join(f'{t:.2f}' for t in result['measured_stage_compute_ms'])} ms/microbatch")
    out.print(f"old layout:    {result['old_layout']}  simulated step {result['old_step_time_ms']:.1f} ms "
                  "(corrected profile)")
    out.print(f"new layout:    {result['new_layout']}  simulated step {result['new_step_time_ms']:.1f} ms, "
                  f"predicted gain {result['predicted_gain']:+.1%}")
    out.print(f"corrected profile: {result['corrected_profile']}")
    if not result["suggest"]:
        out.print(f"no change suggested: {result['reason']}")
        return
    out.print(f"apply:         {result['megatron_args']}")
    out.print(f"Megatron-Bridge: {' '.join(result['bridge_overrides'])}")
    out.print(f"NeMo 2:        {' '.join(result['nemo2_overrides'])}")
    for warning in result["warnings"]:
        out.print(f"warning: {warning}")


def _placement(job: ReplanJob):
    """The run's GPU per pipeline rank: the plan's stage GPUs when it recorded them, else the default placement."""
    stage_gpus = (job.plan or {}).get("best", {}).get("stage_gpus")
    if stage_gpus:
        return gpus_by_name(job.setup.cluster, stage_gpus)
    return default_gpus(job.setup.cluster, job.setup.parallel.pipeline_model_parallel_size)


def run(job: ReplanJob, *, directory: str) -> None:
    setup, par = job.setup, job.setup.parallel
    gpus = _placement(job)
    result = replan(job.profile, job.measured, stages=setup_stage_specs(setup, gpus=gpus), schedule=setup.schedule,
                    num_microbatches=setup.num_microbatches, p2p=pipeline_p2p(setup),
                    min_gain=job.options.min_gain,
                    microbatch_group_size_per_vp_stage=par.microbatch_group_size_per_vp_stage,
                    attribution=job.options.attribution, corrected_from=MONITOR_FORMAT)
    save_profile(result.corrected, os.path.join(directory, "profile.yaml"))
    summary = result_dict(setup, job.measured, result, directory=directory, gpus=gpus)
    atomic_write_text(os.path.join(directory, "replan.yaml"), dump_yaml(summary))
    if job.output.json:
        print_json(summary)
    else:
        _print(summary)
