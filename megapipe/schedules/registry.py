"""``build(name, ...)``: the one entry point from a schedule name and sizes to a Schedule."""

from __future__ import annotations

from functools import lru_cache

from megapipe.errors import ScheduleError
from megapipe.schedules.base import SCHEDULE_NAMES, Kind, Schedule, check_sizes
from megapipe.schedules.dualpipe_v import dualpipe_v_orders
from megapipe.schedules.gpipe import gpipe_orders
from megapipe.schedules.in_flight import closed_form_in_flight
from megapipe.schedules.interleaved import interleaved_orders
from megapipe.schedules.one_f_one_b import one_f_one_b_orders
from megapipe.schedules.zb_h import zb_h1_orders, zb_h2_orders
from megapipe.schedules.zb_v import zb_v_orders

__all__ = ["build", "peak_in_flight", "V_SHAPED", "chunks_per_rank"]

V_SHAPED = frozenset({"zb_v", "dualpipe_v"})
_SINGLE_CHUNK = {
    "gpipe": gpipe_orders,
    "1f1b": one_f_one_b_orders,
    "zb_h1": zb_h1_orders,
    "zb_h2": zb_h2_orders,
}
_V_CHUNK = {"zb_v": zb_v_orders, "dualpipe_v": dualpipe_v_orders}


def chunks_per_rank(name: str, virtual_pipeline_model_parallel_size: int = 1) -> int:
    """Model chunks each rank holds: 2 for V-shaped schedules, v for interleaved, else 1."""
    if name in V_SHAPED:
        return 2
    return virtual_pipeline_model_parallel_size if name == "interleaved_1f1b" else 1


def _check_virtual(name: str, virtual: int) -> None:
    if not isinstance(virtual, int) or virtual < 1:
        raise ScheduleError(f"virtual_pipeline_model_parallel_size={virtual!r} must be an int >= 1")
    if name in V_SHAPED and virtual != 2:
        raise ScheduleError(
            f"{name} places exactly 2 model chunks per rank (V shape); "
            f"set virtual_pipeline_model_parallel_size=2, got {virtual}"
        )
    if name in _SINGLE_CHUNK and virtual != 1:
        raise ScheduleError(
            f"{name} runs one model chunk per rank; got virtual_pipeline_model_parallel_size={virtual}: "
            "use schedule=interleaved_1f1b for virtual stages, or set it to 1"
        )


@lru_cache(maxsize=16)
def build(
    name: str, *, pipeline_model_parallel_size: int, num_microbatches: int,
    virtual_pipeline_model_parallel_size: int = 1, microbatch_group_size_per_vp_stage: int | None = None,
) -> Schedule:
    """Per-rank orders of schedule ``name`` (one of SCHEDULE_NAMES) for these sizes.

    ``microbatch_group_size_per_vp_stage`` only affects interleaved_1f1b (Megatron's
    default, pipeline_model_parallel_size, when None). Raises ScheduleError with the
    fix for sizes the schedule cannot run.
    """
    if name not in SCHEDULE_NAMES:
        raise ScheduleError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULE_NAMES)}")
    pp, m, v = pipeline_model_parallel_size, num_microbatches, virtual_pipeline_model_parallel_size
    check_sizes(name, pipeline_model_parallel_size=pp, num_microbatches=m)
    _check_virtual(name, v)
    group = None
    if name in _SINGLE_CHUNK:
        orders = _SINGLE_CHUNK[name](pipeline_model_parallel_size=pp, num_microbatches=m)
        stage_to_rank = tuple(range(pp))
    elif name in _V_CHUNK:
        orders = _V_CHUNK[name](pipeline_model_parallel_size=pp, num_microbatches=m)
        stage_to_rank = tuple(rank for rank in range(pp)) + tuple(reversed(range(pp)))
    else:
        group = pp if microbatch_group_size_per_vp_stage is None else microbatch_group_size_per_vp_stage
        orders = interleaved_orders(
            pipeline_model_parallel_size=pp, num_microbatches=m, virtual_pipeline_model_parallel_size=v,
            microbatch_group_size_per_vp_stage=group,
        )
        stage_to_rank = tuple(stage % pp for stage in range(pp * v))
    return Schedule(
        name=name, pipeline_model_parallel_size=pp, num_microbatches=m,
        virtual_pipeline_model_parallel_size=v, microbatch_group_size_per_vp_stage=group,
        stage_to_rank=stage_to_rank, orders=orders,
    )


def _closed_form_applies(name: str, pp: int, m: int, v: int, group: int | None) -> bool:
    """Sizes every builder accepts; anything else is built, so its builder raises the real error."""
    if name not in SCHEDULE_NAMES or not all(isinstance(n, int) and n >= 1 for n in (pp, m, v)):
        return False
    if name == "interleaved_1f1b":
        group = pp if group is None else group
        return v >= 2 and pp >= 2 and pp <= group <= m and not 0 < m % group < pp
    if name in V_SHAPED:
        return v == 2 and (name != "dualpipe_v" or m >= 2 * pp)
    return v == 1


def _peak_from_sizes(name, pp, m, v, group) -> tuple[int, ...]:
    if _closed_form_applies(name, pp, m, v, group):
        return closed_form_in_flight(
            name, pipeline_model_parallel_size=pp, num_microbatches=m, virtual_pipeline_model_parallel_size=v,
            microbatch_group_size_per_vp_stage=group,
        )
    schedule = build(
        name, pipeline_model_parallel_size=pp, num_microbatches=m, virtual_pipeline_model_parallel_size=v,
        microbatch_group_size_per_vp_stage=group,
    )
    return _peak_from_orders(schedule)


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


def peak_in_flight(
    schedule: str | Schedule, *, pipeline_model_parallel_size: int, num_microbatches: int,
    virtual_pipeline_model_parallel_size: int = 1, microbatch_group_size_per_vp_stage: int | None = None,
) -> tuple[int, ...]:
    """Peak microbatches of activations held per layout stage, in model (layout) order.

    ``schedule`` is a name or a built Schedule. One entry per layout stage: P * v
    for interleaved_1f1b (vp-major: stage = chunk * P + rank) and 2P for V-shaped
    schedules, whose stage s lives on rank s for s < P and on rank 2P-1-s after.
    Activations count from F until B, or until W for split backwards. For a name the
    closed forms of :mod:`megapipe.schedules.in_flight` answer without building the
    schedule; sizes a builder rejects still raise its ScheduleError.
    """
    if isinstance(schedule, Schedule):
        return _peak_from_orders(schedule)
    return _peak_from_sizes(
        schedule, pipeline_model_parallel_size, num_microbatches, virtual_pipeline_model_parallel_size,
        microbatch_group_size_per_vp_stage,
    )
