"""Memory of a pipeline rank that holds several layout stages (interleaved and V-shaped schedules).

A rank's chunks share its memory, and their activations peak at different moments: at any moment
the rank holds ``sum_c static_c + sum_c n_c * act_c``, where ``n_c`` counts chunk c's microbatches in
flight then (:func:`megapipe.schedules.rank_in_flight_profiles` lists the moments that can be the
peak). So a split fits a rank when, for every such vector n,

    sum_c static_c + sum_c n_c act_c <= memory_bytes of the rank,

which couples non-contiguous layout stages. Three exact solvers of the min-max split under it:

- :func:`uniform_split` (here), for the cost model's dense profiles ([embedding] + identical decoders +
  [loss]): only the decoder count of each stage matters. For a bottleneck T every stage takes at most
  ``D_s(T)`` decoders; each rank's largest feasible total is a small integer program over its v
  counts (memory is monotone in the counts, so every total between the smallest and the largest
  is feasible too), and T is feasible exactly when the ranks' largest totals reach the decoder
  count. Binary search over the candidate T values gives the optimum (:mod:`megapipe.partition.counts`).
- :func:`~megapipe.partition.pinned.pinned_split`, for a few entries at each end around identical decoders
  (a MoE model's embedding and dense layers, its MTP blocks and loss): every placement of the ends is the
  counts problem with those entries pinned to their stages.
- :func:`~megapipe.partition.milp.milp_split`, for any other profile: a mixed-integer program (HiGHS).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from megapipe.partition.counts import Pins, count_search, first_ok, rank_stages, stage_counts, boundaries
from megapipe.records import LayerCost, LayerKind, StageSpec

__all__ = ["UniformShape", "uniform_shape", "rank_stages", "rank_peaks", "ranks_fit", "profile_rows", "uniform_split",
           "uniform_fits", "uniform_may_fit", "uniform_rank_totals", "bottleneck_of", "Stack", "stacked_rows",
           "most_held"]


@dataclass(frozen=True, slots=True, kw_only=True)
class UniformShape:
    """A profile of the form [head] + identical decoders + [tail]."""

    decoder: LayerCost
    num_decoders: int
    head: LayerCost | None
    """A non-decoder first entry (the embedding); it always sits on the first layout stage."""
    tail: LayerCost | None
    """A non-decoder last entry (the loss); it always sits on the last layout stage."""


def uniform_shape(layers: Sequence[LayerCost], *, times: bool = False) -> UniformShape | None:
    """The profile's shape, or None when its decoders differ in bytes (and, with ``times``, in time) or
    other kinds sit between them."""
    head = layers[0] if layers and layers[0].kind != LayerKind.decoder else None
    tail = layers[-1] if len(layers) > 1 and layers[-1].kind != LayerKind.decoder else None
    middle = layers[(head is not None): len(layers) - (tail is not None)]
    if not middle:
        return None
    first = middle[0]

    def key(layer: LayerCost) -> tuple:
        return (layer.static_bytes, layer.act_bytes) + ((layer.fwd_ms + layer.bwd_ms,) if times else ())

    for layer in middle:
        if layer.kind != LayerKind.decoder or key(layer) != key(first):
            return None
    return UniformShape(decoder=first, num_decoders=len(middle), head=head, tail=tail)


def rank_peaks(*, static: Sequence[float], act: Sequence[float], ranks: Sequence[int],
               profiles: Sequence[Sequence[Sequence[int]]]) -> tuple[float, ...]:
    """Each rank's peak bytes over the step: its chunks' static bytes plus the largest in-flight sum."""
    peaks = []
    for rank, stages in enumerate(rank_stages(ranks, len(profiles))):
        rows = profile_rows(profiles[rank])
        held = max((math.fsum(n * act[s] for n, s in zip(vector, stages)) for vector in rows),
                   default=0.0)
        peaks.append(math.fsum(static[s] for s in stages) + held)
    return tuple(peaks)


def ranks_fit(*, static: Sequence[float], act: Sequence[float], ranks: Sequence[int],
              profiles: Sequence[Sequence[Sequence[int]]], caps: Sequence[float]) -> bool:
    """Whether every rank's peak (:func:`rank_peaks`, the same sums) is within its cap; it stops at the first moment
    of the first rank over it."""
    for rank, stages in enumerate(rank_stages(ranks, len(profiles))):
        fixed, cap = math.fsum(static[s] for s in stages), caps[rank]
        for vector in profile_rows(profiles[rank]):  # fixed + the largest sum is the largest of fixed + each sum
            if fixed + math.fsum(n * act[s] for n, s in zip(vector, stages)) > cap:
                return False
    return True


def profile_rows(profile) -> list:
    """A rank's profile vectors as lists of Python ints (an array from the schedule registry, or sequences)."""
    return profile.tolist() if isinstance(profile, np.ndarray) else [list(vector) for vector in profile]


# -- identical decoders ----------------------------------------------------------------------------
def uniform_pins(shape: UniformShape, num_stages: int) -> Pins:
    """What each layout stage holds besides its decoders (the head on the first, the tail on the last) and how
    many decoders it may hold: none beside the head or the tail, one elsewhere (no empty stage), at most all."""
    extra = [(0.0, 0.0, 0.0)] * num_stages
    entries = [0] * num_stages
    for entry, stage in ((shape.head, 0), (shape.tail, num_stages - 1)):
        if entry is not None:
            time, static, act = extra[stage]
            extra[stage] = (time + entry.fwd_ms + entry.bwd_ms, static + entry.static_bytes, act + entry.act_bytes)
            entries[stage] += 1
    low = tuple(0 if entries[stage] else 1 for stage in range(num_stages))
    return Pins(extra=tuple(extra), entries=tuple(entries), low=low, cap=(shape.num_decoders,) * num_stages)


def _uniform_search(shape: UniformShape, stages: Sequence[StageSpec], ranks: Sequence[int], profiles):
    """The counts search of an identical-decoder profile, or None when the stages need more decoders than
    there are."""
    return count_search(decoder=shape.decoder, num_decoders=shape.num_decoders, pins=uniform_pins(shape, len(ranks)),
                        stages=stages, ranks=ranks, profiles=profiles)


def uniform_may_fit(*, shape: UniformShape, stages: Sequence[StageSpec], ranks: Sequence[int],
                    profiles: Sequence[Sequence[Sequence[int]]]) -> bool:
    """False only when no split of the decoders fits every rank's coupled memory. Exact when every rank's rows
    fall along its stages (every schedule's profiles do): all ranks at once on stacked arrays, each rank's
    largest total back-loaded without a bound on the bottleneck, its rounding leaning to True (the solver
    settles those); otherwise each memory row alone bounds a rank's total (a relaxation)."""
    low = uniform_pins(shape, len(ranks)).low
    if sum(low) > shape.num_decoders:
        return False
    stack = stacked_rows(profiles, ranks, len(stages))
    if stack is not None:
        found = _stacked_totals(shape, stages, stack, low)
        if found is not None:
            return found is not False and float(found[1].sum()) >= shape.num_decoders
    problems = _uniform_search(shape, stages, ranks, profiles).problems
    if not all(problem.fits(problem.low) for problem in problems):
        return False
    top = shape.num_decoders
    return sum(problem.upper((top,) * len(problem.stages)) for problem in problems) >= top - 1e-9


def uniform_rank_totals(*, shape: UniformShape, stages: Sequence[StageSpec], ranks: Sequence[int],
                        profiles: Sequence[Sequence[Sequence[int]]]):
    """(fewest, largest) decoders each rank can hold in a split that fits its coupled memory, as arrays over ranks
    (the largest leaning high in rounding, as :func:`uniform_may_fit`'s); False when some rank cannot hold even its
    fewest; None when this closed form does not apply (ranks of unequally many stages, rows not along them)."""
    stack = stacked_rows(profiles, ranks, len(stages))
    if stack is None:
        return None
    return _stacked_totals(shape, stages, stack, uniform_pins(shape, len(ranks)).low)


@dataclass(frozen=True, slots=True)
class Stack:
    """One schedule's in-flight rows of every rank, stacked (what the closed forms of :func:`uniform_rank_totals` and
    :func:`megapipe.partition.pinned.pinned_rank_totals` read of them, the same for every decoder and memory they
    are asked about)."""

    owned: np.ndarray
    """[rank, position]: the layout stage at each of the rank's positions."""
    counts: np.ndarray
    """The stacked rows, as floats."""
    rank_of_row: np.ndarray
    starts: np.ndarray
    """Each rank's first row."""
    falling: bool
    """Every row's counts fall (or hold) from each of its stages to the next."""
    ends: tuple
    """(rows of the rank holding it, its position there) for the first and the last layout stage."""
    last_peaks: tuple[float, ...]
    """Each rank's largest count at its last position (over its rows)."""


_STACKS: dict = {}
"""Stack by (id of the profiles, stage-to-rank map, rank count), each beside the profiles object it was made of: the
search asks about one schedule's profiles (:func:`megapipe.schedules.rank_in_flight_profiles`, one object per
schedule and sizes) for many decoders and memories."""


def stacked_rows(profiles, ranks: Sequence[int], num_ranks: int) -> Stack | None:
    """The stacked rows, or None when ranks hold unequally many stages, or some rank has no row or rows not one count
    per stage it holds."""
    key = (id(profiles), tuple(ranks), num_ranks)
    found = _STACKS.get(key)
    if found is not None and found[0] is profiles:
        return found[1]
    owned = rank_stages(ranks, num_ranks)
    arrays = [np.asarray(profile) for profile in profiles]
    stack = None
    if all(len(array.shape) == 2 and array.shape[1] == len(own) for array, own in zip(arrays, owned)) \
            and len({len(own) for own in owned}) == 1 and all(len(array) for array in arrays):
        counts = np.concatenate(arrays).astype(float)
        sizes = [len(array) for array in arrays]
        rank_of_row = np.repeat(np.arange(len(arrays)), sizes)
        ends = []
        for stage in (0, len(ranks) - 1):  # the embedding's and the loss's layout stages
            rank, position = next((r, own.index(stage)) for r, own in enumerate(owned) if stage in own)
            ends.append((rank_of_row == rank, position))
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        stack = Stack(owned=np.array(owned, dtype=np.int64), counts=counts, rank_of_row=rank_of_row, starts=starts,
                      falling=bool((counts[:, :-1] >= counts[:, 1:]).all()), ends=tuple(ends),
                      last_peaks=tuple(float(peak) for peak in np.maximum.reduceat(counts[:, -1], starts)))
    if len(_STACKS) >= 4096:
        _STACKS.clear()
    _STACKS[key] = (profiles, stack)
    return stack


def most_held(stack: Stack, decoder: LayerCost, stages, top: int, *, slack: float = 1e-9) -> float:
    """The most identical decoders (of ``decoder``'s bytes) the ranks hold together with every stage open, nothing
    pinned and none required: each rank back-loads its last position, whose row of the most in flight there leaves
    it the fewest (room / weight falls as the weight grows; rows' weights fall along their stages). No split holds
    more; ``slack`` leans each rank's floor up."""
    most = 0.0
    for stage, peak in zip(stages, stack.last_peaks):
        heaviest = decoder.static_bytes + peak * decoder.act_bytes
        cap = float(stage.memory_bytes)
        most += min(math.floor((cap + 2e-9 * max(1.0, abs(cap))) / heaviest + slack), top) if heaviest > 0 else top
    return most


def _stacked_totals(shape: UniformShape, stages, stack: Stack, low):
    """:func:`uniform_rank_totals` for ranks of equally many stages, on their stacked rows (None: some rank's rows
    do not fall along its stages). With every other stage at its fewest decoders, back-loading fills a rank's last
    stage until a row's room runs out (each rank's largest total, as :meth:`RankProblem.largest` finds it); a
    rank whose last stage takes every decoder settles it at once. False when no split fits: some rank cannot hold
    even its fewest, or the ranks cannot hold every decoder even with nothing pinned (:func:`most_held`, leaning
    high, asked first)."""
    decoder, top = shape.decoder, shape.num_decoders
    counts, rank_of_row = stack.counts, stack.rank_of_row
    if stack.falling and most_held(stack, decoder, stages, top, slack=1e-6) < top:
        return False
    weights = decoder.static_bytes + counts * decoder.act_bytes
    # rows whose counts fall have falling weights (act_bytes >= 0, and rounding keeps the order); others are checked
    if not stack.falling and not (weights[:, :-1] >= weights[:, 1:]).all():
        return None
    lows = np.asarray(low, dtype=float)[stack.owned]
    room = np.array([stage.memory_bytes for stage in stages], dtype=float)[rank_of_row]
    for entry, (rows, position) in zip((shape.head, shape.tail), stack.ends):
        if entry is not None:
            room[rows] -= entry.static_bytes + counts[rows, position] * entry.act_bytes
    spare = room + 2e-9 * np.maximum(1.0, np.abs(room)) - (weights * lows[rank_of_row]).sum(axis=1)
    if (spare < 0).any():
        return False
    last = weights[:, -1]
    within = np.where(last > 0, np.floor(spare / np.where(last > 0, last, 1.0) + 1e-9), top)
    most = np.minimum.reduceat(within, stack.starts)
    fewest = lows.sum(axis=1)
    return fewest, fewest + np.minimum(most, top)


def uniform_fits(*, shape: UniformShape, stages: Sequence[StageSpec], ranks: Sequence[int],
                 profiles: Sequence[Sequence[Sequence[int]]]) -> bool:
    """Whether any split of the decoders fits every rank's coupled memory (no bound on the bottleneck)."""
    found = _uniform_search(shape, stages, ranks, profiles)
    if found is None:
        return False
    largest = [problem.largest((shape.num_decoders,) * len(problem.stages)) for problem in found.problems]
    return None not in largest and sum(largest) >= shape.num_decoders


def uniform_split(*, shape: UniformShape, stages: Sequence[StageSpec], ranks: Sequence[int],
                  profiles: Sequence[Sequence[Sequence[int]]], lower_bound: float | None = None) -> tuple[int, ...] | None:
    """Boundaries (entry indices) of the min-max split under the coupled rank memory, or None if none fits.

    ``lower_bound``: a bottleneck no split beats (the split without memory limits), where the search starts."""
    search = _uniform_search(shape, stages, ranks, profiles)
    if search is None:
        return None
    values = search.candidates(lower_bound)
    if not values or not search.ok(values[-1]):
        return None
    high, largest = search.feasible(values[first_ok(values, search.ok)])
    return boundaries(stage_counts(search, high, largest), search.pins)


def bottleneck_of(layers, stages, ranks, bounds) -> float:
    """The slowest layout stage's F + B on its rank's GPU."""
    return max(stages[ranks[c]].time_scale * math.fsum(e.fwd_ms + e.bwd_ms for e in layers[a:b])
               for c, (a, b) in enumerate(zip(bounds, bounds[1:])))
