"""Exact min-max contiguous partition with per-stage costs and memory caps.

Problem: split entries ``0..n-1`` into ``len(stages)`` contiguous, non-empty
segments, segment ``j`` on stage ``j``, so that every segment fits stage ``j``'s
memory and the largest stage cost is as small as possible. Stage ``j``'s cost of
segment ``[a, b)`` is ``scale_j * (prefix_j[b] - prefix_j[a]) + offset_j``; it
never decreases when the segment grows, which is all the method needs.

Method: exact bisection over the bottleneck (Pinar & Aykanat, "Fast optimal load
balancing algorithms for 1D partitioning", JPDC 2004), with a feasibility probe
that tracks the full *set* of reachable prefix lengths instead of one greedy
frontier. With heterogeneous stages an entry may fit some stages and not others,
so the reachable set can have holes; it is kept as sorted disjoint intervals.
Bound ``B`` is feasible iff ``n`` is reachable after the last stage. Both ends of
the search snap to achieved values: a feasible probe lowers the upper bound to
the bottleneck of the partition it found; an infeasible probe raises the lower
bound to the smallest cost that would have changed one of its comparisons. The
loop ends when they meet, so the result is the exact optimum of the cost model
(no epsilon), in O(probes * stages * intervals * log n) time.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["SegmentCost", "min_max_split", "segment_cost"]

_INF = math.inf


@dataclass(frozen=True, slots=True, kw_only=True)
class SegmentCost:
    """One stage's cost model over the entries and its memory reach."""

    prefix: Sequence[float]
    """Non-decreasing prefix sums, length n + 1, prefix[0] == 0."""
    scale: float
    """Multiplier (> 0) on a segment's prefix difference, e.g. the stage's time_scale."""
    offset: float
    """Added to every segment's cost (0 for times; -cap for memory overage)."""
    mem_reach: Sequence[int]
    """mem_reach[a]: the largest b >= a whose segment [a, b) fits this stage's memory."""
    mem_blocked: Sequence[int]
    """Sorted entries e with mem_reach[e] == e: too big for this stage's memory even alone."""
    single_desc: Sequence[int]
    """Entry indices sorted by single-entry prefix difference, largest first."""


def segment_cost(stage: SegmentCost, start: int, stop: int) -> float:
    """The canonical cost of entries [start, stop) on ``stage``; every comparison uses it."""
    return stage.scale * (stage.prefix[stop] - stage.prefix[start]) + stage.offset


def _time_reach(stage: SegmentCost, start: int, bound: float, num_entries: int) -> int:
    """The largest stop with segment_cost(start, stop) <= bound (start if none)."""
    prefix = stage.prefix
    if bound == _INF:
        return num_entries
    target = prefix[start] + (bound - stage.offset) / stage.scale
    stop = max(start, bisect_right(prefix, target, start, num_entries + 1) - 1)
    # The bisection works on prefix values; fix its rounding with the canonical cost.
    while stop < num_entries and segment_cost(stage, start, stop + 1) <= bound:
        stop += 1
    while stop > start and segment_cost(stage, start, stop) > bound:
        stop -= 1
    return stop


class _Probe:
    """Reachable prefix lengths after each stage for one bound; see the module docstring."""

    def __init__(self, stages: Sequence[SegmentCost], num_entries: int):
        self.stages = stages
        self.num_entries = num_entries

    def run(self, bound: float) -> tuple[list[list[tuple[int, int]]] | None, float]:
        """(history of reachable intervals, or None when infeasible; next bound that changes a comparison)."""
        reach = [(0, 0)]
        history = [reach]
        next_bound = _INF
        num_stages = len(self.stages)
        for index, stage in enumerate(self.stages):
            max_pos = self.num_entries - (num_stages - index - 1)
            blocked, time_blocked = self._blocked_entries(stage, bound)
            runs: list[tuple[int, int]] = []
            for pos, (low, high) in enumerate(reach):
                following = reach[pos + 1][0] if pos + 1 < len(reach) else self.num_entries
                next_bound = min(next_bound, self._own_runs(runs, low, high, max_pos, blocked, time_blocked))
                next_bound = min(next_bound, self._jump_run(runs, stage, high, min(following, max_pos), bound))
            reach = _merge(runs)
            if not reach:
                return None, next_bound
            history.append(reach)
        if reach[-1][1] != self.num_entries:
            return None, next_bound
        return history, next_bound

    @staticmethod
    def _blocked_entries(stage: SegmentCost, bound: float) -> tuple[list[int], dict[int, float]]:
        time_blocked: dict[int, float] = {}
        for entry in stage.single_desc:
            cost = segment_cost(stage, entry, entry + 1)
            if cost <= bound:
                break
            if stage.mem_reach[entry] > entry:
                time_blocked[entry] = cost
        if not time_blocked:
            return stage.mem_blocked, time_blocked
        return sorted(set(stage.mem_blocked) | time_blocked.keys()), time_blocked

    @staticmethod
    def _own_runs(runs, low, high, max_pos, blocked, time_blocked) -> float:
        """Stops b = e + 1 for entries e in [low, high] that fit alone (predecessor b - 1 is reachable)."""
        last = min(high, max_pos - 1)
        if last < low:
            return _INF
        next_bound = _INF
        start = low
        for entry in blocked[bisect_left(blocked, low) : bisect_right(blocked, last)]:
            if entry in time_blocked:
                next_bound = min(next_bound, time_blocked[entry])
            if entry > start:
                runs.append((start + 1, entry))
            start = entry + 1
        if start <= last:
            runs.append((start + 1, last + 1))
        return next_bound

    def _jump_run(self, runs, stage: SegmentCost, high: int, limit: int, bound: float) -> float:
        """Stops in [high + 2, limit] reached from ``high``, the last reachable start before them."""
        if high + 2 > limit:
            return _INF
        memory_stop = stage.mem_reach[high]
        time_stop = _time_reach(stage, high, bound, self.num_entries)
        stop = min(memory_stop, time_stop, limit)
        if stop >= high + 2:
            runs.append((high + 2, stop))
        if time_stop < min(memory_stop, limit):
            return segment_cost(stage, high, time_stop + 1)
        return _INF


def _merge(runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    runs.sort()
    merged: list[tuple[int, int]] = []
    for low, high in runs:
        if merged and low <= merged[-1][1] + 1:
            if high > merged[-1][1]:
                merged[-1] = (merged[-1][0], high)
        else:
            merged.append((low, high))
    return merged


def _reconstruct(history, stages: Sequence[SegmentCost], num_entries: int) -> tuple[list[int], float]:
    """Stage boundaries from the reachable sets, taking the latest reachable start for each stage."""
    bounds = [num_entries]
    stop = num_entries
    for index in range(len(stages), 0, -1):
        intervals = history[index - 1]
        pos = bisect_right([low for low, _ in intervals], stop - 1) - 1
        start = min(intervals[pos][1], stop - 1)
        assert start >= intervals[pos][0] and stages[index - 1].mem_reach[start] >= stop
        bounds.append(start)
        stop = start
    bounds.reverse()
    costs = [segment_cost(stage, bounds[i], bounds[i + 1]) for i, stage in enumerate(stages)]
    return bounds, max(costs)


def min_max_split(
    *, stages: Sequence[SegmentCost], num_entries: int, lower_bound: float
) -> tuple[float, tuple[int, ...]] | None:
    """The exact minimum bottleneck and its stage boundaries (len(stages) + 1), or None if memory never fits.

    ``lower_bound`` must not exceed the optimum; a tight one saves probes.
    """
    probe = _Probe(stages, num_entries)
    history, _ = probe.run(_INF)
    if history is None:
        return None
    bounds, upper = _reconstruct(history, stages, num_entries)
    lower = min(lower_bound, upper)
    while lower < upper:
        bound = lower + (upper - lower) / 2
        if not lower <= bound < upper:
            bound = lower
        history, next_bound = probe.run(bound)
        if history is None:
            assert next_bound > bound, "an infeasible probe must name a larger bound"
            lower = next_bound
        else:
            bounds, upper = _reconstruct(history, stages, num_entries)
    return upper, tuple(bounds)
