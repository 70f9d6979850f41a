"""``megapipe plan``: search the parallel configuration, print the best plans, write the plan dir.

Plan dir (``output.dir`` or Hydra's run directory): ``plan.yaml`` (megapipe-plan/1),
``megatron_args.txt``, ``bridge_overrides.txt``, ``nemo2_overrides.txt``,
``nemo1_overrides.txt``, ``profile.yaml`` (the layer costs used), ``gantt.png`` and
``memory.png``. Every file is written atomically; plan.yaml holds no timestamps.
"""

from __future__ import annotations

import json
import os
import sys

import yaml
from omegaconf import DictConfig, OmegaConf

from megapipe.commands.partition import matched_profile
from megapipe.config import to_setup
from megapipe.errors import ConfigError
from megapipe.plan.document import json_summary, plan_document
from megapipe.plan.records import SearchOptions, SearchResult
from megapipe.plan.search import search
from megapipe.profile.format import Profile, atomic_write_text
from megapipe.schedules import SCHEDULE_NAMES

__all__ = ["run", "precheck", "search_options", "search_inputs", "write_plan_dir", "print_plans"]

_PARALLEL_DIMS = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                  "virtual_pipeline_model_parallel_size", "context_parallel_size", "sequence_parallel")


def search_options(cfg: DictConfig) -> SearchOptions:
    """``search.*`` (and train.total_tokens) as a SearchOptions record."""
    node = cfg.search
    target = node.get("bubble_target")
    if target is not None and len(target) != 2:
        raise ConfigError(f"search.bubble_target={list(target)} must be [low, high]")
    warn = list(node.get("bubble_warning_range") or (0.12, 0.15))
    if len(warn) != 2:
        raise ConfigError(f"search.bubble_warning_range={warn} must be [low, high]")
    top_k = int(node.get("top_k") or 5)
    if top_k < 1:
        raise ConfigError(f"search.top_k={top_k} must be >= 1")
    objective = node.get("objective") or "throughput"
    return SearchOptions(
        objective=getattr(objective, "value", str(objective)), top_k=top_k,
        allow_cross_node_tp=bool(node.get("allow_cross_node_tp")),
        bubble_target=None if target is None else (float(target[0]), float(target[1])),
        bubble_warning_range=(float(warn[0]), float(warn[1])),
        ignore_memory_limit=bool(node.get("ignore_memory_limit")),
        max_pipeline_model_parallel_size=node.get("max_pipeline_model_parallel_size"),
        per_stage_recompute=bool(node.get("per_stage_recompute")),
        megatron_schedules_only=bool(node.get("megatron_schedules_only")),
        total_tokens=float(cfg.train.get("total_tokens") or 2e12),
    )


def search_inputs(cfg: DictConfig):
    """(setup, fixed) for a search: searched dimensions stay free, fixed ones are pinned.

    ``to_setup`` fills null dimensions with defaults and checks them; for a search those
    defaults are placeholders, so they are set to 1 here before the shared validation runs.
    """
    probe = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    OmegaConf.set_struct(probe, False)
    fixed: dict[str, object] = {}
    for key in _PARALLEL_DIMS:
        value = probe.parallel.get(key)
        if value is None:
            probe.parallel[key] = False if key == "sequence_parallel" else 1
        else:
            fixed[key] = value
    for key in ("micro_batch_size", "recompute_granularity"):
        if probe.train.get(key) is not None:
            fixed[key] = probe.train[key]
    if probe.train.get("micro_batch_size") is None:
        probe.train.micro_batch_size = 1
    if probe.train.get("num_microbatches") is None:
        probe.train.num_microbatches = 1
    schedule = probe.schedule.get("name")
    if schedule not in (None, "all"):
        if schedule not in SCHEDULE_NAMES:
            raise ConfigError(f"schedule={schedule!r} is unknown; use one of {', '.join(SCHEDULE_NAMES)} or all")
        fixed["schedule"] = schedule
    setup = to_setup(probe)
    if "recompute_granularity" in fixed:
        fixed["recompute_granularity"] = setup.train.recompute_granularity
    return setup, fixed


def precheck(cfg: DictConfig) -> None:
    """What the CLI validates before Hydra runs: the inputs with searched dimensions left free."""
    search_inputs(cfg)
    search_options(cfg)


def _progress_search(**kwargs) -> SearchResult:
    """Search with a rich progress bar on stderr (shown only when stderr is a terminal)."""
    if not sys.stderr.isatty():
        return search(**kwargs)
    from rich.progress import Progress

    with Progress(transient=True) as bar:
        task = bar.add_task("simulating candidates", total=None)

        def tick(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        return search(progress=tick, **kwargs)


def write_plan_dir(directory: str, *, result: SearchResult, setup, options: SearchOptions, cfg: DictConfig,
                   pictures: bool = True) -> dict:
    """Write every file of the plan dir; return the plan document."""
    from megapipe.emit import emit

    best = result.best
    emitted = emit(partition=best.partition, parallel=best.parallel, train=best.train)
    inputs = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    inputs.pop("hydra", None)
    inputs.pop("output", None)  # where and how to print, not what was planned
    document = plan_document(result=result, model=setup.model, cluster=setup.cluster, inputs=inputs,
                             emitted=emitted.as_dict())
    os.makedirs(directory, exist_ok=True)
    atomic_write_text(os.path.join(directory, "plan.yaml"),
                      yaml.safe_dump(document, sort_keys=False, default_flow_style=False, width=120))
    for name, tokens in (("megatron_args.txt", emitted.megatron_args), ("bridge_overrides.txt", emitted.bridge_overrides),
                         ("nemo2_overrides.txt", emitted.nemo2_overrides),
                         ("nemo1_overrides.txt", emitted.nemo1_overrides)):
        atomic_write_text(os.path.join(directory, name), "\n".join(tokens) + "\n")
    if isinstance(result.profile, Profile):
        result.profile.save(os.path.join(directory, "profile.yaml"))
    if pictures:
        _pictures(directory, result, usable_gib=setup.cluster.gpu.usable_memory_bytes / 2**30)
    return document


def _pictures(directory: str, result: SearchResult, *, usable_gib: float) -> None:
    from megapipe.report.plots import memory_chart

    memory_chart(result.best, os.path.join(directory, "memory.png"), baseline=result.baseline, usable_gib=usable_gib)
    if result.best.simulation is not None:
        from megapipe.report.gantt import gantt_png

        gantt_png(result.best.simulation, os.path.join(directory, "gantt.png"),
                  title=f"{result.best.schedule}: {result.best.layout}")


def run(cfg: DictConfig) -> None:
    from megapipe.cli import output_dir

    setup, fixed = search_inputs(cfg)
    options = search_options(cfg)
    profile = matched_profile(setup) if setup.profile_path else None
    if profile is not None:
        _pin_for_profile(setup, fixed)
    result = _progress_search(model=setup.model, cluster=setup.cluster, train=setup.train, fixed=fixed,
                              options=options, profile=profile,
                              use_distributed_optimizer=setup.parallel.use_distributed_optimizer)
    directory = output_dir(cfg)
    write_plan_dir(directory, result=result, setup=setup, options=options, cfg=cfg,
                   pictures=bool(cfg.output.get("pictures", True)))
    fmt = getattr(cfg.output.format, "value", str(cfg.output.format))
    if fmt == "json":
        print(json.dumps(json_summary(result), sort_keys=False))
        return
    print_plans(result, directory=directory)


_LAYER_COST_DIMS = ("tensor_model_parallel_size", "context_parallel_size", "sequence_parallel", "micro_batch_size",
                    "recompute_granularity")


def _pin_for_profile(setup, fixed: dict) -> None:
    """A measured profile holds costs for one TP/CP/SP/micro-batch/recompute: pin those to the config's."""
    for key in _LAYER_COST_DIMS:
        source = setup.train if key in ("micro_batch_size", "recompute_granularity") else setup.parallel
        fixed.setdefault(key, getattr(source, key))


def _row(label: str, plan) -> list[str]:
    par, train = plan.parallel, plan.train
    shape = (f"{par.tensor_model_parallel_size}/{par.pipeline_model_parallel_size}/{par.data_parallel_size}/"
             f"{par.context_parallel_size}/{par.virtual_pipeline_model_parallel_size}")
    peak = max(stage.total_bytes for stage in plan.stages) / 2**30
    recompute = "/".join(plan.stage_recompute) if plan.stage_recompute else train.recompute_granularity.value
    return [label, shape, plan.schedule, str(train.micro_batch_size), recompute,
            "y" if par.sequence_parallel else "n", f"{plan.tokens_per_s_per_gpu:,.0f}", f"{plan.mfu:.1%}",
            f"{plan.bubble_fraction:.1%}", f"{peak:.1f}", f"{plan.memory_cv:.2f}",
            f"${plan.cost_per_million_tokens:.3f}", f"${plan.total_cost / 1e6:,.2f}M", str(len(plan.warnings))]


_PIPED_WIDTH = 160
"""Columns of the plan table when stdout is not a terminal (the table needs about 150)."""


def compare_line(best, reference) -> str:
    """What changed from the write-ups' TP=4 PP=8 configuration to the best plan, and where the time went."""
    par = reference.parallel
    peak = lambda plan: max(stage.total_bytes for stage in plan.stages) / 2**30  # noqa: E731
    return (
        f"vs the write-ups' TP={par.tensor_model_parallel_size} PP={par.pipeline_model_parallel_size} "
        f"DP={par.data_parallel_size} (they report 850 tok/s/GPU; megapipe predicts "
        f"{reference.tokens_per_s_per_gpu:,.0f}): best plan {best.tokens_per_s / reference.tokens_per_s - 1:+.1%}; "
        f"bubble {reference.bubble_fraction:.1%} -> {best.bubble_fraction:.1%}, pipeline "
        f"{reference.pipeline_ms / 1e3:.2f} -> {best.pipeline_ms / 1e3:.2f} s, DP sync "
        f"{reference.dp_sync_ms / 1e3:.2f} -> {best.dp_sync_ms / 1e3:.2f} s, optimizer "
        f"{reference.optimizer_ms / 1e3:.2f} -> {best.optimizer_ms / 1e3:.2f} s, peak memory "
        f"{peak(reference):.1f} -> {peak(best):.1f} GiB"
    )


def print_plans(result: SearchResult, *, directory: str) -> None:
    """Rich table: top k, the best plan's equal split, and the reference configuration."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="megapipe plan: best first")
    for name in ("", "TP/PP/DP/CP/VP", "schedule", "mbs", "recompute", "SP", "tok/s/GPU", "MFU", "bubble",
                 "peak GiB", "mem CV", "$/1M tok", "total $", "warn"):
        table.add_column(name, overflow="fold")
    for index, plan in enumerate(result.plans, start=1):
        table.add_row(*_row(f"#{index}", plan))
    if result.baseline is not None:
        table.add_row(*_row("equal split" if result.baseline.feasible else "equal split (no fit)", result.baseline))
    if result.reference is not None:
        table.add_row(*_row("TP4 PP8 ref", result.reference))
    console = Console()
    if not console.is_terminal:  # piped: rich would fold the 14 columns into 80
        console = Console(width=max(console.width, _PIPED_WIDTH))
    console.print(table)
    best = result.best
    console.print(f"layout: {best.layout}")
    for warning in best.warnings:
        console.print(f"warning: {warning}")
    for index, plan in enumerate(result.plans[1:], start=2):  # the others' in short: what Megatron will not run
        for warning in plan.warnings:
            if warning.startswith("megatron-core has no"):
                console.print(f"#{index} warning: {warning}")
    if result.baseline is not None:
        gain = best.tokens_per_s / result.baseline.tokens_per_s - 1
        fits = "" if result.baseline.feasible else (
            f" (the equal split does not fit memory: {result.baseline.memory_over_gib:.1f} GiB over on its fullest "
            "stage, so it could not run as shown)")
        console.print(f"gain over equal split: {gain:+.1%}{fits}")
    if result.reference is not None and result.reference is not best:
        console.print(compare_line(best, result.reference))
    stats = result.stats
    console.print(f"searched {stats.enumerated} candidates, simulated {stats.simulated}, pruned "
                  f"{dict(stats.pruned)} in {stats.seconds:.2f} s; files in {directory}")

