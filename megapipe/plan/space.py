"""The search space: every TP x CP x PP x DP x VP x micro-batch x recompute x SP x schedule
that uses all GPUs, with closed-form pruning before any layer is costed. With
``search.per_stage_recompute`` each layout with one chunk per rank also gets a candidate whose
ranks pick their recompute settings with the split (:mod:`megapipe.plan.per_stage_recompute`).

Pruning rules, each counted under its reason:

- ``divisibility``: Megatron's shape rules. TP divides num_attention_heads and
  num_query_groups; TP divides gpus_per_node (TP all-reduces every layer, so it stays on
  NVLink unless allowed); 2*CP divides seq_length (Megatron's load-balanced ring attention
  splits the sequence in 2*CP chunks); every virtual stage holds at least one decoder layer,
  but the first and last may hold only the embedding or only the loss
  (:func:`megapipe.layout.max_stages`; Megatron-LM #1852: empty stages deadlock).
- ``microbatches``: global_batch_size must be a multiple of micro_batch_size * DP; the
  interleaved schedule needs num_microbatches to be a multiple of PP (megatron-core 0.16
  ``forward_backward_pipelining_with_interleaving`` with the default
  microbatch_group_size_per_vp_stage = PP); the V-shaped schedules need num_microbatches >= 2*PP
  (ZB-V, Qi et al. 2024; DualPipe) to reach their steady state.

Candidates are enumerated as :class:`Point` tuples; the search builds a
:class:`~megapipe.plan.plans.Candidate` only for the few it partitions, since most are
pruned by closed forms first. Memory pruning needs layer costs and lives in
:mod:`megapipe.plan.search`.
"""

from __future__ import annotations

from collections import Counter
import operator
from collections.abc import Iterator, Mapping
import dataclasses
from dataclasses import dataclass, field
from typing import NamedTuple

from megapipe.errors import ConfigError
from megapipe.layout import max_stages
from megapipe.plan.plans import Candidate
from megapipe.options import SearchOptions
from megapipe.features import SEARCHED, feature_problem, feature_variants, problem_sizes
from megapipe.records import (
    SEARCH_DIMENSIONS,
    ClusterSpec,
    ModelSpec,
    ParallelSpec,
    Recompute,
    RuntimeFeatures,
    TrainSpec,
)
from megapipe.schedules import MEGATRON_SCHEDULES, SCHEDULE_NAMES, ScheduleName, spec

__all__ = ["DIMENSIONS", "Point", "LAYER_SIZES", "Space", "divisors", "enumerate_candidates", "pinned_problem"]

DIMENSIONS = SEARCH_DIMENSIONS
"""The searched dimensions; data_parallel_size is what is left of the GPUs."""

_RECOMPUTE = (Recompute.none, Recompute.selective, Recompute.full)


class Point(NamedTuple):
    """One candidate as a plain tuple: what the closed-form bounds read, without building records."""

    tensor_model_parallel_size: int
    context_parallel_size: int
    pipeline_model_parallel_size: int
    data_parallel_size: int
    virtual_pipeline_model_parallel_size: int
    micro_batch_size: int
    recompute_granularity: Recompute
    sequence_parallel: bool
    schedule: str
    per_stage_recompute: bool
    num_microbatches: int
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int = 0
    """0 for dense models (Megatron's default, TP)."""
    features: RuntimeFeatures = RuntimeFeatures()
    """The runtime features (dispatcher, overlap, CUDA graphs) of this point."""


LAYER_SIZES = operator.itemgetter(0, 1, 5, 6, 7, 11, 12)
"""A point's sizes that its units' costs read (TP, CP, micro-batch, recompute, SP, EP, ETP): with the features, its
layer key."""


def divisors(number: int) -> tuple[int, ...]:
    return tuple(d for d in range(1, number + 1) if number % d == 0)


@dataclass(frozen=True, slots=True, kw_only=True)
class Space:
    """Enumerated points that pass the shape rules and what was pruned, by reason."""

    points: tuple[Point, ...]
    pruned: Counter
    enumerated: int
    train: TrainSpec
    """global_batch_size, seq_length and precision of every candidate."""
    use_distributed_optimizer: bool = True
    microbatch_group_size_per_vp_stage: int | None = None
    """Megatron's interleaving group (``parallel.microbatch_group_size_per_vp_stage``); P when None."""
    template: ParallelSpec = ParallelSpec()
    """Where the settings the search does not vary come from: tp_comm_overlap, the DP overlap flags, Megatron FSDP."""
    groups: tuple[tuple[int, int, tuple[RuntimeFeatures, ...]], ...] = ()
    """(start, stop, feature sets) of each run of points equal but for their runtime features, in order; runs of
    equal feature sets share one tuple."""
    _records: dict = field(default_factory=dict, compare=False, repr=False)
    """ParallelSpec and TrainSpec records already built, by their fields (points share them), and each Candidate
    built, by its point's id beside the point (tuple keys and int keys never meet)."""

    def candidate(self, point: Point) -> Candidate:
        """The record of one point (the same record each time a point of this space is asked about: a search asks
        for its memory test, its bound, its memory floor and its partition)."""
        known = self._records.get(id(point))
        if known is not None and known[0] is point:
            return known[1]
        made = self._candidate(point)
        self._records[id(point)] = (point, made)
        return made

    def _candidate(self, point: Point) -> Candidate:
        parallel_key, train_key = point[:5] + point[7:8] + point[11:14], point[5:7]
        parallel = self._records.get(parallel_key)
        if parallel is None:
            parallel = self._records[parallel_key] = ParallelSpec(
                tensor_model_parallel_size=point.tensor_model_parallel_size,
                pipeline_model_parallel_size=point.pipeline_model_parallel_size,
                virtual_pipeline_model_parallel_size=point.virtual_pipeline_model_parallel_size,
                context_parallel_size=point.context_parallel_size, data_parallel_size=point.data_parallel_size,
                sequence_parallel=point.sequence_parallel, use_distributed_optimizer=self.use_distributed_optimizer,
                microbatch_group_size_per_vp_stage=(self.microbatch_group_size_per_vp_stage
                                                    if point.virtual_pipeline_model_parallel_size > 1 else None),
                tp_comm_overlap=self.template.tp_comm_overlap and point.sequence_parallel,
                overlap_grad_reduce=self.template.overlap_grad_reduce,
                overlap_param_gather=self.template.overlap_param_gather,
                use_megatron_fsdp=self.template.use_megatron_fsdp,
                data_parallel_sharding_strategy=self.template.data_parallel_sharding_strategy,
                expert_model_parallel_size=point.expert_model_parallel_size,
                expert_tensor_parallel_size=point.expert_tensor_parallel_size,
                features=point.features,
            )
        spec = self._records.get(train_key)
        if spec is None:
            train = self.train
            spec = self._records[train_key] = dataclasses.replace(
                train, micro_batch_size=point.micro_batch_size, recompute_granularity=point.recompute_granularity)
        return Candidate(parallel=parallel, train=spec, schedule=point.schedule,
                         per_stage_recompute=point.per_stage_recompute)

    @property
    def candidates(self) -> tuple[Candidate, ...]:
        """Every point as a Candidate (built on each access)."""
        return tuple(self._candidate(point) for point in self.points)


def _values(fixed: Mapping[str, object], name: str, default: tuple) -> tuple:
    return (fixed[name],) if name in fixed else default


def _check_fixed(fixed: Mapping[str, object], options: SearchOptions) -> None:
    unknown = set(fixed) - set(DIMENSIONS) - {"data_parallel_size", "num_microbatches"}
    if unknown:
        raise ConfigError(f"cannot fix {sorted(unknown)}; searchable dimensions are {list(DIMENSIONS)}")
    schedule = fixed.get("schedule")
    if schedule is not None and schedule not in SCHEDULE_NAMES:
        raise ConfigError(f"schedule={schedule!r} is unknown; use one of {', '.join(SCHEDULE_NAMES)} or all")


def pinned_problem(*, model: ModelSpec, cluster: ClusterSpec, fixed: Mapping[str, object],
                   options: SearchOptions, global_batch_size: int = 0) -> str | None:
    """Why Megatron's shape rules reject a pinned tensor-parallel size for this model on this cluster, in one
    line naming the fix; None when they do not."""
    microbatches = _microbatches_problem(cluster, fixed, global_batch_size)
    if microbatches:
        return microbatches
    tp = fixed.get("tensor_model_parallel_size")
    if tp is None:
        return None
    tp = int(tp)
    if model.num_attention_heads % tp or model.num_query_groups % tp:
        valid = [d for d in divisors(model.num_query_groups) if model.num_attention_heads % d == 0]
        return (f"parallel.tensor_model_parallel_size={tp} does not divide {model.name}'s "
                f"{model.num_attention_heads} attention heads and {model.num_query_groups} query groups; use one of "
                f"{valid}")
    if not options.allow_cross_node_tp and cluster.domain_gpus % tp:
        return (f"parallel.tensor_model_parallel_size={tp} spans NVLink domains of {cluster.domain_gpus} GPUs; use a "
                f"divisor of {cluster.domain_gpus} or search.allow_cross_node_tp=true")
    return None


def _microbatches_problem(cluster: ClusterSpec, fixed: Mapping[str, object], batch: int) -> str | None:
    """Why a pinned train.num_microbatches cannot hold with the pinned micro-batch size and DP (Megatron derives
    it: global batch / (micro-batch x DP)); None when it can, or when the search still picks mbs or DP."""
    if not batch or "num_microbatches" not in fixed or "micro_batch_size" not in fixed:
        return None
    sizes = [fixed.get(key) for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size")]
    dp = fixed.get("data_parallel_size")
    if dp is None and None not in sizes:
        dp = cluster.num_gpus // (int(sizes[0]) * int(sizes[1]) * int(fixed.get("context_parallel_size") or 1))
    if dp is None:
        return None
    m, mbs = int(fixed["num_microbatches"]), int(fixed["micro_batch_size"])
    if batch == m * mbs * int(dp):
        return None
    return (f"train.num_microbatches={m} cannot hold: Megatron derives global_batch_size / (micro_batch_size x DP) = "
            f"{batch} / ({mbs} x {dp}) = {batch / (mbs * int(dp)):g}; set train.global_batch_size={m * mbs * int(dp)} "
            "for it, or leave train.num_microbatches null")


def _tp_values(model: ModelSpec, cluster: ClusterSpec, fixed: Mapping, options: SearchOptions) -> tuple[int, ...]:
    if "tensor_model_parallel_size" in fixed:
        return (int(fixed["tensor_model_parallel_size"]),)
    limit = cluster.num_gpus if options.allow_cross_node_tp else cluster.domain_gpus
    return tuple(d for d in divisors(limit) if d <= model.num_attention_heads)


def _tp_ok(tp: int, model: ModelSpec, cluster: ClusterSpec, options: SearchOptions) -> bool:
    if model.num_attention_heads % tp or model.num_query_groups % tp:
        return False
    return options.allow_cross_node_tp or cluster.domain_gpus % tp == 0


def _cp_values(train_seq: int, fixed: Mapping, options: SearchOptions) -> tuple[int, ...]:
    if "context_parallel_size" in fixed:
        return (int(fixed["context_parallel_size"]),)
    if train_seq < options.context_parallel_min_seq_length:
        return (1,)
    local = options.context_parallel_min_local_seq_length
    return tuple(cp for cp in (1, 2, 4, 8) if cp == 1 or train_seq // cp >= local)


def enumerate_candidates(
    *,
    model: ModelSpec,
    cluster: ClusterSpec,
    train: TrainSpec,
    fixed: Mapping[str, object] | None = None,
    options: SearchOptions = SearchOptions(),
    use_distributed_optimizer: bool = True,
    microbatch_group_size_per_vp_stage: int | None = None,
    template: ParallelSpec = ParallelSpec(),
) -> Space:
    """All points that pass the closed-form rules; ``fixed`` pins dimensions by name.

    ``train`` supplies global_batch_size, seq_length and precision; its micro_batch_size and
    recompute_granularity are used only when fixed.
    """
    fixed = dict(fixed or {})
    _check_fixed(fixed, options)
    problem = pinned_problem(model=model, cluster=cluster, fixed=fixed, options=options,
                             global_batch_size=train.global_batch_size)
    if problem:
        raise ConfigError(problem)
    variants = feature_variants(template.features, model=model, free=frozenset(SEARCHED) - set(fixed))
    world = cluster.num_gpus
    pruned: Counter = Counter()
    out: list[Point] = []
    groups: list[tuple[int, int, tuple]] = []
    enumerated = 0
    refused: dict[tuple, tuple] = {}  # _accepted by the few fields it reads: points repeat them many times
    for tp in _tp_values(model, cluster, fixed, options):
        tp_ok = _tp_ok(tp, model, cluster, options)
        for cp in _cp_values(train.seq_length, fixed, options):
            shape_ok = tp_ok and not (cp > 1 and train.seq_length % (2 * cp))
            for pp in _pp_values(world, tp * cp, model, fixed, options):
                dp = world // (tp * cp * pp)
                experts = _expert_values(model, tp=tp, cp=cp, dp=dp, fixed=fixed)
                if not experts:
                    enumerated += len(variants)
                    pruned["divisibility"] += len(variants)
                    continue
                for point in _inner(model=model, train=train, fixed=fixed, options=options, tp=tp, cp=cp, pp=pp,
                                    dp=dp, shape_ok=shape_ok, group=microbatch_group_size_per_vp_stage):
                    if isinstance(point, str):  # the reason it was pruned
                        enumerated += len(experts) * len(variants)
                        pruned[point] += len(experts) * len(variants)
                        continue
                    for ep, etp in experts:
                        accepted = _accepted(variants, model, point, ep, train, refused)
                        enumerated += len(variants)
                        if len(accepted) < len(variants):
                            pruned["features"] += len(variants) - len(accepted)
                        _append_group(out, groups, point + (ep, etp), accepted)
    if not enumerated:
        raise ConfigError(_no_fit_message(world, fixed))
    return Space(points=tuple(out), pruned=pruned, enumerated=enumerated, train=train, groups=tuple(groups),
                 use_distributed_optimizer=use_distributed_optimizer,
                 microbatch_group_size_per_vp_stage=microbatch_group_size_per_vp_stage, template=template)


def _append_group(out: list[Point], groups: list[tuple[int, int, tuple]], sizes: tuple, accepted: tuple) -> None:
    """Appends a point of ``sizes`` per accepted feature set, and their run to ``groups``."""
    if accepted:
        new = tuple.__new__  # Point._make without its Python frame: ``sizes`` holds every field but the features
        groups.append((len(out), len(out) + len(accepted), accepted))
        out.extend([new(Point, sizes + (features,)) for features in accepted])


def _accepted(variants: tuple[RuntimeFeatures, ...], model: ModelSpec, point: tuple, ep: int, train: TrainSpec,
              memo: dict[tuple, tuple]) -> tuple[RuntimeFeatures, ...]:
    """The searched feature sets megatron-core takes at this point's sizes, in order (it refuses EP overlap at
    PP > 1 without interleaving or with EP 1, CUDA graphs with full recompute, ...); every set when only one is
    searched. ``memo`` holds the answers of one enumeration by the fields read."""
    if len(variants) == 1:
        return variants
    # what the verdict reads: the sizes as feature_problem reads them (at TP 1, as _refusal asks), and recompute
    key = problem_sizes(tensor_model_parallel_size=1, pipeline_model_parallel_size=point[2],
                        virtual_pipeline_model_parallel_size=point[4], expert_model_parallel_size=ep) + (point[6],)
    found = memo.get(key)
    if found is None:
        refused = _refusal(model, point, ep, train)
        found = tuple(features for features in variants if not refused(features))
        found = memo[key] = memo.setdefault(found, found)  # equal sets as one tuple
    return found


def _refusal(model: ModelSpec, point: tuple, ep: int, train: TrainSpec):
    """Whether megatron-core refuses a feature set at this point's sizes (a function of the features)."""
    parallel = ParallelSpec(pipeline_model_parallel_size=point[2], virtual_pipeline_model_parallel_size=point[4],
                            expert_model_parallel_size=ep)
    spec = TrainSpec(recompute_granularity=point[6], precision=train.precision, fp8_recipe=train.fp8_recipe)
    return lambda features: feature_problem(features, model=model, parallel=parallel, train=spec) is not None


def _expert_values(model: ModelSpec, *, tp: int, cp: int, dp: int, fixed: Mapping) -> tuple[tuple[int, int], ...]:
    """(EP, ETP) pairs megatron-core accepts for a MoE model on TP x CP x DP GPUs per pipeline stage.

    ETP is 1 or TP (Megatron's default; :attr:`ParallelSpec.expert_tp`), and 1 with biased experts
    (megatron-core's TransformerConfig: "Bias in Moe is only supported when ETP==1"); it divides the
    expert width. EP divides the expert count, and ETP x EP divides the stage's GPUs: experts fold over
    TP x CP x DP ("parallel folding", megatron-core's expert grid). Dense models: EP 1, ETP unset.
    """
    if not model.is_moe:
        return ((int(fixed.get("expert_model_parallel_size", 1)), 0),) if int(
            fixed.get("expert_model_parallel_size", 1)) == 1 else ()
    biased = model.add_bias_linear if model.add_bias_linear is not None else model.activation == "gelu"
    etps = (1,) if biased else tuple(sorted({1, tp}))
    if "expert_tensor_parallel_size" in fixed:
        etps = (int(fixed["expert_tensor_parallel_size"]),)
    stage = tp * cp * dp
    eps = divisors(model.num_moe_experts)
    if "expert_model_parallel_size" in fixed:
        eps = (int(fixed["expert_model_parallel_size"]),)
    return tuple((ep, etp) for etp in etps for ep in eps
                 if model.num_moe_experts % ep == 0 and model.expert_ffn_hidden_size % etp == 0
                 and stage % (ep * etp) == 0)


def _pp_values(world: int, tp_cp: int, model: ModelSpec, fixed: Mapping, options: SearchOptions) -> tuple[int, ...]:
    if world % tp_cp:
        return ()
    rest = world // tp_cp
    if "pipeline_model_parallel_size" in fixed:
        pp = int(fixed["pipeline_model_parallel_size"])
        values = (pp,) if rest % pp == 0 else ()
    else:
        limit = options.max_pipeline_model_parallel_size or model.num_layers
        values = tuple(d for d in divisors(rest) if d <= min(limit, model.num_layers))
    if "data_parallel_size" in fixed:
        values = tuple(pp for pp in values if rest // pp == int(fixed["data_parallel_size"]))
    return values


def _inner(*, model, train, fixed, options, tp, cp, pp, dp, shape_ok, group) -> Iterator[tuple | str]:
    """Every point of one TP x CP x PP as a plain tuple of :class:`Point`'s first fields (the enumeration adds EP,
    ETP and the features), or the reason it is pruned (``shape_ok``: the TP and CP rules hold).

    Reasons, first that applies: ``microbatches`` (the global batch does not divide), ``divisibility``
    (Megatron's shape rules, and at least one decoder per virtual stage), ``microbatches`` (the
    schedule's own rule, :meth:`~megapipe.schedules.ScheduleSpec.searchable`).
    """
    searched = SCHEDULE_NAMES if options.what_if_schedules else MEGATRON_SCHEDULES
    schedules = _values(fixed, "schedule", searched if pp > 1 else (ScheduleName.one_f_one_b,))
    mbs_values = _values(fixed, "micro_batch_size", options.micro_batch_sizes)
    recomputes = tuple(Recompute(value) for value in _values(fixed, "recompute_granularity", _RECOMPUTE))
    # MoE training with TP > 1 needs sequence parallelism (megatron-core MoELayer.forward raises otherwise).
    sp_default = ((True,) if model.is_moe else (False, True)) if tp > 1 else (False,)
    sps = tuple(bool(sp) for sp in _values(fixed, "sequence_parallel", sp_default))
    if model.is_moe and tp > 1 and not all(sps):
        shape_ok = False
    for schedule in schedules:
        item = spec(schedule)
        name = str(item.name)  # a plain str: points key many caches
        vps = item.virtual_sizes(pipeline_model_parallel_size=pp, max_virtual=_max_virtual(model, pp, options))
        if "virtual_pipeline_model_parallel_size" in fixed:
            vp = int(fixed["virtual_pipeline_model_parallel_size"])
            admitted = item.admits_virtual(pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vp)
            vps = (vp,) if admitted or "schedule" in fixed else ()
        for vp in vps:
            divisible = shape_ok and pp * vp <= max_stages(model.num_layers)
            for mbs in mbs_values:
                mbs = int(mbs)
                if train.global_batch_size % (mbs * dp):
                    yield "microbatches"
                    continue
                m = train.global_batch_size // (mbs * dp)
                if "num_microbatches" in fixed and m != int(fixed["num_microbatches"]):
                    yield "microbatches"
                    continue
                reason = "" if divisible else "divisibility"
                if not reason and not item.searchable(
                        pipeline_model_parallel_size=pp, num_microbatches=m, virtual_pipeline_model_parallel_size=vp,
                        microbatch_group_size_per_vp_stage=group):
                    reason = "microbatches"
                per_stage = (options.per_stage_recompute and vp == 1 and pp > 1
                             and "recompute_granularity" not in fixed)
                for recompute in (*recomputes, "per_stage") if per_stage else recomputes:
                    adaptive = recompute == "per_stage"
                    granularity = Recompute.none if adaptive else recompute
                    for sp in sps:
                        yield reason or (tp, cp, pp, dp, vp, mbs, granularity, sp, name, adaptive, m)


def _max_virtual(model, pp: int, options) -> int:
    """The most chunks per rank searched: what the layers fill (:func:`max_stages`), or the user's cap."""
    filled = max_stages(model.num_layers) // pp
    cap = options.max_virtual_pipeline_model_parallel_size
    return filled if cap is None else min(filled, cap)


def _no_fit_message(world: int, fixed: Mapping[str, object]) -> str:
    pinned = {k: v for k, v in fixed.items() if k.endswith("_size")}
    return (
        f"no TP x CP x PP x DP uses all {world} GPUs with {pinned}; "
        f"pick sizes whose product divides {world} or change cluster.num_nodes"
    )
