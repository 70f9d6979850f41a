"""Pipeline schedules: one module per schedule, each building the per-rank action order.

``build(name, ...)`` returns a :class:`Schedule`; ``megapipe.simulate.simulate`` runs
any of them. ``peak_in_flight`` gives the partition solver each layout stage's peak
in-flight microbatches.
"""

from megapipe.schedules.base import SCHEDULE_NAMES, Action, Kind, Schedule
from megapipe.schedules.registry import V_SHAPED, build, chunks_per_rank, peak_in_flight

__all__ = [
    "SCHEDULE_NAMES",
    "V_SHAPED",
    "Action",
    "Kind",
    "Schedule",
    "build",
    "chunks_per_rank",
    "peak_in_flight",
]
