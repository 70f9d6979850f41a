"""``megapipe plan``: search the parallel configuration, print the best plans, write the plan dir.

Plan dir (``output.dir`` or Hydra's run directory): ``plan.yaml`` (megapipe-plan/1),
``megatron_args.txt``, ``bridge_overrides.txt``, ``nemo2_overrides.txt``,
``nemo1_overrides.txt``, ``profile.yaml`` (the layer costs used), ``gantt.png`` and
``memory.png``. Every file is written atomically; plan.yaml holds no timestamps.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from omegaconf import DictConfig

from megapipe.commands.common import console, matched_profile, print_json
from megapipe.config import Setup, recorded_inputs, to_setup
from megapipe.emit import emit
from megapipe.io import write_plan_dir
from megapipe.plan.document import json_summary, plan_document
from megapipe.plan.plans import SearchResult
from megapipe.plan.search import search
from megapipe.records import Profile
from megapipe.units import GIB

__all__ = ["PlanJob", "prepare", "run", "print_plans", "compare_line"]


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanJob:
    setup: Setup
    """Searched dimensions free; ``setup.fixed`` holds what the search keeps."""
    inputs: dict
    """The resolved config, recorded in plan.yaml."""
    profile: Profile | None = None
    """The measured profile (``profile=FILE``), checked against the model."""


_LAYER_COST_DIMS = ("tensor_model_parallel_size", "context_parallel_size", "sequence_parallel", "micro_batch_size",
                    "recompute_granularity")


def prepare(cfg: DictConfig) -> PlanJob:
    setup = to_setup(cfg, search=True)
    return PlanJob(setup=setup, inputs=recorded_inputs(cfg),
                   profile=matched_profile(setup) if setup.profile_path else None)


def _fixed(job: PlanJob) -> dict:
    """What the search keeps: the user's dimensions, and with a measured profile the ones its costs depend on."""
    fixed = dict(job.setup.fixed)
    if job.profile is not None:  # a profile holds costs for one TP/CP/SP/micro-batch/recompute
        for key in _LAYER_COST_DIMS:
            source = job.setup.train if key in ("micro_batch_size", "recompute_granularity") else job.setup.parallel
            fixed.setdefault(key, getattr(source, key))
    return fixed


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


def _pictures(directory: str, result: SearchResult, *, usable_gib: float) -> None:
    from megapipe.report.plots import memory_chart

    memory_chart(result.best, os.path.join(directory, "memory.png"), baseline=result.baseline, usable_gib=usable_gib)
    if result.best.simulation is not None:
        from megapipe.report.gantt import gantt_png

        gantt_png(result.best.simulation, os.path.join(directory, "gantt.png"),
                  title=f"{result.best.schedule}: {result.best.layout}")


def run(job: PlanJob, *, directory: str) -> None:
    setup = job.setup
    result = _progress_search(model=setup.model, cluster=setup.cluster, train=setup.train, fixed=_fixed(job),
                              options=setup.search, profile=job.profile,
                              use_distributed_optimizer=setup.parallel.use_distributed_optimizer)
    best = result.best
    emitted = emit(partition=best.partition, parallel=best.parallel, train=best.train)
    document = plan_document(result=result, model=setup.model, cluster=setup.cluster, inputs=job.inputs,
                             emitted=emitted.as_dict())
    write_plan_dir(directory, document=document, emitted=emitted,
                   profile=result.profile if isinstance(result.profile, Profile) else None)
    if setup.output.json:
        print_json(json_summary(result))
    else:
        print_plans(result, directory=directory)
    if setup.output.pictures:  # after the answer: matplotlib takes longer than the search
        _pictures(directory, result, usable_gib=setup.cluster.gpu.usable_memory_bytes / GIB)


def _row(label: str, plan) -> list[str]:
    par, train = plan.parallel, plan.train
    shape = (f"{par.tensor_model_parallel_size}/{par.pipeline_model_parallel_size}/{par.data_parallel_size}/"
             f"{par.context_parallel_size}/{par.virtual_pipeline_model_parallel_size}")
    peak = max(stage.total_bytes for stage in plan.stages) / GIB
    recompute = "/".join(plan.stage_recompute) if plan.stage_recompute else train.recompute_granularity.value
    return [label, shape, plan.schedule, str(train.micro_batch_size), recompute,
            "y" if par.sequence_parallel else "n", f"{plan.tokens_per_s_per_gpu:,.0f}", f"{plan.mfu:.1%}",
            f"{plan.bubble_fraction:.1%}", f"{peak:.1f}", f"{plan.memory_cv:.2f}",
            f"${plan.cost_per_million_tokens:.3f}", f"${plan.total_cost / 1e6:,.2f}M", str(len(plan.warnings))]


def compare_line(best, reference) -> str:
    """What changed from the write-ups' TP=4 PP=8 configuration to the best plan, and where the time went."""
    par = reference.parallel
    peak = lambda plan: max(stage.total_bytes for stage in plan.stages) / GIB  # noqa: E731
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
    out = console()
    out.print(table)
    best = result.best
    out.print(f"layout: {best.layout}")
    for warning in best.warnings:
        out.print(f"warning: {warning}")
    for index, plan in enumerate(result.plans[1:], start=2):  # the others' in short: what Megatron will not run
        for warning in plan.warnings:
            if warning.startswith("megatron-core has no"):
                out.print(f"#{index} warning: {warning}")
    if result.baseline is not None:
        gain = best.tokens_per_s / result.baseline.tokens_per_s - 1
        fits = "" if result.baseline.feasible else (
            f" (the equal split does not fit memory: {result.baseline.memory_over_gib:.1f} GiB over on its fullest "
            "stage, so it could not run as shown)")
        out.print(f"gain over equal split: {gain:+.1%}{fits}")
    if result.reference is not None and result.reference is not best:
        out.print(compare_line(best, result.reference))
    stats = result.stats
    out.print(f"searched {stats.enumerated} candidates, simulated {stats.simulated}, pruned "
                  f"{dict(stats.pruned)} in {stats.seconds:.2f} s; files in {directory}")

