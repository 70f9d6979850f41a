"""``solve``: split a profile's entries into pipeline stages.

``method="optimal"`` minimises the bottleneck ``max_j time_scale_j * sum(fwd_ms + bwd_ms)``
exactly, subject to every stage fitting its memory (see :mod:`megapipe.partition.minmax`);
for 1F1B and GPipe without virtual stages it then takes, among splits with that
bottleneck, the one with the least max memory / cap (:mod:`megapipe.partition.headroom`);
``equal`` and ``parameters`` are Megatron's and DeepSpeed's splits
(:mod:`megapipe.partition.baselines`). With virtual stages (v > 1) the solver splits the
entries into P * v layout stages; layout stage c runs on rank c % P (or on a V) with that rank's
time_scale, and the rank's chunks must fit its memory together, at the moments their
activations peak together (:mod:`megapipe.partition.coupled`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np

from megapipe.errors import ConfigError, InfeasibleError
from megapipe.partition.baselines import equal_bounds, parameters_bounds
from megapipe.partition.build import build_partition, over_memory_message
from megapipe.partition.coupled import bottleneck_of, rank_peaks, ranks_fit, uniform_shape, uniform_split
from megapipe.partition.milp import Unsolved, milp_split
from megapipe.partition.memory import chunk_memory_caps, in_flight_counts, memory_reach, stage_ranks
from megapipe.partition.headroom import least_utilisation_split
from megapipe.partition.pinned import pinned_shape, pinned_split
from megapipe.partition.minmax import SegmentCost, min_max_split, reachable_sets, segment_cost
from megapipe.layout import mtp_problem
from megapipe.records import LayerCost, LayerKind, Partition, StageSpec
from megapipe.schedules import ScheduleName, rank_in_flight_profiles, spec
from megapipe.units import GIB

__all__ = ["METHODS", "solve", "given_split", "free_split"]

METHODS = ("optimal", "equal", "parameters")
_HUGE = 1e300


def solve(
    profile,
    stages: Sequence[StageSpec],
    *,
    num_microbatches: int,
    schedule: str = ScheduleName.one_f_one_b,
    virtual_pipeline_model_parallel_size: int = 1,
    method: str = "optimal",
    check_memory: bool = True,
    microbatch_group_size_per_vp_stage: int | None = None,
) -> Partition:
    """Partition ``profile.layers`` over ``stages`` (one StageSpec per pipeline rank).

    With ``check_memory=False`` memory caps are ignored (optimal: pure time min-max;
    baselines: returned with ``fits_memory`` telling whether they fit). With
    ``check_memory=True`` a split that cannot fit raises InfeasibleError naming the
    tightest stage and how many GiB it is over.
    """
    layers, stages, vp = _validate(profile, stages, num_microbatches, virtual_pipeline_model_parallel_size, method)
    pp = len(stages)
    in_flight, ranks, profiles = _layout(schedule, pp, num_microbatches, vp, microbatch_group_size_per_vp_stage)
    coupled = profiles is not None

    def split(entries) -> tuple[int, ...]:
        if method == "equal":
            return equal_bounds([layer.kind for layer in entries], num_stages=pp * vp)
        if method == "parameters":
            return parameters_bounds([layer.param_count for layer in entries], num_stages=pp * vp)
        if coupled:
            return _coupled_bounds(entries, stages, ranks, in_flight, profiles, check_memory=check_memory)
        caps = tuple(float(stages[rank].memory_bytes) for rank in ranks) if check_memory else (math.inf,) * len(ranks)
        # Where the bottleneck alone sets the step (the spec's bottleneck_sets_step), every
        # bottleneck-optimal split is equally fast, so keep the one with the most headroom.
        return _optimal_bounds(entries, stages, ranks, in_flight, caps, headroom=spec(schedule).bottleneck_sets_step)

    bounds = _with_mtp_rules(layers, split, pp)
    partition = build_partition(
        layers=layers, stages=stages, bounds=bounds, in_flight=in_flight, ranks=ranks,
        num_microbatches=num_microbatches, schedule=schedule, method=method, profiles=profiles,
    )  # fmt: skip
    # The optimal split already keeps every rank within its memory.
    if check_memory and method != "optimal" and not partition.fits_memory:
        _raise_rank_overflow(partition, stages)
    return partition


def free_split(
    profile,
    stages: Sequence[StageSpec],
    *,
    num_microbatches: int,
    schedule: str,
    virtual_pipeline_model_parallel_size: int,
    microbatch_group_size_per_vp_stage: int | None = None,
    check_memory: bool = True,
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(entries per layout stage, stage-to-rank map) of :func:`solve`'s optimal split where it is known without
    solving, else None: when ranks hold several layout stages, no entry is an MTP layer, and the split of least
    bottleneck without memory limits fits every rank's coupled memory (or memory is not checked), ``solve`` returns
    that split (:func:`_coupled_bounds`), which is kept by the entries' times. A search asks it of candidates it may
    prune on their partition's floor, at a fraction of a solve's cost. Raises as ``solve`` does on bad input."""
    layers, stages, vp = _validate(profile, stages, num_microbatches, virtual_pipeline_model_parallel_size, "optimal")
    if any(layer.kind == LayerKind.mtp for layer in layers):
        return None
    in_flight, ranks, profiles = _layout(schedule, len(stages), num_microbatches, vp,
                                         microbatch_group_size_per_vp_stage)
    if profiles is None:
        return None
    bounds = _free_bounds(layers, stages, ranks, in_flight)  # the coupled solver's answer where it fits
    if check_memory and not _coupled_fit(layers, stages, ranks, profiles, bounds):
        return None
    entries = tuple(stop - start for start, stop in zip(bounds, bounds[1:]))
    return (entries, tuple(ranks)) if all(entries) else None


def _layout(schedule: str, pp: int, num_microbatches: int, vp: int, microbatch_group_size_per_vp_stage: int | None):
    """Each layout stage's peak in-flight count and pipeline rank, and where ranks hold several layout stages their
    in-flight profiles (None otherwise): what the solver's splits read of the schedule."""
    in_flight = in_flight_counts(schedule=schedule, pipeline_model_parallel_size=pp, num_microbatches=num_microbatches,
                                 virtual_pipeline_model_parallel_size=vp,
                                 microbatch_group_size_per_vp_stage=microbatch_group_size_per_vp_stage)
    ranks = stage_ranks(schedule=schedule, pipeline_model_parallel_size=pp, num_stages=pp * vp)
    profiles = rank_in_flight_profiles(
        schedule, pipeline_model_parallel_size=pp, num_microbatches=num_microbatches,
        virtual_pipeline_model_parallel_size=vp, microbatch_group_size_per_vp_stage=microbatch_group_size_per_vp_stage,
    ) if len(ranks) > pp else None
    return in_flight, ranks, profiles


def _mtp_problem(layers, bounds, pp: int) -> str | None:
    kinds = [tuple(layer.kind for layer in layers[a:b]) for a, b in zip(bounds, bounds[1:])]
    return mtp_problem(kinds, pipeline_model_parallel_size=pp)


def _glued(layers, start: int, stop: int) -> tuple[list[LayerCost], int]:
    """The profile with entries start..stop-1 as one entry (their sums), and how many entries it removed."""
    group = layers[start:stop]
    fsum = math.fsum
    merged = LayerCost(
        name="+".join(layer.name for layer in group), kind=group[-1].kind,
        fwd_ms=fsum(e.fwd_ms for e in group), bwd_ms=fsum(e.bwd_ms for e in group),
        wgrad_ms=fsum(e.wgrad_ms for e in group), static_bytes=fsum(e.static_bytes for e in group),
        act_bytes=fsum(e.act_bytes for e in group), param_count=fsum(e.param_count for e in group),
        expert_param_count=fsum(e.expert_param_count for e in group),
        parts=tuple(map(fsum, zip(*(e.parts for e in group)))) if all(e.parts for e in group) else (),
    )  # fmt: skip
    return [*layers[:start], merged, *layers[stop:]], stop - start - 1


def _with_mtp_rules(layers, split, pp: int) -> tuple[int, ...]:
    """``split(layers)``, unless it places the MTP layers where megatron-core refuses them
    (:func:`megapipe.layout.mtp_problem`). Then the MTP layers are split as one entry, and if that
    still lands badly, as one entry with the loss (the last stage, always allowed): the best split
    under each restriction, the first that megatron-core accepts.
    """
    bounds = split(layers)
    mtp = [index for index, layer in enumerate(layers) if layer.kind == LayerKind.mtp]
    if not mtp or _mtp_problem(layers, bounds, pp) is None:
        return bounds
    start, stop = mtp[0], mtp[-1] + 1
    tail = len(layers) if layers[-1].kind == LayerKind.loss and stop == len(layers) - 1 else stop
    for end in dict.fromkeys((stop, tail)):
        entries, removed = _glued(layers, start, end)
        try:
            glued = split(entries)
        except InfeasibleError:
            continue
        expanded = tuple(b if b <= start else b + removed for b in glued)
        if _mtp_problem(layers, expanded, pp) is None:
            return expanded
    problem = _mtp_problem(layers, bounds, pp)
    raise InfeasibleError(f"no split places the MTP layers where megatron-core allows them ({problem}); "
                          "change the pipeline or virtual sizes")


def _coupled_bounds(layers, stages, ranks, in_flight, profiles, *, check_memory: bool) -> tuple[int, ...]:
    """The min-max split when ranks hold several layout stages, under each rank's coupled memory.

    The split of least bottleneck ignoring memory is optimal when it fits; otherwise the exact
    coupled solvers decide: identical decoders by counts (:mod:`megapipe.partition.coupled`), a few
    entries at each end around identical decoders by counts per placement of the ends
    (:mod:`megapipe.partition.pinned`), any other profile as a MILP (:mod:`megapipe.partition.milp`);
    if HiGHS cannot finish, the per-chunk share rule gives a split that fits
    (:func:`~megapipe.partition.memory.chunk_memory_caps`).
    """
    free = _free_bounds(layers, stages, ranks, in_flight)
    if not check_memory or _coupled_fit(layers, stages, ranks, profiles, free):
        return free
    floor = bottleneck_of(layers, stages, ranks, free)
    caps = chunk_memory_caps(layers=layers, stages=stages, in_flight=in_flight, ranks=ranks)
    try:  # the per-chunk shares fit the coupled memory too; at the free bottleneck they are optimal
        shared = _optimal_bounds(layers, stages, ranks, in_flight, caps, headroom=False)
        if bottleneck_of(layers, stages, ranks, shared) <= floor * (1 + 1e-12):
            return shared
    except InfeasibleError:
        pass
    shape = uniform_shape(layers, times=True)
    pinned = pinned_shape(layers) if shape is None else None
    if shape is not None:
        bounds = uniform_split(shape=shape, stages=stages, ranks=ranks, profiles=profiles, lower_bound=floor)
    elif pinned is not None:
        bounds = pinned_split(shape=pinned, stages=stages, ranks=ranks, profiles=profiles, lower_bound=floor)
    else:
        try:
            bounds = milp_split(layers=layers, stages=stages, ranks=ranks, profiles=profiles, lower_bound=floor)
        except Unsolved:  # HiGHS found nothing in time: fall back on per-chunk shares (sound, not exact)
            caps = chunk_memory_caps(layers=layers, stages=stages, in_flight=in_flight, ranks=ranks)
            return _optimal_bounds(layers, stages, ranks, in_flight, caps, headroom=False)
    if bounds is None:
        raise _MemoryInfeasible(lambda: _coupled_infeasible_message(layers, stages, ranks, profiles, free))
    return bounds


_FREE: dict[tuple, tuple[int, ...]] = {}
"""The split of least bottleneck without memory limits, by the entries' F + B and each layout stage's time scale:
all it reads (no memory reach, so neither bytes nor in-flight counts; a search meets the same layer times at every
data-parallel size and microbatch count)."""


def _free_bounds(layers, stages, ranks, in_flight) -> tuple[int, ...]:
    key = (tuple([layer.fwd_ms + layer.bwd_ms for layer in layers]), tuple([stages[rank].time_scale for rank in ranks]))
    found = _FREE.get(key)
    if found is None:
        found = _optimal_bounds(layers, stages, ranks, in_flight, (math.inf,) * len(ranks), headroom=False)
        if len(_FREE) >= 4096:
            _FREE.clear()
        _FREE[key] = found
    return found


def _coupled_fit(layers, stages, ranks, profiles, bounds) -> bool:
    static = [math.fsum(layer.static_bytes for layer in layers[a:b]) for a, b in zip(bounds, bounds[1:])]
    act = [math.fsum(layer.act_bytes for layer in layers[a:b]) for a, b in zip(bounds, bounds[1:])]
    return ranks_fit(static=static, act=act, ranks=ranks, profiles=profiles,
                     caps=[stage.memory_bytes for stage in stages])


def _coupled_infeasible_message(layers, stages, ranks, profiles, bounds) -> str:
    """Name the rank the split of least bottleneck overfills most: no split fits every rank's chunks."""
    static = [math.fsum(layer.static_bytes for layer in layers[a:b]) for a, b in zip(bounds, bounds[1:])]
    act = [math.fsum(layer.act_bytes for layer in layers[a:b]) for a, b in zip(bounds, bounds[1:])]
    peaks = rank_peaks(static=static, act=act, ranks=ranks, profiles=profiles)
    rank = max(range(len(stages)), key=lambda r: peaks[r] - stages[r].memory_bytes)
    return over_memory_message(label=f"pipeline rank {rank} (all its chunks, at their peak together)",
                               need_bytes=peaks[rank], cap_bytes=stages[rank].memory_bytes,
                               detail="; no split fits every rank")


def given_split(
    profile,
    stages: Sequence[StageSpec],
    *,
    entries_per_stage: Sequence[int],
    num_microbatches: int,
    schedule: str = ScheduleName.one_f_one_b,
    method: str = "given",
) -> Partition:
    """The record of a given split (e.g. a user's layout); never raises on memory, see ``fits_memory``."""
    layers = tuple(getattr(profile, "layers", profile))
    if sum(entries_per_stage) != len(layers) or len(entries_per_stage) % len(stages):
        raise ConfigError(
            f"entries_per_stage={list(entries_per_stage)} must sum to the profile's {len(layers)} entries "
            f"and have a multiple of {len(stages)} stages"
        )
    bounds = (0, *itertools.accumulate(entries_per_stage))
    in_flight, ranks, profiles = _layout(schedule, len(stages), num_microbatches, len(entries_per_stage) // len(stages),
                                         None)
    return build_partition(
        layers=layers, stages=stages, bounds=bounds, in_flight=in_flight, ranks=ranks,
        num_microbatches=num_microbatches, schedule=schedule, method=method, profiles=profiles,
    )  # fmt: skip


def _validate(profile, stages, num_microbatches, vp, method) -> tuple[tuple[LayerCost, ...], tuple[StageSpec, ...], int]:
    layers = tuple(getattr(profile, "layers", profile))
    stages = tuple(stages)
    if method not in METHODS:
        raise ConfigError(f"method={method!r} is not known; use one of {', '.join(METHODS)}")
    if not stages:
        raise ConfigError("stages is empty; give one StageSpec per pipeline rank")
    if not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ConfigError(f"num_microbatches={num_microbatches!r} must be an integer >= 1")
    if not isinstance(vp, int) or vp < 1:
        raise ConfigError(f"virtual_pipeline_model_parallel_size={vp!r} must be an integer >= 1")
    for rank, stage in enumerate(stages):
        if not (math.isfinite(stage.time_scale) and stage.time_scale > 0):
            raise ConfigError(f"stages[{rank}].time_scale={stage.time_scale!r} must be finite and > 0")
        if not stage.memory_bytes >= 0:
            raise ConfigError(f"stages[{rank}].memory_bytes={stage.memory_bytes!r} must be >= 0")
    if len(layers) < len(stages) * vp:
        raise InfeasibleError(
            f"the profile has {len(layers)} entries but {len(stages)} pipeline ranks x {vp} virtual stages "
            f"need at least one each; use fewer stages"
        )
    return layers, stages, vp


def _optimal_bounds(layers, stages, ranks, in_flight, caps, *, headroom: bool) -> tuple[int, ...]:
    """Min-max bottleneck split, then the one of least max memory utilisation at that bottleneck."""
    num_entries = len(layers)
    time_prefix = (0.0, *itertools.accumulate(layer.fwd_ms + layer.bwd_ms for layer in layers))
    order = sorted(range(num_entries), key=lambda e: time_prefix[e + 1] - time_prefix[e], reverse=True)
    static_prefix, act_prefix = _memory_prefixes(layers)
    reach = memory_reach(static_prefix=static_prefix, act_prefix=act_prefix, in_flight=in_flight, caps=caps)
    costs = _time_costs(time_prefix, order, [stages[rank].time_scale for rank in ranks], reach)
    # Every entry sits on some stage no faster than the fastest; the fluid bound spreads total time at full speed.
    largest = min(segment_cost(cost, order[0], order[0] + 1) for cost in costs)
    fluid = time_prefix[-1] / sum(1.0 / cost.scale for cost in costs) * (1 - 1e-9)
    result = min_max_split(stages=costs, num_entries=num_entries, lower_bound=max(largest, fluid))
    if result is None:
        raise _MemoryInfeasible(lambda: _memory_infeasible_message(layers, stages, ranks, in_flight, caps))
    bottleneck, bounds = result
    if not headroom or not any(math.isfinite(cap) for cap in caps):
        return bounds  # nothing to keep headroom against: the min-max split as found
    reachable = reachable_sets(stages=costs, num_entries=num_entries, bound=bottleneck)
    return least_utilisation_split(
        costs=costs, reachable=reachable, bottleneck=bottleneck, static_prefix=static_prefix,
        act_prefix=act_prefix, in_flight=in_flight, caps=caps,
    )  # fmt: skip


def _time_costs(time_prefix, order, scales, reach: np.ndarray) -> list[SegmentCost]:
    """Each layout stage's time cost with its memory reach row (and entries too big for it alone)."""
    num_entries = len(time_prefix) - 1
    blocked_rows, blocked_entries = np.nonzero(reach[:, :-1] == np.arange(num_entries))
    blocked = [[] for _ in scales]
    for row, entry in zip(blocked_rows.tolist(), blocked_entries.tolist()):
        blocked[row].append(entry)
    return [
        SegmentCost(
            prefix=time_prefix, scale=scale, offset=0.0, mem_reach=row, mem_blocked=blocked[chunk], single_desc=order,
        )  # fmt: skip
        for chunk, (scale, row) in enumerate(zip(scales, reach.tolist()))
    ]


def _memory_prefixes(layers) -> tuple[np.ndarray, np.ndarray]:
    static_prefix = np.zeros(len(layers) + 1)
    act_prefix = np.zeros(len(layers) + 1)
    static_prefix[1:] = np.cumsum([layer.static_bytes for layer in layers])
    act_prefix[1:] = np.cumsum([layer.act_bytes for layer in layers])
    return static_prefix, act_prefix


class _MemoryInfeasible(InfeasibleError):
    """No split fits; the diagnosis (a second min-max solve) runs only when the message is read.

    A planner rejects most candidates this way and never reads the message.
    """

    def __init__(self, explain):
        super().__init__()
        self._explain = explain
        self._message: str | None = None

    def __str__(self) -> str:
        if self._message is None:
            self._message = self._explain()
        return self._message


def _memory_infeasible_message(layers, stages, ranks, in_flight, caps) -> str:
    """Find the split whose worst memory overage is smallest and name its tightest stage."""
    num_entries = len(layers)
    static_prefix, act_prefix = _memory_prefixes(layers)
    everything = tuple([num_entries] * (num_entries + 1))
    costs = []
    for count, cap in zip(in_flight, caps):
        prefix = tuple((static_prefix + count * act_prefix).tolist())
        order = sorted(range(num_entries), key=lambda e: prefix[e + 1] - prefix[e], reverse=True)
        costs.append(SegmentCost(
            prefix=prefix, scale=1.0, offset=-min(cap, _HUGE),
            mem_reach=everything, mem_blocked=(), single_desc=order,
        ))  # fmt: skip
    lower = min(segment_cost(cost, e, e + 1) for cost in costs for e in range(num_entries))
    _, bounds = min_max_split(stages=costs, num_entries=num_entries, lower_bound=lower)
    overs = [segment_cost(cost, bounds[c], bounds[c + 1]) for c, cost in enumerate(costs)]
    worst = max(range(len(costs)), key=overs.__getitem__)
    need = overs[worst] + min(caps[worst], _HUGE)
    detail = ""
    if len(costs) > len(stages):
        rank = ranks[worst]
        detail = f" (its share of pipeline rank {rank}'s {stages[rank].memory_bytes / GIB:.1f} GiB)"
    return over_memory_message(label=f"stage {worst}", need_bytes=need, cap_bytes=caps[worst], detail=detail)


def _raise_rank_overflow(partition: Partition, stages: Sequence[StageSpec]) -> None:
    used = partition.rank_memory_bytes
    rank = max(range(len(stages)), key=lambda r: used[r] - stages[r].memory_bytes)
    assert used[rank] > stages[rank].memory_bytes
    label = f"{partition.method} split: stage {rank}"
    if partition.virtual_pipeline_model_parallel_size > 1:
        label = f"{partition.method} split: pipeline rank {rank}"
    raise InfeasibleError(over_memory_message(label=label, need_bytes=used[rank], cap_bytes=stages[rank].memory_bytes))
