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
Stage ``j``'s reach ``r_j(a)`` (the last stop whose segment from ``a`` fits ``B`` and
memory) never decreases in ``a``, so stop ``b`` is reachable after stage ``j`` iff
``r_j(pred(b)) >= b`` with ``pred(b)`` the largest reachable start below ``b``: each
interval ``[lo, hi]`` yields the stops ``e + 1`` of the entries ``e`` in it that fit
alone, plus ``[hi + 2, r_j(hi)]`` up to the next interval. Stops that leave fewer
entries than remaining stages are cut off (every stage holds at least one entry).
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

__all__ = ["SegmentCost", "min_max_split", "reachable_sets", "segment_cost", "time_stop"]

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


def time_stop(prefix: Sequence[float], scale: float, offset: float, start: int, limit: int, bound: float) -> int:
    """The last stop in [start, limit] whose segment from ``start`` costs at most ``bound`` (``start`` if none).

    Bisection on the prefix sums, then settled on the canonical cost ``scale * (prefix[b] - prefix[start]) +
    offset``, so every caller compares exactly the costs :func:`segment_cost` gives.
    """
    base = prefix[start]
    stop = bisect_right(prefix, base + (bound - offset) / scale, start, limit + 1) - 1
    if stop < start:
        stop = start
    while stop < limit and scale * (prefix[stop + 1] - base) + offset <= bound:
        stop += 1
    while stop > start and scale * (prefix[stop] - base) + offset > bound:
        stop -= 1
    return stop


class _Probe:
    """Reachable prefix lengths after each stage for one bound; see the module docstring."""

    def __init__(self, stages: Sequence[SegmentCost], num_entries: int):
        self.stages = stages
        self.num_entries = num_entries
        self.largest = [segment_cost(stage, stage.single_desc[0], stage.single_desc[0] + 1) for stage in stages]
        # The hot loop's per-stage fields, unpacked once per solve rather than once per probe and stage.
        self.rows = [
            (stage, largest, stage.mem_blocked, len(stage.mem_blocked), stage.mem_reach, stage.prefix, stage.scale,
             stage.offset)
            for stage, largest in zip(stages, self.largest)
        ]

    def run(self, bound: float) -> tuple[list[list[tuple[int, int]]] | None, float]:
        """(history of reachable intervals, or None when infeasible; next bound that changes a comparison)."""
        reach = [(0, 0)]
        history = [reach]
        next_bound = _INF
        max_pos = self.num_entries - len(self.stages)
        single = True  # reach holds one interval
        for stage, largest, blocked, num_blocked, mem_reach, prefix, scale, offset in self.rows:
            max_pos += 1  # num_entries - (stages after this one)
            if single and largest <= bound:
                low, high = reach[0]
                # Reachable stops never pass the previous stage's max_pos, so low <= high <= max_pos - 1 and
                # "no blocked entry in [low, high]" reads: the first blocked entry >= low lies past high.
                first = bisect_left(blocked, low) if num_blocked else 0
                if first == num_blocked or blocked[first] > (high if high < max_pos else max_pos - 1):
                    # Common case: every entry that could end here fits this stage alone: one interval stays one.
                    # This is _jump inlined (the probe's hot loop).
                    if high + 2 > max_pos:
                        reach = [(low + 1, high + 1)]
                        history.append(reach)
                        continue
                    limit = mem_reach[high]
                    if limit > max_pos:
                        limit = max_pos
                    if bound == _INF:
                        stop = limit
                    else:
                        stop = time_stop(prefix, scale, offset, high, limit, bound)
                        if stop < limit:
                            change = scale * (prefix[stop + 1] - prefix[high]) + offset
                            if change < next_bound:
                                next_bound = change
                    reach = [(low + 1, stop if stop > high else high + 1)]
                    history.append(reach)
                    continue
            reach, change = self._general_step(stage, reach, max_pos, bound)
            if change < next_bound:
                next_bound = change
            if not reach:
                return None, next_bound
            single = len(reach) == 1
            history.append(reach)
        if reach[-1][1] != self.num_entries:
            return None, next_bound
        return history, next_bound

    def _general_step(self, stage: SegmentCost, reach, max_pos: int, bound: float):
        """Reachable stops after ``stage`` from any interval list, and the smallest bound that changes them."""
        blocked, time_blocked = self._blocked_entries(stage, bound)
        runs: list[tuple[int, int]] = []
        next_bound = _INF
        for pos, (low, high) in enumerate(reach):
            following = reach[pos + 1][0] if pos + 1 < len(reach) else self.num_entries
            next_bound = min(next_bound, self._own_runs(runs, low, high, max_pos, blocked, time_blocked))
            stop, change = self._jump(stage, high, min(following, max_pos), bound)
            next_bound = min(next_bound, change)
            if stop >= high + 2:
                runs.append((high + 2, stop))
        return _merge(runs), next_bound

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

    def _jump(self, stage: SegmentCost, high: int, limit: int, bound: float) -> tuple[int, float]:
        """(last stop in [high + 2, limit] reachable from start ``high``, or less; bound that would extend it)."""
        if high + 2 > limit:
            return high + 1, _INF
        memory_stop = stage.mem_reach[high]
        if memory_stop < limit:
            limit = memory_stop
        if bound == _INF:
            return limit, _INF
        prefix, scale, offset = stage.prefix, stage.scale, stage.offset
        stop = time_stop(prefix, scale, offset, high, limit, bound)
        if stop < limit:
            return stop, scale * (prefix[stop + 1] - prefix[high]) + offset
        return stop, _INF


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
        pos = 0 if len(intervals) == 1 else bisect_right([low for low, _ in intervals], stop - 1) - 1
        start = min(intervals[pos][1], stop - 1)
        assert start >= intervals[pos][0] and stages[index - 1].mem_reach[start] >= stop
        bounds.append(start)
        stop = start
    bounds.reverse()
    worst = -_INF
    for stage, start, stop in zip(stages, bounds, bounds[1:]):
        cost = stage.scale * (stage.prefix[stop] - stage.prefix[start]) + stage.offset  # segment_cost, inlined
        if cost > worst:
            worst = cost
    return bounds, worst


def min_max_split(
    *, stages: Sequence[SegmentCost], num_entries: int, lower_bound: float
) -> tuple[float, tuple[int, ...]] | None:
    """The exact minimum bottleneck and its stage boundaries (len(stages) + 1), or None if memory never fits.

    ``lower_bound`` must not exceed the optimum; a tight one saves probes. The search
    gallops up from it (steps of lower_bound / 64, doubling) until a probe succeeds,
    then bisects; every probe snaps one end to an achieved value.
    """
    probe = _Probe(stages, num_entries)
    history, _ = probe.run(_INF)
    if history is None:
        return None
    if not math.isfinite(lower_bound):
        lower_bound = min(probe.largest)
    lower, upper, bounds = lower_bound, _INF, None
    step = abs(lower_bound) / 64 or 1.0
    while lower < upper:
        if upper == _INF:
            bound, step = lower + step, step * 2
        else:
            bound = lower + (upper - lower) / 2
            if not lower <= bound < upper:
                bound = lower
        history, next_bound = probe.run(bound)
        if history is None:
            assert next_bound > bound, "an infeasible probe must name a larger bound"
            lower = next_bound
        else:
            bounds, upper = _reconstruct(history, stages, num_entries)
    assert bounds is not None
    return upper, tuple(bounds)



def reachable_sets(*, stages: Sequence[SegmentCost], num_entries: int, bound: float) -> list[list[tuple[int, int]]] | None:
    """Reachable stops after 0, 1, ... stages (sorted disjoint inclusive intervals) at ``bound``, or None.

    One feasibility probe (see the module docstring); entry j of the result holds every
    prefix length that j stages can cover with each stage costing at most ``bound``
    within its memory reach, leaving enough entries for the rest.
    """
    history, _ = _Probe(stages, num_entries).run(bound)
    return history
