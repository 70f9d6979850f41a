"""The min-max split of identical decoders by counts, under each rank's coupled memory (interleaved and V-shaped
schedules: a rank holds several layout stages).

Layout stage s holds ``d_s`` identical decoders beside what is pinned to it (the embedding, the loss, or a few
other entries at either end of the profile: :class:`Pins`), between its fewest and most decoders. For a
bottleneck T every stage takes at most ``D_s(T)`` decoders (its time on its rank's GPU within T); each rank's
largest feasible total is a small integer program over its v counts (:class:`~megapipe.partition.rank_problem.
RankProblem`, exact by back-loading: memory is monotone in the counts, so every total between the smallest and
the largest is feasible too), and T is feasible exactly when the ranks' largest totals reach the decoder count.
A search over the values T can take (some stage's time) gives the least bottleneck.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from megapipe.arrays import sorted_unique
from megapipe.partition.rank_problem import RankProblem
from megapipe.records import LayerCost, StageSpec

__all__ = ["Pins", "CountSearch", "count_search", "first_ok", "stage_counts", "boundaries", "rank_stages"]

_EPS = 1e-9


@dataclass(frozen=True, slots=True, kw_only=True)
class Pins:
    """What each layout stage holds besides the identical decoders, and how many of them it may hold."""

    extra: tuple[tuple[float, float, float], ...]
    """(F + B ms, static bytes, activation bytes) of the stage's other entries."""
    entries: tuple[int, ...]
    """How many other entries the stage holds."""
    low: tuple[int, ...]
    """Fewest decoders (one where nothing else keeps the stage non-empty)."""
    cap: tuple[int, ...]
    """Most decoders (none on a stage before the head's last or after the tail's first)."""


def rank_stages(ranks: Sequence[int], pipeline_model_parallel_size: int) -> tuple[tuple[int, ...], ...]:
    """Each rank's layout stages, in stage order (the order of its profile vectors' entries)."""
    out: list[list[int]] = [[] for _ in range(pipeline_model_parallel_size)]
    for stage, rank in enumerate(ranks):
        out[rank].append(stage)
    return tuple(tuple(stages) for stages in out)


@dataclass(frozen=True, slots=True, kw_only=True)
class CountSearch:
    """What the bottleneck tests of one :class:`Pins` share: the ranks' problems and the stages' fixed parts."""

    stages: Sequence[StageSpec]
    ranks: Sequence[int]
    problems: list[RankProblem]
    owned: tuple[tuple[int, ...], ...]
    pins: Pins
    unit: float
    """F + B of one decoder (ms)."""
    num_decoders: int
    monotone: bool
    """Every rank's rows fall along its stages (:attr:`RankProblem.monotone`)."""

    def highs(self, bottleneck: float) -> list[int] | None:
        """Most decoders each stage can take within ``bottleneck``, or None when a stage cannot take its fewest."""
        n, unit, pins = self.num_decoders, self.unit, self.pins
        out = []
        for stage in range(len(self.ranks)):
            scale = self.stages[self.ranks[stage]].time_scale
            limit = bottleneck / scale if scale > 0 else math.inf
            spare = limit - pins.extra[stage][0]
            if unit * n > _EPS * max(1.0, limit):
                top = int(math.floor(spare / unit + _EPS))
            else:  # the decoders' time is lost in rounding: only the pinned entries can exceed the bottleneck
                top = n if spare >= -_EPS * max(1.0, limit) else -1
            if top < pins.low[stage]:
                return None
            out.append(min(top, pins.cap[stage]))
        return out

    def decided(self, bottleneck: float) -> bool | None:
        """Feasibility from cheap bounds alone (None when only the exact rank totals can tell)."""
        high = self.highs(bottleneck)
        if high is None:
            return False
        upper = lower = 0.0
        for rank, problem in enumerate(self.problems):
            top = tuple(high[s] for s in self.owned[rank])
            if top in problem._cache:
                found = problem._cache[top]
                if found is None:
                    return False
                upper, lower = upper + sum(found), lower + sum(found)
            elif not problem.fits(problem.low):
                return False
            elif problem.fits(top):
                upper, lower = upper + sum(top), lower + sum(top)
            else:
                upper += min(sum(top), math.floor(problem.upper(top) + 1e-9))
                lower += sum(problem.low)
        if upper < self.num_decoders:
            return False
        return True if lower >= self.num_decoders else None

    def feasible(self, bottleneck: float) -> tuple[list[int], list[int | None]] | None:
        """Each stage's most decoders and each rank's largest total within ``bottleneck``, or None if too few."""
        high = self.highs(bottleneck)
        if high is None:
            return None
        largest = [self.problems[r].largest(tuple(high[s] for s in self.owned[r])) for r in range(len(self.stages))]
        if any(value is None for value in largest) or sum(largest) < self.num_decoders:
            return None
        return high, largest

    def ok(self, bottleneck: float) -> bool:
        """Whether some split fits within ``bottleneck`` (cheap bounds first, then the exact rank totals)."""
        if self.monotone:  # the exact totals cost no more than the bounds
            return self.feasible(bottleneck) is not None
        quick = self.decided(bottleneck)
        return quick if quick is not None else self.feasible(bottleneck) is not None

    def candidates(self, lower_bound: float | None) -> list[float]:
        """The values a bottleneck can take (some stage's time on its rank's GPU), from ``lower_bound`` up."""
        pins = self.pins
        kinds = {(self.stages[self.ranks[s]].time_scale, pins.extra[s][0], pins.low[s], pins.cap[s])
                 for s in range(len(self.ranks))}
        counts = np.arange(self.num_decoders + 1, dtype=float)
        values = sorted_unique(np.concatenate([scale * (pinned + counts[low:cap + 1] * self.unit)
                                               for scale, pinned, low, cap in kinds]))
        if lower_bound is not None:
            above = values[values >= lower_bound * (1 - 1e-12)]
            values = above if len(above) else values[-1:]
        return values.tolist()


def count_search(*, decoder: LayerCost, num_decoders: int, pins: Pins, stages: Sequence[StageSpec],
                 ranks: Sequence[int], profiles, problems: dict | None = None) -> CountSearch | None:
    """The search over ``pins``, or None when the stages need more decoders than there are. ``problems``: rank
    problems already built, by rank and what its stages hold (shared between the pins of one split)."""
    if sum(pins.low) > num_decoders:
        return None
    owned = rank_stages(ranks, len(stages))
    memo = {} if problems is None else problems
    built = []
    for rank, own in enumerate(owned):
        key = (rank, tuple(pins.extra[s] for s in own), tuple(pins.low[s] for s in own))
        problem = memo.get(key)
        if problem is None:
            problem = memo[key] = RankProblem(decoder, own, profiles[rank], stages[rank].memory_bytes, pins.extra,
                                              [pins.low[s] for s in own])
        built.append(problem)
    return CountSearch(stages=stages, ranks=ranks, problems=built, owned=owned, pins=pins,
                       unit=decoder.fwd_ms + decoder.bwd_ms, num_decoders=num_decoders,
                       monotone=all(problem.monotone for problem in built))


def first_ok(values: Sequence[float], ok) -> int:
    """Index of the least of the ascending ``values`` that passes ``ok`` (the last one does)."""
    # Gallop from the lower bound (the answer is usually a few values above it), then bisect.
    lo, hi, step = 0, len(values) - 1, 1
    while lo + step < hi and not ok(values[lo + step]):
        lo, step = lo + step + 1, step * 2
    hi = min(hi, lo + step)
    while lo < hi:
        mid = (lo + hi) // 2
        if not ok(values[mid]):
            lo = mid + 1
        else:
            hi = mid
    return lo


def stage_counts(search: CountSearch, high: list[int], largest: list[int]) -> list[int]:
    """Decoders per stage within ``high``: each rank's total spread by room left (one decoder at a time to the rank
    with the most, the first on ties), then over its stages."""
    problems, owned = search.problems, search.owned
    counts = [0] * len(search.ranks)
    totals = [sum(problem.low) for problem in problems]
    for _ in range(search.num_decoders - sum(totals)):
        rank = max(range(len(problems)), key=lambda r: (largest[r] - totals[r], -r))
        totals[rank] += 1
    for rank, problem in enumerate(problems):
        chosen = problem.counts(tuple(high[s] for s in owned[rank]), totals[rank])
        for stage, count in zip(owned[rank], chosen):
            counts[stage] = count
    return counts


def boundaries(counts: Sequence[int], pins: Pins) -> tuple[int, ...]:
    """Entry boundaries of the stages holding ``counts`` decoders beside their pinned entries."""
    bounds = [0]
    for count, entries in zip(counts, pins.entries):
        bounds.append(bounds[-1] + count + entries)
    return tuple(bounds)
