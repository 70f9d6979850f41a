"""The schedule registry: every :class:`~megapipe.schedules.spec.ScheduleSpec`, and ``build``.

Other packages ask here: ``spec(name)`` for what a schedule is, ``build(name, ...)`` for its
orders, ``peak_in_flight`` for the partition solver's in-flight counts, and whether megatron-core runs a
schedule: ``megatron_runs``, ``megatron_substitute`` (what it runs instead), ``megatron_warnings`` (what a plan
says about it) and ``megatron_schedule`` (what it runs by default). No other module answers these.
"""

from __future__ import annotations

from functools import lru_cache, partial

import numpy as np

from megapipe.errors import ScheduleError
from megapipe.schedules.base import Kind, LazyOrders, RankOps, Schedule, check_sizes, rank_ops_of
from megapipe.schedules.dualpipe_v import SPEC as DUALPIPE_V
from megapipe.schedules.gpipe import SPEC as GPIPE
from megapipe.schedules.interleaved import SPEC as INTERLEAVED
from megapipe.schedules.one_f_one_b import SPEC as ONE_F_ONE_B
from megapipe.schedules.zb_h import ZB_H1, ZB_H2
from megapipe.schedules.zb_v import SPEC as ZB_V
from megapipe.schedules.spec import Placement, ScheduleName, ScheduleSpec

__all__ = [
    "SPECS",
    "SCHEDULE_NAMES",
    "MEGATRON_SCHEDULES",
    "spec",
    "build",
    "peak_in_flight",
    "rank_in_flight_profiles",
    "rank_ops",
    "chunks_per_rank",
    "megatron_schedule",
    "megatron_runs",
    "megatron_substitute",
    "megatron_warnings",
]

SPECS: dict[ScheduleName, ScheduleSpec] = {
    item.name: item
    for item in (GPIPE, ONE_F_ONE_B, INTERLEAVED, ZB_H1, ZB_H2, ZB_V, DUALPIPE_V)
}
SCHEDULE_NAMES: tuple[ScheduleName, ...] = tuple(SPECS)
MEGATRON_SCHEDULES: tuple[ScheduleName, ...] = tuple(name for name, item in SPECS.items() if item.megatron_runs)
"""What megatron-core 0.16-0.19 ``get_forward_backward_func()`` runs for pipeline_model_parallel_size > 1."""


def spec(name: str) -> ScheduleSpec:
    """The spec of schedule ``name``; ScheduleError naming the known ones otherwise."""
    try:
        return SPECS[name]
    except (KeyError, TypeError):
        raise ScheduleError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULE_NAMES)}") from None


def chunks_per_rank(name: str, virtual_pipeline_model_parallel_size: int = 1) -> int:
    """Model chunks each rank holds: 2 for V-shaped schedules, v for interleaved, else 1."""
    return spec(name).chunks_per_rank(virtual_pipeline_model_parallel_size)


def megatron_schedule(num_model_chunks: int) -> ScheduleName:
    """What ``get_forward_backward_func()`` picks: interleaved with virtual stages, else 1F1B."""
    return next(item.name for item in SPECS.values()
                if item.megatron_runs and (item.fixed_chunks is None) == (num_model_chunks > 1))


def megatron_runs(name: str, *, pipeline_model_parallel_size: int) -> bool:
    """Whether megatron-core runs schedule ``name`` as simulated at this pipeline size (any schedule without
    pipelining is one stage's forward and backward)."""
    return pipeline_model_parallel_size == 1 or spec(name).megatron_runs


def megatron_substitute(name: str, *, pipeline_model_parallel_size: int,
                        virtual_pipeline_model_parallel_size: int) -> ScheduleName | None:
    """What megatron-core runs with a plan of schedule ``name`` when it lacks that schedule: its layout with
    1F1B, or interleaved 1F1B when there are virtual stages; None when it runs ``name`` itself."""
    if megatron_runs(name, pipeline_model_parallel_size=pipeline_model_parallel_size):
        return None
    return megatron_schedule(spec(name).chunks_per_rank(virtual_pipeline_model_parallel_size))


def megatron_warnings(name: str, *, pipeline_model_parallel_size: int,
                      virtual_pipeline_model_parallel_size: int) -> tuple[str, ...]:
    """What a plan of schedule ``name`` says when megatron-core cannot run it: what it runs instead, and a V
    placement its layout cannot express; empty when it runs it."""
    substitute = megatron_substitute(name, pipeline_model_parallel_size=pipeline_model_parallel_size,
                                     virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size)
    if substitute is None:
        return ()
    runs = "interleaved 1F1B" if substitute == ScheduleName.interleaved_1f1b else "1F1B"
    warnings = [f"what-if: megatron-core has no {name} schedule, so this plan cannot run as simulated "
                f"(Megatron would run its layout with {runs}); no Megatron arguments are written for it"]
    if spec(name).placement is Placement.v:
        warnings.append(
            f"the {name} V-shaped placement (rank r holds stages r and 2P-1-r) cannot be expressed: "
            "Megatron's layout puts stage s on rank s mod pipeline_model_parallel_size"
        )
    return tuple(warnings)


def _check_virtual(item: ScheduleSpec, virtual: int) -> None:
    if not isinstance(virtual, int) or virtual < 1:
        raise ScheduleError(f"virtual_pipeline_model_parallel_size={virtual!r} must be an int >= 1")
    if item.fixed_chunks is None or virtual == item.fixed_chunks:
        return
    if item.placement is Placement.v:
        raise ScheduleError(
            f"{item.name} places exactly 2 model chunks per rank (V shape); "
            f"set virtual_pipeline_model_parallel_size=2, got {virtual}"
        )
    raise ScheduleError(
        f"{item.name} runs one model chunk per rank; got virtual_pipeline_model_parallel_size={virtual}: "
        "use schedule=interleaved_1f1b for virtual stages, or set it to 1"
    )


@lru_cache(maxsize=128)
def build(
    name: str, *, pipeline_model_parallel_size: int, num_microbatches: int,
    virtual_pipeline_model_parallel_size: int = 1, microbatch_group_size_per_vp_stage: int | None = None,
) -> Schedule:
    """Per-rank orders of schedule ``name`` (one of SCHEDULE_NAMES) for these sizes.

    ``microbatch_group_size_per_vp_stage`` only affects schedules with searched chunks
    (interleaved_1f1b; Megatron's default, pipeline_model_parallel_size, when None). Raises
    ScheduleError with the fix for sizes the schedule cannot run.
    """
    item = spec(name)
    pp, m, v = pipeline_model_parallel_size, num_microbatches, virtual_pipeline_model_parallel_size
    check_sizes(item.name, pipeline_model_parallel_size=pp, num_microbatches=m)
    _check_virtual(item, v)
    group = None
    if item.fixed_chunks is None:
        group = pp if microbatch_group_size_per_vp_stage is None else microbatch_group_size_per_vp_stage
    closed = item.rank_ops is not None and _closed_form_applies(item, pp, m, v, group)
    # sizes the closed form accepts build without error: their actions wait until something reads them
    orders = LazyOrders(partial(item.orders, pp, m, v, group), pp) if closed else item.orders(pp, m, v, group)
    return Schedule(
        name=item.name, pipeline_model_parallel_size=pp, num_microbatches=m,
        virtual_pipeline_model_parallel_size=v, microbatch_group_size_per_vp_stage=group,
        stage_to_rank=item.stage_to_rank(pipeline_model_parallel_size=pp, num_stages=pp * v), orders=orders,
        rank_ops=rank_ops(name, pipeline_model_parallel_size=pp, num_microbatches=m,
                          virtual_pipeline_model_parallel_size=v, microbatch_group_size_per_vp_stage=group)
        if closed else None,
    )


def _closed_form_applies(item: ScheduleSpec, pp: int, m: int, v: int, group: int | None) -> bool:
    """Sizes the builder accepts; anything else is built, so the builder raises the real error."""
    if not all(isinstance(n, int) and n >= 1 for n in (pp, m, v)):
        return False
    return item.sizes_ok(pp, m, v, pp if group is None else group)


def _peak_from_orders(schedule: Schedule) -> tuple[int, ...]:
    """Held from F until the stage's last backward op of that microbatch (B, or W after I)."""
    now, peak = [0] * schedule.num_stages, [0] * schedule.num_stages
    split = {(a.stage, a.microbatch) for order in schedule.orders for a in order if a.kind is Kind.I}
    for order in schedule.orders:
        for action in order:
            stage = action.stage
            if action.kind is Kind.F:
                now[stage] += 1
                peak[stage] = max(peak[stage], now[stage])
            elif action.kind is Kind.W or (action.kind is Kind.B and (stage, action.microbatch) not in split):
                now[stage] -= 1
    return tuple(peak)


def _pareto(rows: np.ndarray) -> np.ndarray:
    """The rows no other row dominates (>= everywhere, > somewhere), each once, largest first (read-only).

    A row dominates only rows of a smaller sum, and domination is transitive, so the rows of the largest sum
    are kept, the rest checked against the kept rows only, and so on by sum (a schedule's steady state gives one
    sum to most rows: two rounds, not a comparison of every pair)."""
    rows = _distinct_rows(np.asarray(rows))
    sums = rows.sum(axis=1)
    keep = np.zeros(len(rows), dtype=bool)
    alive = np.ones(len(rows), dtype=bool)
    while alive.any():
        top = alive & (sums == sums[alive].max())
        keep |= top
        alive &= ~top
        rest = np.flatnonzero(alive)
        if len(rest):
            covered = (rows[keep][None, :, :] >= rows[rest][:, None, :]).all(axis=2).any(axis=1)
            alive[rest[covered]] = False
    out = np.ascontiguousarray(rows[keep][::-1])
    out.flags.writeable = False  # shared through the cache below
    return out


def _distinct_rows(rows: np.ndarray) -> np.ndarray:
    """The distinct rows, ascending as ``np.unique(rows, axis=0)`` sorts them. In-flight counts are small
    non-negative integers, so a few columns at a time are read as the digits of one exact int64 (the first column
    the most significant): one sort of those keys instead of one pass per column, and no row compared whole."""
    if len(rows) < 2:
        return rows
    if rows.dtype.kind == "i" and rows.size and int(rows.min()) >= 0:
        base = int(rows.max()) + 1
        digits = max(1, 62 // max(1, base.bit_length()))  # base ** digits < 2 ** 62: no overflow
        keys = [rows[:, first:first + digits] @ (base ** np.arange(min(digits, rows.shape[1] - first) - 1, -1, -1,
                                                                    dtype=np.int64))
                for first in range(0, rows.shape[1], digits)]
        order = np.argsort(keys[0], kind="stable") if len(keys) == 1 else np.lexsort(keys[::-1])
        keys = [key[order] for key in keys]
        new = np.ones(len(rows), dtype=bool)
        new[1:] = np.logical_or.reduce([key[1:] != key[:-1] for key in keys])
        return rows[order[new]]
    rows = rows[np.lexsort(rows.T[::-1])]
    return rows[np.concatenate([[True], (rows[1:] != rows[:-1]).any(axis=1)])]


def _rank_counts_from_orders(schedule: Schedule) -> tuple[np.ndarray, ...]:
    """Per rank, its stages' in-flight counts (stage order) after each of its forwards, from the built orders."""
    split = {(a.stage, a.microbatch) for order in schedule.orders for a in order if a.kind is Kind.I}
    out = []
    for order in schedule.orders:
        own = sorted({action.stage for action in order})
        index = {stage: position for position, stage in enumerate(own)}
        now, rows = [0] * len(own), []
        for action in order:
            if action.kind is Kind.F:
                now[index[action.stage]] += 1
                rows.append(tuple(now))
            elif action.kind is Kind.W or (action.kind is Kind.B and (action.stage, action.microbatch) not in split):
                now[index[action.stage]] -= 1
        out.append(np.array(rows, dtype=np.int64).reshape(len(rows), len(own)))
    return tuple(out)


@lru_cache(maxsize=512)
def rank_in_flight_profiles(
    name: str, *, pipeline_model_parallel_size: int, num_microbatches: int,
    virtual_pipeline_model_parallel_size: int = 1, microbatch_group_size_per_vp_stage: int | None = None,
) -> tuple[np.ndarray, ...]:
    """When a rank's activation memory can peak: for each pipeline rank, the in-flight counts of its layout
    stages (in stage order) at every moment that no other moment dominates, one row per moment (read-only int
    arrays, largest row first).

    A rank's activation bytes at any moment are ``sum_c n_c * act_c`` over its stages c, so its peak over the
    step is the largest of these sums over the returned vectors: the coupled memory of a rank's chunks, which
    the per-stage peaks (:func:`peak_in_flight`, reached at different moments) overstate for interleaved and
    V-shaped schedules. Activations count from F until B, or until W for split backwards. A spec's closed form
    (``rank_counts``) answers without building the schedule.
    """
    item = spec(name)
    pp, m, v = pipeline_model_parallel_size, num_microbatches, virtual_pipeline_model_parallel_size
    group = microbatch_group_size_per_vp_stage
    if item.rank_counts is not None and _closed_form_applies(item, pp, m, v, group):
        counts = item.rank_counts(pp, m, v, pp if group is None else group)
    else:
        counts = _rank_counts_from_orders(build(name, pipeline_model_parallel_size=pp, num_microbatches=m,
                                                virtual_pipeline_model_parallel_size=v,
                                                microbatch_group_size_per_vp_stage=group))
    return tuple(_pareto(rows) for rows in counts)


@lru_cache(maxsize=512)
def rank_ops(
    name: str, *, pipeline_model_parallel_size: int, num_microbatches: int,
    virtual_pipeline_model_parallel_size: int = 1, microbatch_group_size_per_vp_stage: int | None = None,
) -> tuple[RankOps, ...]:
    """Each rank's order as plain tuples (:class:`RankOps`), from the spec's closed form without building the
    actions when it has one; sizes the builder rejects raise its ScheduleError."""
    item = spec(name)
    pp, m, v = pipeline_model_parallel_size, num_microbatches, virtual_pipeline_model_parallel_size
    group = microbatch_group_size_per_vp_stage
    if item.rank_ops is not None and _closed_form_applies(item, pp, m, v, group):
        return item.rank_ops(pp, m, v, pp if group is None else group)
    return rank_ops_of(build(name, pipeline_model_parallel_size=pp, num_microbatches=m,
                             virtual_pipeline_model_parallel_size=v, microbatch_group_size_per_vp_stage=group).orders)


def peak_in_flight(
    schedule: str | Schedule, *, pipeline_model_parallel_size: int, num_microbatches: int,
    virtual_pipeline_model_parallel_size: int = 1, microbatch_group_size_per_vp_stage: int | None = None,
) -> tuple[int, ...]:
    """Peak microbatches of activations held per layout stage, in model (layout) order.

    ``schedule`` is a name or a built Schedule. One entry per layout stage: P * v for
    interleaved_1f1b (vp-major: stage = chunk * P + rank) and 2P for V-shaped schedules,
    whose stage s lives on rank s for s < P and on rank 2P-1-s after. Activations count
    from F until B, or until W for split backwards. For a name, the spec's closed form
    answers without building the schedule; sizes a builder rejects still raise its
    ScheduleError.
    """
    if isinstance(schedule, Schedule):
        return _peak_from_orders(schedule)
    item = spec(schedule)
    pp, m, v = pipeline_model_parallel_size, num_microbatches, virtual_pipeline_model_parallel_size
    group = microbatch_group_size_per_vp_stage
    if _closed_form_applies(item, pp, m, v, group):
        return item.in_flight(pp, m, v, pp if group is None else group)
    return _peak_from_orders(build(item.name, pipeline_model_parallel_size=pp, num_microbatches=m,
                                   virtual_pipeline_model_parallel_size=v,
                                   microbatch_group_size_per_vp_stage=group))
