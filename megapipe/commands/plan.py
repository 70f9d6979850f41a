"""``megapipe plan``: search the parallel configuration, print the best plans, write the plan dir.

Searches TP, PP, DP, CP, VP (and EP for MoE models), the micro-batch size, recompute and the
schedule, with the layers split over the pipeline stages exactly; a parallel.* or train.* size
left null is searched, one given is kept. Prints the ranked plans beside Megatron's equal split,
where the best plan's step goes and the Megatron-LM command, and writes the plan dir: the files
below, each atomically; the same inputs give the same bytes. A run that fails leaves no directory.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from omegaconf import DictConfig

from megapipe.commands import painter
from megapipe.commands.common import console, gpus_phrase, matched_profile, print_json
from megapipe.config import Scenario, recorded_inputs, to_scenario
from megapipe.config.options import output_options, search_options
from megapipe.emit import BridgeKeys, launch_line
from megapipe.placement import gpus_by_name, node_ranges
from megapipe.plan.document import json_summary
from megapipe.plandir import GANTT_FILE, MEMORY_FILE, PLAN_DIR_FILES, write_plan
from megapipe.plan.interval import format_interval
from megapipe.plan.plans import SearchResult
from megapipe.plan.search import search
from megapipe.options import OutputOptions, Reference, SearchOptions
from megapipe.records import ClusterSpec, Profile, RuntimeSpec
from megapipe.units import GIB

__all__ = ["PlanInputs", "prepare", "run", "print_plans", "compare_line", "CONFIG_KEYS", "FILES"]

CONFIG_KEYS = ("model", "cluster", "runtime", "parallel", "train", "schedule", "search.objective", "search.top_k",
               "search.allow_cross_node_tp", "search.bubble_target", "search.bubble_warning_range",
               "search.ignore_memory_limit", "search.max_pipeline_model_parallel_size",
               "search.max_virtual_pipeline_model_parallel_size", "search.per_stage_recompute",
               "search.what_if_schedules", "search.reference", "output", "profile")
"""What `megapipe plan --help` lists (:mod:`megapipe.config.keys`)."""
FILES = PLAN_DIR_FILES


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanInputs:
    scenario: Scenario
    """Searched dimensions free; ``scenario.fixed`` holds what the search keeps."""
    search: SearchOptions
    output: OutputOptions
    inputs: dict
    """The resolved config, recorded in plan.yaml."""
    profile: Profile | None = None
    """The measured profile (``profile=FILE``), checked against the model."""


_LAYER_COST_DIMS = ("tensor_model_parallel_size", "context_parallel_size", "sequence_parallel", "micro_batch_size",
                    "recompute_granularity")


def prepare(cfg: DictConfig) -> PlanInputs:
    scenario = to_scenario(cfg, search=True)
    path = cfg.get("profile")
    return PlanInputs(scenario=scenario, search=search_options(cfg), output=output_options(cfg),
                      inputs=recorded_inputs(cfg), profile=matched_profile(scenario, path) if path else None)


def _fixed(job: PlanInputs) -> dict:
    """What the search keeps: the user's dimensions, and with a measured profile the ones its costs depend on."""
    scenario = job.scenario
    fixed = dict(scenario.fixed)
    if job.profile is not None:  # a profile holds costs for one TP/CP/SP/micro-batch/recompute
        for key in _LAYER_COST_DIMS:
            source = scenario.train if key in ("micro_batch_size", "recompute_granularity") else scenario.parallel
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


def _picture_files(directory: str, result: SearchResult) -> tuple[str, ...]:
    """The pictures :func:`_pictures` draws: the Gantt chart needs the best plan's simulation."""
    names = (GANTT_FILE,) if result.best.simulation is not None else ()
    return tuple(os.path.join(directory, name) for name in (*names, MEMORY_FILE))


def _pictures(directory: str, result: SearchResult, *, model_name: str, cluster) -> None:
    """Hand the memory chart and the Gantt chart to the painter (:mod:`megapipe.commands.painter`)."""
    from megapipe.report.gantt import gantt_png
    from megapipe.report.plots import memory_chart

    best = result.best
    gpus = gpus_by_name(cluster, best.stage_gpus) if best.stage_gpus else (cluster.gpu,) * len(best.stages)
    usable = [gpu.usable_memory_bytes / GIB for gpu in gpus]
    painter.draw(memory_chart, best, os.path.join(directory, MEMORY_FILE), baseline=result.baseline,
                 usable_gib=usable[0] if len(set(usable)) == 1 else usable)
    if best.simulation is not None:
        par, sim = best.parallel, best.simulation
        painter.draw(gantt_png, sim, os.path.join(directory, GANTT_FILE), title=(
            f"{model_name}, {best.schedule} TP{par.tensor_model_parallel_size} PP{par.pipeline_model_parallel_size} "
            f"VP{par.virtual_pipeline_model_parallel_size}, {best.num_microbatches} microbatches: pipeline "
            f"{sim.step_time_ms:,.0f} ms, bubble {sim.bubble_fraction:.1%}; layout {best.layout}"))


def run(job: PlanInputs, *, directory: str) -> None:
    scenario = job.scenario
    result = _progress_search(model=scenario.model, cluster=scenario.cluster, train=scenario.train, fixed=_fixed(job),
                              options=job.search, profile=job.profile,
                              use_distributed_optimizer=scenario.parallel.use_distributed_optimizer,
                              microbatch_group_size_per_vp_stage=scenario.parallel.microbatch_group_size_per_vp_stage,
                              template=scenario.parallel)
    if not job.output.json:  # the answer first: the files below take a while to write
        console().print(_plans_table(result, scenario=scenario, reference=job.search.reference))
    if job.output.pictures:  # the painter draws them while the plan is written and printed
        _pictures(directory, result, model_name=scenario.model.name, cluster=scenario.cluster)
    extra = {"seq_length_source": scenario.seq_length_source}
    written = write_plan(directory, result=result, model=scenario.model, cluster=scenario.cluster, inputs=job.inputs,
                         bridge_keys=job.output.bridge_keys, extra=extra)
    emitted, nodes = written.emission.emitted, written.emission.nodes
    files = written.files + (_picture_files(directory, result) if job.output.pictures else ())
    if job.output.json:
        print_json({**json_summary(result, moe=scenario.model.is_moe), "plan_dir": directory,
                    "files": list(files), **extra, **({"node_gpus": list(nodes)} if nodes else {}),
                    "emitted": emitted.as_dict() if emitted else None,
                    "launch": _launch_line(scenario.cluster, emitted) if emitted else None})
    else:
        print_plans(result, scenario=scenario, reference=job.search.reference, emitted=emitted, directory=directory,
                    files=files, nodes=nodes, table=False)


def _launch_line(cluster: ClusterSpec, emitted) -> str:
    return launch_line(emitted, gpus_per_node=cluster.gpus_per_node, num_nodes=cluster.num_nodes)


def _row(label: str, plan, *, moe: bool = False) -> list[str]:
    par, train = plan.parallel, plan.train
    shape = (f"{par.tensor_model_parallel_size}/{par.pipeline_model_parallel_size}/{par.data_parallel_size}/"
             f"{par.context_parallel_size}/{par.virtual_pipeline_model_parallel_size}"
             + ("+SP" if par.sequence_parallel and par.tensor_model_parallel_size > 1 else ""))
    if moe:  # expert parallelism: EP and the experts' TP
        shape += f" EP{par.expert_model_parallel_size} ETP{par.expert_tp}"
    peak = max(stage.total_bytes for stage in plan.stages) / GIB
    recompute = "/".join(plan.stage_recompute) if plan.stage_recompute else train.recompute_granularity.value
    schedule = f"{plan.schedule} (what-if)" if plan.what_if else str(plan.schedule)
    row = [label, shape, schedule, str(train.micro_batch_size), recompute]
    if moe:
        row.append(runtime_label(par.features))
    return row + [f"{plan.step_time_s:.3g}", f"{plan.tokens_per_s_per_gpu:,.0f}",
                  f"{plan.mfu:.1%}", f"{plan.bubble_fraction:.1%}", f"{peak:.1f}" + ("" if plan.feasible else "!"),
                  f"${plan.cost_per_million_tokens:.3f}"]


def runtime_label(features) -> str:
    """A MoE plan's runtime in a few letters: dispatcher, +ovl (EP overlap), +cg (CUDA graphs)."""
    short = {"alltoall": "a2a", "allgather": "ag", "deepep": "deepep", "hybridep": "hybridep"}[features.dispatcher]
    return (short + ("+ovl" if features.overlap_moe_expert_parallel_comm else "")
            + ("+cg" if features.cuda_graphs else ""))


def moe_assumptions(plan, runtime: RuntimeSpec) -> str:
    """What a MoE plan assumes about routing and its runtime (the cluster's), and what megapipe does not model, in
    two lines."""
    features, train = plan.parallel.features, plan.train
    dispatcher = {"alltoall": "alltoall (NCCL all-to-all)", "allgather": "allgather",
                  "deepep": "flex/DeepEP (one copy per node)", "hybridep": "flex/HybridEP (one copy per node)"}
    graphs = (f"{features.cuda_graph_impl} graphs of {' '.join(features.cuda_graph_scope) or 'whole layers'}"
              if features.cuda_graphs else "no CUDA graphs")
    if features.moe_router_force_load_balancing:
        routing = "forced balance (benchmarking: the router's choice is ignored)"
    elif train.moe_load_imbalance != runtime.moe_dropless_imbalance:
        routing = f"busiest EP rank {train.moe_load_imbalance:.2f}x the mean tokens (train.moe_load_imbalance)"
    else:
        routing = (f"dropless aux-loss routing, busiest EP rank {train.moe_load_imbalance:.2f}x the mean tokens "
                   "(runtime.moe_dropless_imbalance, fitted on published forced-vs-dropless runs; set "
                   "train.moe_load_imbalance)")
    overlap = ("EP all-to-all overlapped with the other microbatch" + (" and delayed weight gradients"
               if features.delay_wgrad_compute else "")) if features.overlap_moe_expert_parallel_comm else "no EP overlap"
    if features.moe_shared_expert_overlap:
        overlap += ", shared experts under the dispatch"
    fused = [name for name, on in (("permute", features.moe_permute_fusion), ("router", features.moe_router_fusion)) if on]
    return (f"MoE runtime: dispatcher {dispatcher[features.dispatcher]}, {overlap}, {graphs}, "
            f"{' and '.join(fused) + ' fusion' if fused else 'no fusions'}; routing: {routing}.\n"
            "not modelled: token dropping and capacity factors, FP8 dispatch, the memory of CUDA-graph pools and of "
            "DeepEP/HybridEP buffers, per-expert load skew inside a rank")


def compare_line(best, reference, source) -> str:
    """What changed from a published configuration (``search.reference``) to the best plan, and where the time went."""
    par = reference.parallel
    peak = lambda plan: max(stage.total_bytes for stage in plan.stages) / GIB  # noqa: E731
    reported = (f"reported {source.reported_tokens_per_s_per_gpu:,.0f} tok/s/GPU; "
                if source.reported_tokens_per_s_per_gpu else "")
    return (
        f"vs {source.label} (TP={par.tensor_model_parallel_size} PP={par.pipeline_model_parallel_size} "
        f"DP={par.data_parallel_size}; {reported}megapipe predicts {reference.tokens_per_s_per_gpu:,.0f}): best plan "
        f"{best.tokens_per_s / reference.tokens_per_s - 1:+.1%}; "
        f"bubble {reference.bubble_fraction:.1%} -> {best.bubble_fraction:.1%}, pipeline "
        f"{reference.pipeline_ms / 1e3:.2f} -> {best.pipeline_ms / 1e3:.2f} s, DP sync "
        f"{reference.dp_sync_ms / 1e3:.2f} -> {best.dp_sync_ms / 1e3:.2f} s, optimizer "
        f"{reference.optimizer_ms / 1e3:.2f} -> {best.optimizer_ms / 1e3:.2f} s, peak memory "
        f"{peak(reference):.1f} -> {peak(best):.1f} GiB"
    )


def breakdown_line(plan) -> str:
    """Where the plan's step goes, largest first: ``gemm 9.18 s (67%), ...``."""
    total = sum(ms for _, ms in plan.breakdown) or 1.0
    parts = sorted((item for item in plan.breakdown if item[1] > 0), key=lambda item: -item[1])
    return ", ".join(f"{name.replace('_', ' ')} {ms / 1e3:.2f} s ({ms / total:.0%})" for name, ms in parts)


def _pruned(stats) -> str:
    return ", ".join(f"{reason} {count:,}" for reason, count in stats.pruned) or "none"


def print_plans(result: SearchResult, *, scenario: Scenario, reference: Reference | None = None, emitted=None,
                directory: str, files: tuple[str, ...] = (), nodes: tuple[str, ...] = (), table: bool = True) -> None:
    """The ranked plans, the equal split and the reference (``search.reference``) in one table (``table=False``:
    printed already); then what to run and where the files are."""
    out = console()
    if table:
        out.print(_plans_table(result, scenario=scenario, reference=reference))
    _print_notes(out, result, scenario=scenario, emitted=emitted, nodes=nodes)
    best = result.best
    if result.baseline is not None:
        gain = best.tokens_per_s / result.baseline.tokens_per_s - 1
        fits = "" if result.baseline.feasible else (
            f" (the equal split does not fit memory: {result.baseline.memory_over_gib:.1f} GiB over on its fullest "
            "stage, so it could not run as shown)")
        out.print(f"gain over equal split: {gain:+.1%}{fits}")
    if result.reference is not None and reference is not None:
        out.print(compare_line(best, result.reference, reference), markup=False)
    _print_files(out, best, cluster=scenario.cluster, emitted=emitted, directory=directory, files=files)
    stats = result.stats
    out.print(f"searched {stats.enumerated:,} candidates{_virtual_searched(stats)}, simulated {stats.simulated}, "
              f"pruned {_pruned(stats)} in {stats.seconds:.2f} s")


def _virtual_searched(stats) -> str:
    """The VP values the search tried, as ranges (``VP 1-41``), or nothing when it tried none beyond 1."""
    values = stats.virtual_sizes
    if not values or tuple(values) == (1,):
        return ""
    runs, first, last = [], values[0], values[0]
    for value in values[1:]:
        if value == last + 1:
            last = value
            continue
        runs.append(f"{first}-{last}" if last > first else f"{first}")
        first = last = value
    runs.append(f"{first}-{last}" if last > first else f"{first}")
    return f" (VP {', '.join(runs)})"


def _plans_table(result: SearchResult, *, scenario: Scenario, reference: Reference | None):
    """The ranked plans, the run's plan when megatron-core cannot run the first, the equal split and the reference."""
    from rich.table import Table

    train, model, cluster = scenario.train, scenario.model, scenario.cluster
    title = (f"megapipe plan: {model.name} on {gpus_phrase(cluster)}"
             + f", seq_length {train.seq_length:,} ({scenario.seq_length_source}), global batch "
             f"{train.global_batch_size:,} ({train.global_batch_size * train.seq_length / 1e6:,.1f}M tokens), "
             f"{train.precision}")
    table = Table(title=title, title_justify="left")
    moe = model.is_moe
    row = lambda label, plan: _row(label, plan, moe=moe)  # noqa: E731
    columns = ["", "TP/PP/DP/CP/VP" + (" EP ETP" if moe else ""), "schedule", "mbs", "recompute"]
    interval = result.best.step_time_interval
    step = "step s" + (f"\n{interval[0]:+.0%}/{interval[1]:+.0%}" if interval else "")
    columns += (["MoE runtime"] if moe else []) + [step, "tok/s/GPU", "MFU" + ("¹" if train.precision == "fp8" else ""),
                                                    "pipeline\nbubble²", "peak GiB", "$/1M tok"]
    for name in columns:
        table.add_column(name, overflow="fold")
    best = result.best
    for index, plan in enumerate(result.plans, start=1):
        table.add_row(*row(f"#{index}" + ("*" if plan is best and best is not result.plans[0] else ""), plan))
    if best not in result.plans:
        table.add_row(*row("run*", best))
    if result.baseline is not None:
        table.add_row(*row("equal split", result.baseline))
    if result.reference is not None and reference is not None:
        table.add_row(*row(reference.label, result.reference))
    return table


def _print_notes(out, result: SearchResult, *, scenario: Scenario, emitted, nodes: tuple[str, ...]) -> None:
    """The table's footnotes, the layout, where the step goes, the MoE assumptions and every warning."""
    best, cluster = result.best, scenario.cluster
    shown = [*result.plans, result.baseline, result.reference]
    if any(plan is not None and not plan.feasible for plan in shown):
        out.print("! does not fit memory: shown to compare, not to run", markup=False)
    if best is not result.plans[0]:
        out.print("* the plan to run: the best one megatron-core runs; the what-if plans above it use schedules it "
                  "does not have", markup=False)
    if scenario.train.precision == "fp8":
        out.print("¹ MFU: model FLOPs over the GPUs' dense BF16 peak, for FP8 plans too",
                  markup=False)
    out.print("² pipeline bubble: the share of the pipeline's time its ranks sit idle (fill, drain, uneven stages); "
              "the step line's bubble is that idle time as a share of the whole step", markup=False)
    out.print(f"layout: {best.layout}", markup=False)
    if best.breakdown:
        out.print(f"step {format_interval(best.step_time_s, best.step_time_interval)}: {breakdown_line(best)}",
                  markup=False, soft_wrap=True)
    if best.step_time_interval:
        out.print("(the step's range: where 80% of published runs of its kind fell, held out by source, against "
                  "their prediction; docs/validation.md)", markup=False)
    if scenario.model.is_moe:
        out.print(moe_assumptions(best, cluster.runtime), markup=False, soft_wrap=True)
    for warning in (*best.warnings, *(emitted.warnings if emitted else ())):
        out.print(f"warning: {warning}", markup=False, soft_wrap=True)
    if nodes:
        out.print(f"node ranks and their GPU type (start node rank n on such a node): {node_ranges(nodes)}",
                  markup=False)


def _print_files(out, best, *, cluster, emitted, directory: str, files: tuple[str, ...]) -> None:
    """The Megatron-LM command, or why there is none, and the plan directory's files."""
    names = ", ".join(os.path.basename(path) for path in files) + ", .hydra/ (the run's config)"
    if emitted is None:
        out.print(f"what-if: megatron-core cannot run {best.schedule}, so no Megatron arguments were written; plan "
                  "with schedule=1f1b or interleaved_1f1b for a plan to run", markup=False)
        out.print(f"files in {directory}: {names}", markup=False, soft_wrap=True)
        return
    out.print(f"Megatron-LM: {_launch_line(cluster, emitted)}", markup=False, soft_wrap=True)
    keys = ("flat model.* keys (0.6.x)" if emitted.bridge_keys == BridgeKeys.flat
            else "model.transformer.* keys (Bridge main)")
    out.print(f"files in {directory}: {names}; the Megatron-Bridge overrides use {keys}; add data, tokenizer and "
              "schedule flags to the arguments", markup=False, soft_wrap=True)
