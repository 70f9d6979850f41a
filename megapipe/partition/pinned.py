"""The exact coupled-memory split of a profile with a few entries at its ends around a run of identical decoders:
a MoE model's embedding and first dense layers, its MoE layers, its MTP blocks and loss (DeepSeek-V3:
``E t*3 | t*58 | m L``), on schedules where a rank holds several layout stages.

A split puts the head's entries on the first stages, each stage a non-empty part of them in order, the last of
those stages ``h`` possibly with decoders; likewise the tail's on the last stages, the first of them ``t`` possibly
with decoders; every stage between holds at least one decoder, and none before ``h`` or after ``t`` holds any
(they come after the head and before the tail). Each choice of the two compositions fixes what every stage holds
besides its decoders (:class:`~megapipe.partition.counts.Pins`), and the rest is the identical-decoder problem by
counts (:mod:`megapipe.partition.counts`, exact by back-loading). There are ``2^(a-1) x 2^(b-1)`` choices for ``a``
head and ``b`` tail entries (16 for DeepSeek-V3); the least bottleneck over those whose MTP blocks sit where
megatron-core takes them (:func:`megapipe.layout.mtp_problem`) is the optimum, the first choice winning ties.
Each choice is first tried just below the best so far, so most cost one feasibility test.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from megapipe.layout import mtp_problem
from megapipe.partition.counts import Pins, boundaries, count_search, first_ok, rank_stages, stage_counts
from megapipe.partition.coupled import Stack, most_held, stacked_rows
from megapipe.records import LayerCost, LayerKind, StageSpec

__all__ = ["PinnedShape", "pinned_shape", "pinned_split", "pinned_may_fit", "pinned_cases", "pinned_rank_totals"]

MAX_CASES = 256
"""The most placements of the ends the split enumerates (``2^(a-1) x 2^(b-1)``: a + b up to 10 entries)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PinnedShape:
    """A profile of the form head + identical decoders + tail."""

    head: tuple[LayerCost, ...]
    decoder: LayerCost
    num_decoders: int
    tail: tuple[LayerCost, ...]


def _same(layer: LayerCost) -> tuple:
    return layer.kind, layer.fwd_ms + layer.bwd_ms, layer.static_bytes, layer.act_bytes


def pinned_shape(layers: Sequence[LayerCost], *, max_cases: int = MAX_CASES) -> PinnedShape | None:
    """The profile around its longest run of identical decoders (equal time and bytes), or None when it has no
    decoder or its ends have more than ``max_cases`` placements."""
    best_start, best_length, start = 0, 0, 0
    for index in range(1, len(layers) + 1):
        if index == len(layers) or _same(layers[index]) != _same(layers[start]):
            if layers[start].kind == LayerKind.decoder and index - start > best_length:
                best_start, best_length = start, index - start
            start = index
    tail = len(layers) - best_start - best_length
    if not best_length or 2 ** (max(best_start - 1, 0) + max(tail - 1, 0)) > max_cases:
        return None
    return PinnedShape(head=tuple(layers[:best_start]), decoder=layers[best_start], num_decoders=best_length,
                       tail=tuple(layers[best_start + best_length:]))


def _compositions(count: int) -> list[tuple[int, ...]]:
    """Every way to cut ``count`` entries into non-empty parts in order, fewest parts first."""
    if not count:
        return [()]
    out = []
    for cuts in range(count):
        for where in itertools.combinations(range(1, count), cuts):
            edges = (0, *where, count)
            out.append(tuple(b - a for a, b in zip(edges, edges[1:])))
    return out


def _extra(entries: Sequence[LayerCost]) -> tuple[float, float, float]:
    return (sum(e.fwd_ms + e.bwd_ms for e in entries), sum(e.static_bytes for e in entries),
            sum(e.act_bytes for e in entries))


def pinned_cases(shape: PinnedShape, num_stages: int) -> Iterator[tuple[Pins, tuple[tuple[LayerKind, ...], ...]]]:
    """Every placement of the head's and the tail's entries over ``num_stages`` stages, with each stage's kinds
    (a decoder standing for the decoders a stage between them holds)."""
    for pins, kinds, _ in _placements(shape, num_stages):
        yield pins, kinds


def _placements(shape: PinnedShape, num_stages: int):
    """:func:`pinned_cases` with the entries each stage holds besides its decoders."""
    n = shape.num_decoders
    for head_parts in _compositions(len(shape.head)):
        for tail_parts in _compositions(len(shape.tail)):
            middle = num_stages - len(head_parts) - len(tail_parts)
            if middle < -(bool(head_parts) and bool(tail_parts)) or max(middle, 0) > n:
                continue
            pieces: list[list[LayerCost]] = [[] for _ in range(num_stages)]
            low, cap = [1] * num_stages, [n] * num_stages
            start = 0
            for stage, size in enumerate(head_parts):
                pieces[stage] += shape.head[start:start + size]
                start += size
                low[stage], cap[stage] = 0, (n if stage == len(head_parts) - 1 else 0)
            start = 0
            first = num_stages - len(tail_parts)
            for offset, size in enumerate(tail_parts):
                stage = first + offset
                pieces[stage] += shape.tail[start:start + size]
                start += size
                low[stage], cap[stage] = 0, (n if offset == 0 else 0)
            kinds = tuple(tuple(e.kind for e in piece) or (LayerKind.decoder,) for piece in pieces)
            pins = Pins(extra=tuple(_extra(piece) if piece else _NOTHING for piece in pieces),
                        entries=tuple(len(piece) for piece in pieces), low=tuple(low), cap=tuple(cap))
            yield pins, kinds, pieces


_NOTHING = (0.0, 0.0, 0.0)


def _allowed(kinds, pipeline_model_parallel_size: int) -> bool:
    return mtp_problem(kinds, pipeline_model_parallel_size=pipeline_model_parallel_size) is None


def pinned_split(*, shape: PinnedShape, stages: Sequence[StageSpec], ranks: Sequence[int],
                 profiles: Sequence[Sequence[Sequence[int]]], lower_bound: float | None = None
                 ) -> tuple[int, ...] | None:
    """Boundaries (entry indices) of the min-max split under the coupled rank memory whose MTP blocks megatron-core
    takes, or None if none fits. ``lower_bound``: a bottleneck no split beats, where each search starts."""
    problems: dict = {}
    best = None
    unit = shape.decoder.fwd_ms + shape.decoder.bwd_ms
    scales = [stages[rank].time_scale for rank in ranks]
    for pins, kinds in pinned_cases(shape, len(ranks)):
        if not _allowed(kinds, len(stages)):
            continue
        # every stage takes at least its pinned entries and fewest decoders: a placement that cannot beat the best
        floor = max(scale * (extra[0] + low * unit) for scale, extra, low in zip(scales, pins.extra, pins.low))
        if best is not None and floor >= best[0] * (1 - 1e-12):
            continue
        search = count_search(decoder=shape.decoder, num_decoders=shape.num_decoders, pins=pins, stages=stages,
                              ranks=ranks, profiles=profiles, problems=problems)
        if search is None:
            continue
        values = search.candidates(lower_bound)
        if best is not None:  # only a strictly better bottleneck replaces the first found
            values = [value for value in values if value < best[0] * (1 - 1e-12)]
        if not values or not search.ok(values[-1]):
            continue
        bottleneck = values[first_ok(values, search.ok)]
        best = (bottleneck, search)
    if best is None:
        return None
    bottleneck, search = best
    high, largest = search.feasible(bottleneck)
    return boundaries(stage_counts(search, high, largest), search.pins)


def pinned_may_fit(*, shape: PinnedShape, stages: Sequence[StageSpec], ranks: Sequence[int],
                   profiles: Sequence[Sequence[Sequence[int]]]) -> bool:
    """False only when no split fits every rank's coupled memory (wherever its MTP blocks sit): some placement of
    the ends whose ranks' largest totals, each back-loaded without a bound on the bottleneck, reach the decoder
    count. Exact when every rank's rows fall along its stages (every schedule's profiles do), rounding toward
    True; otherwise each memory row alone bounds a rank's total."""
    stack = stacked_rows(profiles, ranks, len(stages))
    if stack is not None:
        found = _stacked_capacity(shape, stages, stack, len(ranks))
        if found is not None:
            if found is False:
                return False
            fits, _, largest = found
            return bool((fits & (largest.sum(axis=1) >= shape.num_decoders)).any())
    owned = rank_stages(ranks, len(stages))
    arrays = [np.asarray(profile, dtype=float).reshape(-1, len(own)) for profile, own in zip(profiles, owned)]
    capacity = _Capacity(shape, stages, owned, arrays)
    return any(capacity.reaches(pins) for pins, _ in pinned_cases(shape, len(ranks)))


def pinned_rank_totals(*, shape: PinnedShape, stages: Sequence[StageSpec], ranks: Sequence[int],
                       profiles: Sequence[Sequence[Sequence[int]]]):
    """Per placement of the ends that megatron-core takes (its MTP blocks where :func:`megapipe.layout.mtp_problem`
    allows them) and whose pinned entries and fewest decoders fit every rank: (each rank's pinned entries' F + B,
    the fewest and the largest run decoders it can hold within its coupled memory), as arrays over placements and
    ranks, the largest leaning high in rounding as :func:`pinned_may_fit`'s. Every split that fits is one of these
    placements with each rank's decoders between its fewest and its largest. None when this closed form does not
    apply (ranks of unequally many stages, rows not along them)."""
    stack = stacked_rows(profiles, ranks, len(stages))
    if stack is None:
        return None
    found = _stacked_capacity(shape, stages, stack, len(ranks))
    if found is None:
        return None
    if found is False:
        nothing = np.zeros((0, len(stack.starts)))
        return nothing, nothing, nothing
    fits, fewest, largest = found
    keep = fits & _allowed_cases(shape, len(ranks), len(stages))
    ends = np.array([e.fwd_ms + e.bwd_ms for e in shape.head + shape.tail], dtype=float)
    stage_ms = _case_layout(len(shape.head), len(shape.tail), len(ranks), shape.num_decoders).holds[keep] @ ends
    return stage_ms[:, stack.owned].sum(axis=2), fewest[keep], largest[keep]


@lru_cache(maxsize=256)
def _allowed_kinds(head: tuple, tail: tuple, num_stages: int, num_decoders: int, pipeline_model_parallel_size: int
                   ) -> np.ndarray:
    """Which rows of :func:`_case_layout` place the MTP blocks where megatron-core takes them, for ends of these
    kinds."""
    marks = [LayerCost(name="", kind=kind, fwd_ms=0.0, bwd_ms=0.0, wgrad_ms=0.0, static_bytes=0.0, act_bytes=0.0)
             for kind in head + tail]
    placeholder = PinnedShape(head=tuple(marks[:len(head)]), decoder=LayerCost(
        name="d", kind=LayerKind.decoder, fwd_ms=0.0, bwd_ms=0.0, wgrad_ms=0.0, static_bytes=0.0, act_bytes=0.0),
        num_decoders=num_decoders, tail=tuple(marks[len(head):]))
    mask = np.array([_allowed(kinds, pipeline_model_parallel_size) for pins, kinds in
                     pinned_cases(placeholder, num_stages) if sum(pins.low) <= num_decoders], dtype=bool)
    mask.setflags(write=False)
    return mask


def _allowed_cases(shape: PinnedShape, num_stages: int, pipeline_model_parallel_size: int) -> np.ndarray:
    return _allowed_kinds(tuple(e.kind for e in shape.head), tuple(e.kind for e in shape.tail), num_stages,
                          shape.num_decoders, pipeline_model_parallel_size)


@dataclass(frozen=True, slots=True)
class _CaseTable:
    """Every placement of the ends as arrays (placements x stages): what the stage holds besides its decoders, its
    fewest decoders and whether it may take more."""

    static: np.ndarray
    act: np.ndarray
    low: np.ndarray
    open: np.ndarray
    """The stage may hold more than its fewest decoders."""


@dataclass(frozen=True, slots=True)
class _CaseLayout:
    """Every placement of ``a`` head and ``b`` tail entries over the stages, without their costs."""

    holds: np.ndarray
    """Placements x stages x end entries: 1 where the stage holds the entry."""
    low: np.ndarray
    open: np.ndarray


def _case_table(shape: PinnedShape, num_stages: int) -> _CaseTable:
    """:func:`pinned_cases` as arrays, those with more fewest decoders than there are left out."""
    layout = _case_layout(len(shape.head), len(shape.tail), num_stages, shape.num_decoders)
    ends = shape.head + shape.tail
    static = layout.holds @ np.array([e.static_bytes for e in ends], dtype=float).reshape(len(ends))
    act = layout.holds @ np.array([e.act_bytes for e in ends], dtype=float).reshape(len(ends))
    return _CaseTable(static=static, act=act, low=layout.low, open=layout.open)


@lru_cache(maxsize=256)
def _case_layout(head: int, tail: int, num_stages: int, num_decoders: int) -> _CaseLayout:
    """Where every placement of the ends puts each end entry, and each stage's fewest decoders and whether it may
    take more (:func:`pinned_cases` on placeholder entries)."""
    marks = [LayerCost(name=str(index), kind=LayerKind.embedding if index < head else LayerKind.loss, fwd_ms=0.0,
                       bwd_ms=0.0, wgrad_ms=0.0, static_bytes=0.0, act_bytes=0.0) for index in range(head + tail)]
    placeholder = PinnedShape(head=tuple(marks[:head]), decoder=LayerCost(
        name="d", kind=LayerKind.decoder, fwd_ms=0.0, bwd_ms=0.0, wgrad_ms=0.0, static_bytes=0.0, act_bytes=0.0),
        num_decoders=num_decoders, tail=tuple(marks[head:]))
    holds, low, open_ = [], [], []
    for pins, _, pieces in _placements(placeholder, num_stages):
        if sum(pins.low) > num_decoders:
            continue
        grid = np.zeros((num_stages, head + tail))
        for stage, piece in enumerate(pieces):
            for entry in piece:
                grid[stage, int(entry.name)] = 1.0
        holds.append(grid)
        low.append(pins.low)
        open_.append([cap > least for cap, least in zip(pins.cap, pins.low)])
    layout = _CaseLayout(holds=np.array(holds).reshape(-1, num_stages, head + tail),
                         low=np.array(low, dtype=float).reshape(-1, num_stages),
                         open=np.array(open_, dtype=bool).reshape(-1, num_stages))
    for array in (layout.holds, layout.low, layout.open):
        array.setflags(write=False)
    return layout


def _stacked_capacity(shape: PinnedShape, stages, stack: Stack, num_stages: int):
    """For ranks of equally many stages, every placement of the ends (:func:`_case_table`) and rank at once on their
    stacked rows: (whether the placement's pinned entries and fewest decoders fit every rank, each rank's fewest and
    largest run decoders), over placements and ranks; None when some rank's rows do not fall along its stages, False
    when even with nothing pinned the ranks cannot hold every decoder (no placement fits). Back-loading with every
    other stage at its fewest fills the last stage that may take decoders until a row's room runs out."""
    decoder, n = shape.decoder, shape.num_decoders
    starts = stack.starts
    counts, rank_of_row = stack.counts, stack.rank_of_row
    weights = decoder.static_bytes + counts * decoder.act_bytes
    # rows whose counts fall have falling weights (act_bytes >= 0, and rounding keeps the order); others are checked
    if not stack.falling and not (weights[:, :-1] >= weights[:, 1:]).all():
        return None
    if most_held(stack, decoder, stages, n) < n:  # no placement holds more than every stage open, nothing pinned
        return False
    room = np.array([stage.memory_bytes for stage in stages], dtype=float)[rank_of_row]
    room = room + 2e-9 * np.maximum(1.0, np.abs(room))
    table = _case_table(shape, num_stages)
    if not len(table.low):
        return False
    stage_of = stack.owned[rank_of_row]  # rows x chunks: the layout stage of each column
    low = table.low[:, stage_of]  # placements x rows x chunks
    held = (table.static[:, stage_of] + counts * table.act[:, stage_of] + weights * low).sum(axis=2)
    spare = room - held  # placements x rows
    open_ = table.open[:, stage_of]
    chunks = counts.shape[1]
    last_open = chunks - 1 - np.argmax(open_[:, :, ::-1], axis=2)  # placements x rows
    fill = np.take_along_axis(np.broadcast_to(weights, low.shape), last_open[:, :, None], axis=2)[:, :, 0]
    most = np.where(fill > 0, np.floor(spare / np.where(fill > 0, fill, 1.0) + 1e-9), n)
    most = np.where(open_.any(axis=2), np.minimum(most, n), 0.0)
    fewest = low[:, starts, :].sum(axis=2)
    fits = (spare >= 0).all(axis=1)
    return fits, fewest, np.minimum.reduceat(most, starts, axis=1) + fewest


class _Capacity:
    """Each rank's largest total at no bound on the bottleneck, per what its stages hold, memoised."""

    def __init__(self, shape: PinnedShape, stages, owned, arrays):
        self.shape, self.stages, self.owned, self.arrays = shape, stages, owned, arrays
        self._found: dict[tuple, float] = {}

    def reaches(self, pins: Pins) -> bool:
        if sum(pins.low) > self.shape.num_decoders:
            return False
        total = 0.0
        for rank, own in enumerate(self.owned):
            key = (rank,) + tuple((pins.extra[s], pins.low[s], pins.cap[s]) for s in own)
            found = self._found.get(key)
            if found is None:
                found = self._found[key] = self._largest(rank, own, pins)
            if found < 0:
                return False
            total += found
        return total >= self.shape.num_decoders

    def _largest(self, rank: int, own: tuple[int, ...], pins: Pins) -> float:
        """The rank's largest total (-1 when even its fewest do not fit), leaning up by a relative 2e-9 of room."""
        decoder, n = self.shape.decoder, self.shape.num_decoders
        counts = self.arrays[rank]
        weights = decoder.static_bytes + counts * decoder.act_bytes
        pinned = sum(pins.extra[s][1] + counts[:, i] * pins.extra[s][2] for i, s in enumerate(own))
        room = self.stages[rank].memory_bytes - pinned
        low = np.array([pins.low[s] for s in own], dtype=float)
        spare = room + 2e-9 * np.maximum(1.0, np.abs(room)) - weights @ low
        if (spare < 0).any():
            return -1.0
        open_stages = [i for i, s in enumerate(own) if pins.cap[s] > pins.low[s]]
        if not open_stages:
            return float(low.sum())
        if not (weights[:, :-1] >= weights[:, 1:]).all():  # rows not along the stages: each row alone bounds it
            cheapest = weights[:, open_stages].min(axis=1)
            most = np.where(cheapest > 0, spare / np.where(cheapest > 0, cheapest, 1.0), n).min()
            return float(low.sum() + min(most, n))
        fill = weights[:, open_stages[-1]]  # back-loading fills the last stage that may take decoders first
        most = np.where(fill > 0, np.floor(spare / np.where(fill > 0, fill, 1.0) + 1e-9), n).min()
        return float(low.sum() + min(most, n))
