"""Predict a published run's step time with megapipe's model: the run's cluster, its settings, its split.

1. :func:`run_cluster` sizes the run's cluster option to its GPU count and applies a runtime.
2. :func:`resolve` fills the settings the source leaves unstated (micro-batch size, virtual
   pipeline size, sequence parallelism, recompute) with the planner's best choice among them,
   every stated setting fixed, with the *uncalibrated* runtime: the choice never sees a
   measurement, so a leave-one-out error stays honest. A virtual pipeline size is kept only if it
   splits the layers evenly, as Megatron's default split needs. When nothing fits in memory (the run
   did fit, with means megapipe does not model), the choice is the one closest to fitting, and the run
   is marked as not fitting.
3. :func:`predict` evaluates the resolved run as it ran: Megatron's equal split of the decoder
   layers, 1F1B or interleaved 1F1B, without a memory check; whether it fits is reported apart.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from megapipe.errors import InfeasibleError, MegapipeError
from megapipe.plan.evaluator import Evaluator
from megapipe.plan.plans import Candidate, Plan
from megapipe.options import SearchOptions
from megapipe.plan.search import search
from megapipe.records import ClusterSpec, NodeGroup, ParallelSpec, RuntimeSpec, TrainSpec
from megapipe.schedules import megatron_schedule
from megapipe.validation.runs import PublishedRun

__all__ = ["Resolved", "run_cluster", "resolve", "predict", "predict_step_s", "predict_step_parts", "predict_times",
           "candidate_of"]

_MAX_VIRTUAL = 16
"""Interleaving depths tried for a run that does not state its own (published runs go down to one layer per chunk)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Resolved:
    """A run with its unstated settings chosen."""

    run: PublishedRun
    parallel: ParallelSpec
    train: TrainSpec
    chosen: tuple[tuple[str, object], ...] = ()
    """The unstated settings and the values the planner chose for them."""
    memory_over_gib: float = 0.0
    """How far megapipe's memory model puts the run's fullest rank over its usable memory (0: it fits)."""
    layout: str = ""
    """The run's own pipeline_model_parallel_layout (a monitored run); empty: Megatron's default equal split."""

    @property
    def fits(self) -> bool:
        """Whether megapipe's memory model says the run, as resolved, fits its GPUs."""
        return self.memory_over_gib == 0.0


def run_cluster(run: PublishedRun, base: ClusterSpec, runtime: RuntimeSpec | None = None) -> ClusterSpec:
    """``base`` (the run's cluster option) with the run's node count and GPUs per node, and ``runtime``."""
    nodes, rest = divmod(run.num_gpus, run.gpus_per_node)
    gpus_per_node = run.gpus_per_node if not rest else run.num_gpus
    group = NodeGroup(gpu=base.gpu, num_nodes=nodes if not rest else 1)
    scale_up = base.scale_up_gpus if base.scale_up_gpus % gpus_per_node == 0 else 0
    return dataclasses.replace(base, gpus_per_node=gpus_per_node, node_groups=(group,), scale_up_gpus=scale_up,
                               runtime=runtime or base.runtime)


def _schedule(parallel: ParallelSpec) -> str:
    """What megatron-core runs for the run's sizes (interleaving needs pipelining)."""
    chunks = parallel.virtual_pipeline_model_parallel_size if parallel.pipeline_model_parallel_size > 1 else 1
    return megatron_schedule(chunks)


def candidate_of(parallel: ParallelSpec, train: TrainSpec) -> Candidate:
    return Candidate(parallel=parallel, train=train, schedule=_schedule(parallel))


def _fixed(run: PublishedRun) -> dict[str, object]:
    par, train = run.parallel, run.train
    fixed = {
        "tensor_model_parallel_size": par.tensor_model_parallel_size,
        "pipeline_model_parallel_size": par.pipeline_model_parallel_size,
        "context_parallel_size": par.context_parallel_size,
        "virtual_pipeline_model_parallel_size": par.virtual_pipeline_model_parallel_size,
        "sequence_parallel": par.sequence_parallel,
        "micro_batch_size": train.micro_batch_size,
        "recompute_granularity": train.recompute_granularity,
    }
    for name in run.unknown:
        fixed.pop(name, None)
    if "virtual_pipeline_model_parallel_size" in fixed:
        fixed["schedule"] = _schedule(par)
    elif run.schedule:
        fixed["schedule"] = run.schedule  # interleaved, depth unstated: the planner picks v >= 2
    return fixed


def _prepare(evaluator: Evaluator, cand: Candidate, layout: str = ""):
    """The run's own layout when it has one; else Megatron's default equal split, and where the decoders cannot
    fill the stages equally (the run gave a layout with the embedding and loss in stages of their own),
    megapipe's optimal split stands in."""
    return _prepared_split(evaluator, cand, layout)[0]


def _prepared_split(evaluator: Evaluator, cand: Candidate, layout: str = ""):
    """(:func:`_prepare`'s candidate, its split as (entries per stage, stage ranks) when the split does not depend
    on the layer times (the run's layout, or the equal split), else None)."""
    if layout:
        prepared = evaluator.prepare(cand, layout=layout, check_memory=False)
    else:
        try:
            prepared = evaluator.prepare(cand, method="equal", check_memory=False)
        except InfeasibleError:
            return evaluator.prepare(cand, method="optimal", check_memory=False), None
    part = prepared.partition
    return prepared, (part.entries_per_stage, part.stage_to_rank)


def _evaluate(evaluator: Evaluator, cand: Candidate, layout: str = "") -> Plan:
    return evaluator.finish(_prepare(evaluator, cand, layout))


def _over_gib(run: PublishedRun, cluster: ClusterSpec, parallel: ParallelSpec, train: TrainSpec,
              layout: str = "") -> float:
    """GiB the run's fullest rank needs beyond its usable memory, by megapipe's memory model (0: it fits)."""
    evaluator = Evaluator(model=run.model, cluster=cluster, options=SearchOptions(ignore_memory_limit=True))
    return _evaluate(evaluator, candidate_of(parallel, train), layout).memory_over_gib


def _ranked(run: PublishedRun, cluster: ClusterSpec, *, ignore_memory: bool) -> list[Plan]:
    """The planner's plans with the run's stated settings fixed; even splits first (Megatron's default split)."""
    layers, pp = run.model.num_layers, run.parallel.pipeline_model_parallel_size
    options = SearchOptions(top_k=64, micro_batch_sizes=(1, 2, 4, 8, 16), ignore_memory_limit=ignore_memory,
                            max_virtual_pipeline_model_parallel_size=_MAX_VIRTUAL)
    try:
        result = search(model=run.model, cluster=cluster, train=run.train, fixed=_fixed(run), options=options,
                        use_distributed_optimizer=run.parallel.use_distributed_optimizer, template=run.parallel)
    except MegapipeError:
        return []
    # Nothing fits: the run did, so the settings closest to fitting are the likeliest (then the fastest of them).
    plans = sorted(result.plans, key=lambda plan: (plan.memory_over_gib, plan.step_time_s)) if ignore_memory \
        else list(result.plans)
    even = [plan for plan in plans if layers % (pp * plan.parallel.virtual_pipeline_model_parallel_size) == 0]
    return even or plans


def resolve(run: PublishedRun, base: ClusterSpec) -> Resolved:
    """The run with its unknown settings chosen by the planner on the uncalibrated runtime."""
    cluster = run_cluster(run, base, RuntimeSpec())
    if not run.unknown:
        return Resolved(run=run, parallel=run.parallel, train=run.train, layout=run.layout,
                        memory_over_gib=_over_gib(run, cluster, run.parallel, run.train, run.layout))
    plans = _ranked(run, cluster, ignore_memory=False) or _ranked(run, cluster, ignore_memory=True)
    if not plans:
        return Resolved(run=run, parallel=run.parallel, train=run.train, memory_over_gib=math.inf,
                        chosen=tuple((name, "no plan") for name in run.unknown))
    best: Plan = plans[0]
    parallel = dataclasses.replace(run.parallel, virtual_pipeline_model_parallel_size=best.parallel.virtual_pipeline_model_parallel_size,
                                   sequence_parallel=best.parallel.sequence_parallel,
                                   tp_comm_overlap=run.parallel.tp_comm_overlap and best.parallel.sequence_parallel)
    train = dataclasses.replace(run.train, micro_batch_size=best.train.micro_batch_size,
                                recompute_granularity=best.train.recompute_granularity)
    values = {"micro_batch_size": train.micro_batch_size,
              "virtual_pipeline_model_parallel_size": parallel.virtual_pipeline_model_parallel_size,
              "sequence_parallel": parallel.sequence_parallel,
              "recompute_granularity": train.recompute_granularity.value}
    return Resolved(run=run, parallel=parallel, train=train, chosen=tuple((name, values[name]) for name in run.unknown),
                    layout=run.layout, memory_over_gib=_over_gib(run, cluster, parallel, train, run.layout))


def predict(resolved: Resolved, cluster: ClusterSpec, *, schedules: dict | None = None) -> Plan:
    """The resolved run evaluated on ``cluster`` (sized by :func:`run_cluster`): equal split, no memory check.

    ``schedules`` caches the built (and lowered) schedule across calls, as a fit re-prices one run many times.
    """
    evaluator, cand = _evaluator_of(resolved, cluster, schedules)
    return _evaluate(evaluator, cand, resolved.layout)


def predict_step_s(resolved: Resolved, cluster: ClusterSpec, *, schedules: dict | None = None) -> float:
    """:func:`predict`'s step time alone, seconds (what a fit evaluates many times)."""
    evaluator, cand = _evaluator_of(resolved, cluster, schedules)
    return evaluator.step_time_s(_prepare(evaluator, cand, resolved.layout))


def predict_step_parts(resolved: Resolved, cluster: ClusterSpec, *, schedules: dict | None = None,
                       split: tuple | None = None) -> tuple[tuple[float, float, float], tuple | None]:
    """:func:`predict_step_s` before the per-step overhead: ((pipeline, DP sync, optimizer) ms, the run's split
    when it does not depend on the layer times); :func:`megapipe.plan.evaluator.step_seconds` adds the overhead.
    ``split``: that split from an earlier call, so the run is priced without partitioning it again."""
    evaluator, cand = _evaluator_of(resolved, cluster, schedules)
    if split is not None:
        return evaluator.split_step_parts_ms(cand, *split), split
    prepared, split = _prepared_split(evaluator, cand, resolved.layout)
    return evaluator.step_parts_ms(prepared), split


def predict_times(resolved: Resolved, cluster: ClusterSpec, *, schedules: dict | None = None
                  ) -> tuple[float, tuple[float, ...]]:
    """(step time s, each layout stage's forward + backward per microbatch ms, framework time included):
    what a monitored run measures."""
    evaluator, cand = _evaluator_of(resolved, cluster, schedules)
    prepared = _prepare(evaluator, cand, resolved.layout)
    times = prepared.times
    return evaluator.step_time_s(prepared), tuple(f + b for f, b in zip(times.fwd_ms, times.bwd_ms))


def _evaluator_of(resolved: Resolved, cluster: ClusterSpec, schedules: dict | None) -> tuple[Evaluator, Candidate]:
    evaluator = Evaluator(model=resolved.run.model, cluster=cluster, options=SearchOptions(ignore_memory_limit=True),
                          schedules=schedules)
    train = resolved.train
    if train.moe_load_imbalance is None and resolved.run.model.is_moe:  # dropless routing, imbalance not stated
        train = dataclasses.replace(train, moe_load_imbalance=cluster.runtime.moe_dropless_imbalance)
    return evaluator, candidate_of(resolved.parallel, train)
