r"""``megapipe replan RUN_DIR``: a better layout from a monitored run's measurements.

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

import math
import os
from dataclasses import dataclass

from omegaconf import DictConfig

from megapipe.commands.common import console, pipeline_p2p, print_json, read_monitored_run, stage_specs_of
from megapipe.config import Scenario
from megapipe.options import OutputOptions, ReplanOptions
from megapipe.config.options import output_options, replan_options
from megapipe.errors import ConfigError
from megapipe.files import atomic_write_text, dump_yaml
from megapipe.profile.format import load_profile, save_profile
from megapipe.monitor.jsonl import FORMAT as MONITOR_FORMAT
from megapipe.placement import default_gpus, gpus_by_name
from megapipe.plandir import plan_emission
from megapipe.plan.replan import MeasuredRun, Replan, replan
from megapipe.profile.match import match_profile
from megapipe.records import Profile

__all__ = ["ReplanInputs", "prepare", "run", "result_dict", "CONFIG_KEYS", "FILES"]

CONFIG_KEYS = ("input", "profile", "search.min_gain", "search.replan_attribution", "output.format", "output.dir",
               "output.bridge_keys", "model", "cluster", "runtime", "parallel", "train", "schedule")
"""What `megapipe replan --help` lists (:mod:`megapipe.config.keys`); model to schedule only without plan.yaml."""
FILES = (("profile.yaml", "the corrected profile: the measured stage times attributed to their layers"),
         ("replan.yaml", "the run's layout and the new one, their simulated steps, the gain and what to apply"))


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplanInputs:
    """A monitored run, read once: its scenario, measurements, recorded plan and the profile it was planned with."""

    run_dir: str
    scenario: Scenario
    measured: MeasuredRun
    plan: dict | None
    """The run's plan.yaml (megapipe-plan/1), when it has one."""
    profile: Profile
    options: ReplanOptions
    output: OutputOptions


def _profile(cfg: DictConfig, run_dir: str, scenario: Scenario) -> Profile:
    path = cfg.get("profile") or os.path.join(run_dir, "profile.yaml")
    if not os.path.isfile(path):
        raise ConfigError(f"no profile at {path!r}: pass the profile the run was planned with (profile=FILE)")
    return match_profile(load_profile(path), model=scenario.model)


def prepare(cfg: DictConfig) -> ReplanInputs:
    """Read the run directory: monitor logs, plan.yaml when present, and the profile."""
    options = replan_options(cfg)
    run = read_monitored_run(cfg, command="replan")
    return ReplanInputs(run_dir=run.run_dir, scenario=run.scenario, measured=run.measured, plan=run.plan,
                        profile=_profile(cfg, run.run_dir, run.scenario), options=options, output=output_options(cfg))


def result_dict(scenario: Scenario, measured: MeasuredRun, result: Replan, *, directory: str,
                stage_gpus: tuple[str, ...] = (), bridge_keys: str = "flat") -> dict:
    out = {
        "run_layout": measured.layout,
        "measured_step_time_ms": round(measured.step_time_ms, 6) if math.isfinite(measured.step_time_ms) else None,
        "measured_stage_compute_ms": [round(t, 6) for t in measured.stage_compute_ms],
        "measured_compute_spread_ms": round(measured.compute_spread_ms, 6),
        "schedule": str(scenario.schedule),
        "num_microbatches": scenario.num_microbatches,
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
        emission = plan_emission(partition=result.new, parallel=scenario.parallel, train=scenario.train,
                                 model=scenario.model, cluster=scenario.cluster, stage_gpus=stage_gpus,
                                 bridge_keys=bridge_keys)
        emitted = emission.emitted
        if emitted is None:
            out.update(warnings=list(emission.what_if))
        else:
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


def _placement(job: ReplanInputs):
    """The run's GPU per pipeline rank: the plan's stage GPUs when it recorded them, else the default placement."""
    stage_gpus = (job.plan or {}).get("best", {}).get("stage_gpus")
    if stage_gpus:
        return gpus_by_name(job.scenario.cluster, stage_gpus)
    return default_gpus(job.scenario.cluster, job.scenario.parallel.pipeline_model_parallel_size)


def run(job: ReplanInputs, *, directory: str) -> None:
    scenario, par = job.scenario, job.scenario.parallel
    gpus = _placement(job)
    result = replan(job.profile, job.measured, stages=stage_specs_of(scenario, gpus=gpus), schedule=scenario.schedule,
                    num_microbatches=scenario.num_microbatches, p2p=pipeline_p2p(scenario),
                    min_gain=job.options.min_gain,
                    microbatch_group_size_per_vp_stage=par.microbatch_group_size_per_vp_stage,
                    attribution=job.options.attribution, corrected_from=MONITOR_FORMAT)
    save_profile(result.corrected, os.path.join(directory, "profile.yaml"))
    summary = result_dict(scenario, job.measured, result, directory=directory,
                          stage_gpus=tuple(gpu.name for gpu in gpus) if scenario.cluster.is_heterogeneous else (),
                          bridge_keys=job.output.bridge_keys)
    atomic_write_text(os.path.join(directory, "replan.yaml"), dump_yaml(summary))
    if job.output.json:
        print_json(summary)
    else:
        _print(summary)
