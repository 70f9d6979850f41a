"""What several commands share: the profile a scenario is costed with, its stage specs and p2p cost, console output,
and a monitored run's directory read (replan, calibrate).

No command imports another; they all import this.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import os
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from omegaconf import DictConfig, OmegaConf

from megapipe import cost
from megapipe.config import Scenario, to_scenario
from megapipe.errors import ConfigError
from megapipe.plandir import PLAN_FILE, read_plan
from megapipe.profile.format import load_profile
from megapipe.placement import default_gpus, modelled_stage_specs
from megapipe.profile.match import match_profile
from megapipe.records import GpuSpec, Partition, Profile, StageSpec
from megapipe.schedules import megatron_schedule
from megapipe.simulate import P2PCost, StageTimes
from megapipe.simulate import inputs as simulate_inputs

if TYPE_CHECKING:  # read only by the commands that read a monitored run (report, replan, calibrate)
    from megapipe.plan.replan import MeasuredRun

__all__ = ["matched_profile", "scenario_profile", "stage_specs_of", "stage_times", "pipeline_p2p", "print_json",
           "console", "warn", "MonitoredRun", "read_monitored_run", "process_map", "process_workers"]

_PIPED_WIDTH = 160
"""Columns when stdout is not a terminal: rich would fold tables into 80."""


def gpus_phrase(cluster) -> str:
    """The cluster in GPUs, and the nodes they are in: "128 h100_80gb GPUs (16 nodes of 8)"; each GPU type of a
    mixed cluster by its count."""
    gpus = " + ".join(f"{group.num_nodes * cluster.gpus_per_node} {group.gpu.name}" for group in cluster.node_groups)
    return f"{gpus} GPUs ({cluster.num_nodes} nodes of {cluster.gpus_per_node})"


def warn(message: str) -> None:
    """One warning line on stderr."""
    print(f"warning: {message}", file=sys.stderr)


def matched_profile(scenario: Scenario, path: str) -> Profile:
    """The ``profile=FILE`` profile, checked against the model's shape and scaled for the cluster's GPU."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        profile = match_profile(load_profile(path), model=scenario.model, gpu=scenario.cluster.gpu)
    for warning in caught:
        warn(str(warning.message))
    return profile


def scenario_profile(scenario: Scenario, profile_path: str | None) -> Profile:
    """The measured profile at ``profile_path`` (``profile=FILE``, checked against the model), else the cost
    model's."""
    if profile_path:
        return matched_profile(scenario, profile_path)
    return cost.layer_costs(model=scenario.model, gpu=scenario.cluster.gpu, cluster=scenario.cluster,
                            parallel=scenario.parallel, train=scenario.train)


def stage_specs_of(scenario: Scenario, *, pipeline_model_parallel_size: int | None = None,
                   gpus: tuple[GpuSpec, ...] | None = None) -> tuple[StageSpec, ...]:
    """StageSpecs for the scenario's cluster (placed by :func:`megapipe.placement.default_gpus` unless ``gpus``),
    each GPU type's time scale the ratio of its modelled layer times to the reference GPU's, as in the planner."""
    pp = pipeline_model_parallel_size or scenario.parallel.pipeline_model_parallel_size
    placed = gpus or default_gpus(scenario.cluster, pp)

    def layers_of(gpu: GpuSpec):
        return cost.layer_costs(model=scenario.model, gpu=gpu, cluster=scenario.cluster, parallel=scenario.parallel,
                                train=scenario.train).layers

    return modelled_stage_specs(placed, reference=scenario.cluster.gpu, layers_of=layers_of,
                                microbatch_overhead_ms=scenario.cluster.runtime.microbatch_overhead_ms)


def stage_times(profile: Profile, part: Partition, specs: tuple[StageSpec, ...], stage_to_rank) -> StageTimes:
    """Per layout stage F, B, W (scaled by the rank's time_scale) and activation bytes."""
    return simulate_inputs.stage_times(layers=profile.layers, entries_per_stage=part.entries_per_stage,
                                       stage_to_rank=stage_to_rank, specs=specs)


def pipeline_p2p(scenario: Scenario) -> P2PCost:
    """The configured model's message between pipeline neighbours on the configured cluster."""
    return simulate_inputs.p2p_cost(model=scenario.model, cluster=scenario.cluster, parallel=scenario.parallel,
                                    train=scenario.train)


def print_json(document: dict) -> None:
    """The one JSON object of ``output.format=json`` on stdout."""
    print(json.dumps(document, sort_keys=False))


def console(*, width: int | None = None, soft_wrap: bool = False):
    """A rich console on stdout; piped, it keeps ``width`` (or 160) columns instead of folding into 80."""
    from rich.console import Console

    out = Console(soft_wrap=soft_wrap)
    if not out.is_terminal:
        out = Console(soft_wrap=soft_wrap, width=max(out.width, width or _PIPED_WIDTH))
    elif width:
        out = Console(soft_wrap=soft_wrap, width=max(out.width, width))
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class MonitoredRun:
    """A monitored run's directory, read once: its measurements, its plan.yaml when it has one, its scenario."""

    run_dir: str
    scenario: Scenario
    """The run's settings: plan.yaml's inputs and best plan, else the config with the log's pipeline sizes."""
    measured: MeasuredRun
    plan: dict | None
    """The run's plan.yaml (megapipe-plan/1), when it has one."""


def read_monitored_run(cfg: DictConfig, *, command: str, run_dir: str | None = None) -> MonitoredRun:
    """RUN_DIR (``run_dir``, else ``input``): the monitor's logs (RUN_DIR or RUN_DIR/monitor), plan.yaml when
    present, the scenario."""
    from megapipe.monitor.jsonl import read_monitor
    from megapipe.monitor.measured import measured_run

    run_dir = run_dir or _run_dir(cfg, command)
    plan = read_plan(run_dir) if os.path.isfile(os.path.join(run_dir, PLAN_FILE)) else None
    measured = measured_run(read_monitor(run_dir), layout=plan["best"].get("layout") if plan else None)
    scenario = _plan_scenario(plan) if plan is not None else _config_scenario(cfg, measured)
    _check_sizes(scenario, measured, plan)
    return MonitoredRun(run_dir=run_dir, scenario=scenario, measured=measured, plan=plan)


def _run_dir(cfg: DictConfig, command: str) -> str:
    path = cfg.get("input")
    if not path:
        raise ConfigError(f"{command} needs the monitored run's directory: megapipe {command} RUN_DIR [key=value ...]")
    if not os.path.isdir(str(path)):
        raise ConfigError(f"run directory {str(path)!r} does not exist; pass the directory the monitor logged into")
    return str(path)


def _plan_scenario(plan: dict) -> Scenario:
    """The planned run's scenario: the plan's recorded inputs, searched dimensions filled with its best plan's."""
    best = plan["best"]
    fill = {key: value for key, value in best["parallel"].items() if key != "data_parallel_size"}
    fill.update({key: best["train"][key] for key in ("micro_batch_size", "recompute_granularity", "num_microbatches")})
    fill["schedule"] = best["schedule"]
    return to_scenario(OmegaConf.create(plan.get("inputs") or {}), fill=fill)


def _config_scenario(cfg: DictConfig, measured: MeasuredRun) -> Scenario:
    """No plan.yaml: the config, with pipeline sizes and micro-batches the user left null taken from the log."""
    pp = measured.pipeline_model_parallel_size
    chunks = len(measured.stage_forward_ms) // pp
    fill = {"pipeline_model_parallel_size": pp, "virtual_pipeline_model_parallel_size": chunks,
            "schedule": megatron_schedule(chunks), "num_microbatches": measured.num_microbatches}
    scenario = to_scenario(cfg, fill=fill)
    if cfg.train.num_microbatches is None and measured.num_microbatches:
        # the emitted global batch must agree with the run's micro-batches
        batch = scenario.num_microbatches * scenario.train.micro_batch_size * scenario.parallel.data_parallel_size
        scenario = dataclasses.replace(scenario, train=dataclasses.replace(scenario.train, global_batch_size=batch))
    return scenario


def _check_sizes(scenario: Scenario, measured: MeasuredRun, plan: dict | None) -> None:
    par = scenario.parallel
    if plan is not None and plan["best"].get("layout") and plan["best"]["layout"] != measured.layout:
        raise ConfigError(f"the monitor log is from layout {measured.layout!r} but plan.yaml planned "
                          f"{plan['best']['layout']!r}; use the run that used the planned layout")
    stages = par.pipeline_model_parallel_size * par.virtual_pipeline_model_parallel_size
    stages_measured = len(measured.stage_forward_ms)
    if measured.pipeline_model_parallel_size != par.pipeline_model_parallel_size or stages_measured != stages:
        raise ConfigError(
            f"the monitor log has {stages_measured} stages on {measured.pipeline_model_parallel_size} "
            f"pipeline ranks but the config has pipeline_model_parallel_size={par.pipeline_model_parallel_size} x "
            f"virtual_pipeline_model_parallel_size={par.virtual_pipeline_model_parallel_size}; set them to the run's"
        )


def process_workers(count: int) -> int:
    """How many processes :func:`process_map` runs ``count`` tasks on: the machine's cores, at most one per task."""
    return max(1, min(os.cpu_count() or 1, count))


@contextlib.contextmanager
def process_map(count: int, *, one_at_a_time: bool = False, meanwhile: Callable[[], object] | None = None,
                collect: bool = True):
    """A ``map`` for ``count`` independent tasks over the machine's cores: a fork process pool, in order, or the
    built-in map when one process is all there is (one core, or one task). Work handed to it must not depend on
    how many processes run it. Tasks go out in chunks (a quarter of each process's share), or ``one_at_a_time``
    when they are few, long and of uneven cost.

    ``meanwhile``: what this process does, once, during the first map, as soon as one of the pool's processes has
    no task left (imports later work needs, on a core the map leaves idle); each map then forks a fresh pool, so its
    processes have what this process imported since. Without a pool it runs before the first map's tasks.

    ``collect=False``: the pool's processes run without Python's cycle collector, for work that drops no reference
    cycles and keeps many small records (pack's searches and the unit costs they share, which the collector would
    otherwise walk again each time they grow); the processes end with the command."""
    workers = process_workers(count)
    pending = [meanwhile] if meanwhile is not None else []
    if workers == 1:
        def mapper(function, items):
            items = list(items)
            while items and pending:
                pending.pop()()
            return map(function, items)

        yield mapper
        return
    import multiprocessing

    context = multiprocessing.get_context("fork")
    chunk = 1 if one_at_a_time else max(1, -(-count // (4 * workers)))
    pools: list = []

    def mapper(function, items):
        items = list(items)
        if not items:
            return iter(())
        if not pools or meanwhile is not None:
            if pools:
                pools[-1].close()  # its tasks still run to the end; joined on the way out
            pools.append(context.Pool(workers, initializer=None if collect else gc.disable))
        if not pending:
            return pools[-1].imap(function, items, chunksize=chunk)
        done = pools[-1].imap_unordered(_indexed_call, [(function, index, item) for index, item in enumerate(items)],
                                        chunksize=chunk)
        return _in_order(done, len(items), workers, pending)

    try:
        yield mapper
    finally:
        for pool in pools:
            pool.close()
            pool.join()


def _indexed_call(task):
    function, index, item = task
    return index, function(item)


def _in_order(done, count: int, workers: int, pending: list):
    """The results of ``done`` ((index, result) as tasks end) in task order; ``pending``'s work runs here once fewer
    tasks are left than processes (one of them is idle)."""
    kept, following, received = {}, 0, 0
    while pending and count < workers:
        pending.pop()()
    for index, result in done:
        received += 1
        kept[index] = result
        while pending and count - received < workers:
            pending.pop()()
        while following in kept:
            yield kept.pop(following)
            following += 1
