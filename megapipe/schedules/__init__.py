"""Pipeline schedules: one module per schedule, each building the per-rank action order.

Each schedule module defines one :class:`ScheduleSpec` (placement, split backward, chunk
rule, Megatron support, closed forms, bound factors); :mod:`megapipe.schedules.registry`
collects them. ``build(name, ...)`` returns a :class:`Schedule` that
``megapipe.simulate.simulate`` runs; ``peak_in_flight`` gives the partition solver each
layout stage's peak in-flight microbatches.
"""

from megapipe.schedules.base import KIND_CODE, Action, Kind, RankOps, Schedule
from megapipe.schedules.registry import (
    MEGATRON_SCHEDULES,
    SCHEDULE_NAMES,
    SPECS,
    build,
    chunks_per_rank,
    megatron_runs,
    megatron_schedule,
    megatron_substitute,
    megatron_warnings,
    peak_in_flight,
    rank_in_flight_profiles,
    rank_ops,
    spec,
)
from megapipe.schedules.spec import InFlightFloor, PathShare, Placement, ScheduleName, ScheduleSpec

__all__ = [
    "SCHEDULE_NAMES",
    "MEGATRON_SCHEDULES",
    "SPECS",
    "Action",
    "Kind",
    "Schedule",
    "ScheduleName",
    "ScheduleSpec",
    "Placement",
    "PathShare",
    "InFlightFloor",
    "build",
    "chunks_per_rank",
    "megatron_runs",
    "megatron_schedule",
    "megatron_substitute",
    "megatron_warnings",
    "peak_in_flight",
    "rank_in_flight_profiles",
    "rank_ops",
    "spec",
    "KIND_CODE",
    "RankOps",
]
