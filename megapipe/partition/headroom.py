"""Second stage of the optimal split: among bottleneck-optimal splits, the one with the most memory headroom.

Under 1F1B the step time is about ``(m - 1) * max_j t_j + sum_j t_j`` (Narayanan et
al. 2021, sec. 2.2), so every split with the optimal bottleneck ``T*`` runs equally
fast; the one to prefer leaves the most memory free. With ``T*`` fixed this module
minimises the largest memory utilisation ``max_c memory_c / cap_c`` over layout
stages ``c`` (an infinite cap never binds; with no finite cap at all the largest
stage memory in bytes is minimised). ``solve`` runs it for 1F1B and GPipe without
virtual stages only: with interleaved and V-shaped schedules the simulated step also
depends on where the work sits, and moving layers for headroom there made the
planner's best plans slower.

Method: exact min-max dynamic program restricted to the boundaries that some split
with bottleneck <= ``T*`` can use. Boundary ``j`` must be reachable from the front
after ``j`` stages (the solver's reachable-set probe at ``T*``) and must reach the
end with the remaining stages (a backward pass here); stage ``j`` can hold ``[a, b)``
iff ``a < b <= r_j(a)`` with ``r_j`` the smaller of its time and memory reach, both
non-decreasing in ``a``. At the optimum these windows are narrow (a few positions
each), so the program costs about ``sum_j |W_j| * |W_j+1|`` level evaluations.
Ties keep the latest cut, walking from the last stage back.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Sequence

import numpy as np

from megapipe.partition.minmax import SegmentCost, time_stop

__all__ = ["least_utilisation_split", "utilisation_weights"]


def utilisation_weights(caps: Sequence[float]) -> tuple[float, ...]:
    """What each stage's memory is divided by: its cap, or 1 byte for every stage when no cap is finite."""
    if any(math.isfinite(cap) for cap in caps):
        return tuple(float(cap) for cap in caps)
    return (1.0,) * len(caps)


def least_utilisation_split(
    *,
    costs: Sequence[SegmentCost],
    reachable: Sequence[Sequence[tuple[int, int]]],
    bottleneck: float,
    static_prefix: np.ndarray,
    act_prefix: np.ndarray,
    in_flight: Sequence[int],
    caps: Sequence[float],
) -> tuple[int, ...]:
    """Boundaries of the split with bottleneck <= ``bottleneck`` whose largest memory utilisation is least.

    ``costs`` are the stages' time costs with their memory reach under ``caps``;
    ``reachable`` the probe's reachable stops after 0..len(costs) stages at ``bottleneck``.
    """
    num_entries = len(static_prefix) - 1
    reach = [dict() for _ in costs]

    def reach_of(stage: int, start: int) -> int:
        cache = reach[stage]
        found = cache.get(start)
        if found is None:
            # min(memory reach, time reach): the time reach is computed inline, for every window position.
            cost = costs[stage]
            stop = time_stop(cost.prefix, cost.scale, cost.offset, start, num_entries, bottleneck)
            found = cost.mem_reach[start]
            if stop < found:
                found = stop
            cache[start] = found
        return found

    windows = _windows(reachable, reach_of, num_entries)
    levels = _level_function(static_prefix, act_prefix, in_flight, caps)
    value = {0: 0.0}
    picks = []
    for stage in range(len(costs)):
        following = windows[stage + 1]
        best: dict[int, float] = {}
        pick: dict[int, int] = {}
        for start in windows[stage]:
            base = value.get(start)
            if base is None:
                continue
            last = reach_of(stage, start)
            for index in range(bisect_right(following, start), bisect_right(following, last)):
                stop = following[index]
                level = levels(stage, start, stop)
                if base > level:
                    level = base
                if stop not in best or level <= best[stop]:  # starts ascend: a tie keeps the latest cut
                    best[stop], pick[stop] = level, start
        value = best
        picks.append(pick)
    assert num_entries in value, "the bottleneck split must lie within the windows"
    bounds = [num_entries]
    for pick in reversed(picks):
        bounds.append(pick[bounds[-1]])
    return tuple(reversed(bounds))


def _windows(reachable, reach_of, num_entries: int) -> list[list[int]]:
    """Sorted boundaries after each stage that lie on some split within the bound (forward and backward)."""
    num_stages = len(reachable) - 1
    windows: list[list[int]] = [[] for _ in range(num_stages + 1)]
    windows[num_stages] = [num_entries]
    for stage in range(num_stages - 1, -1, -1):
        following = windows[stage + 1]
        keep = []
        for low, high in reversed(reachable[stage]):
            done = False
            for start in range(min(high, following[-1] - 1), low - 1, -1):
                last = reach_of(stage, start)
                if last < following[0]:
                    done = True  # reach never grows as the start moves back
                    break
                index = bisect_right(following, start)
                if index < len(following) and following[index] <= last:
                    keep.append(start)
            if done:
                break
        keep.reverse()
        windows[stage] = keep
    return windows


def _level_function(static_prefix: np.ndarray, act_prefix: np.ndarray, in_flight: Sequence[int], caps):
    """level(stage, a, b): memory of entries [a, b) on layout stage ``stage`` over its utilisation weight."""
    static, act = static_prefix.tolist(), act_prefix.tolist()
    weights = utilisation_weights(caps)
    counts = [float(count) for count in in_flight]

    def level(stage: int, start: int, stop: int) -> float:
        weight = weights[stage]
        if weight == math.inf:
            return 0.0
        need = (static[stop] - static[start]) + counts[stage] * (act[stop] - act[start])
        if weight == 0:
            return 0.0 if need <= 0 else math.inf
        return need / weight

    return level
