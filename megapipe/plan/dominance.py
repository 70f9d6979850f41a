"""Runtime feature sets that another feature set of the same sizes beats everywhere (the search drops them before
bounding anything).

A point dominates another of the same sizes (everything but the runtime features) when no unit of it runs a
slower forward, backward or weight gradient and every unit holds the same bytes. A schedule's step never grows
when a stage's work shrinks, and every split that fits one fits the other, so the dominated point can never rank
above the one that dominates it; of two with equal costs the first stays.

Unit times read neither PP, DP, VP, the schedule nor the microbatch count (:func:`megapipe.cost.layers.unit_times`)
and two feature sets of one layer key hold the same bytes at every size when their bytes features agree
(:meth:`megapipe.plan.unit_costs.UnitCosts.bytes_key`), so dominance is settled once per layer key and set of
feature sets, for every pipeline and data-parallel size at once.
"""

from __future__ import annotations

import numpy as np

from megapipe.plan.layer_costs import LayerCosts
from megapipe.plan.space import LAYER_SIZES, Space

__all__ = ["surviving_points"]

_SIZES = slice(0, 13)
"""A point's fields but its features (:class:`megapipe.plan.space.Point`): its group."""


def surviving_points(costs: LayerCosts, space: Space) -> list[int]:
    """Indices of the points no other point of their group dominates, in order."""
    points = space.points
    out: list[int] = []
    settled: dict[tuple, tuple[int, ...]] = {}
    shared = costs.dominance
    for start, stop, features in space.groups or _groups(points):
        if stop - start < 2:
            out.append(start)
            continue
        # the layer key's sizes and the members' feature sets (runs of equal sets share one tuple)
        sizes = LAYER_SIZES(points[start])
        key = sizes + (id(features),)
        positions = settled.get(key)
        if positions is None:
            positions = shared.get(sizes + (features,))
            if positions is None:
                positions = shared[sizes + (features,)] = surviving_positions(
                    costs, [space.candidate(points[index]) for index in range(start, stop)])
            settled[key] = positions
        out.extend([start + position for position in positions])
    return out


def _groups(points) -> list[tuple[int, int, tuple]]:
    """(start, stop, feature sets) of each run of points equal but for their features (a group's points are
    consecutive)."""
    out: list[tuple[int, int, tuple]] = []
    previous = None
    for index, point in enumerate(points):
        sizes = point[_SIZES]
        if sizes == previous:
            out[-1] = (out[-1][0], index + 1, out[-1][2] + (point.features,))
        else:
            out.append((index, index + 1, (point.features,)))
            previous = sizes
    interned: dict[tuple, tuple] = {}
    return [(start, stop, interned.setdefault(features, features)) for start, stop, features in out]


def surviving_positions(costs: LayerCosts, cands: list) -> tuple[int, ...]:
    """Positions in ``cands`` (one group's candidates) that no other of them dominates; of equals the first stays.
    Settled once per layer key and set of feature sets (:attr:`LayerCosts.dominance`), so searches that share unit
    costs (pack's node counts) settle each once."""
    signatures = [costs.unit_signature(cand) for cand in cands]
    times = np.array([time for time, _ in signatures])
    interned: dict = {}
    tokens = np.array([interned.setdefault(token, len(interned)) for _, token in signatures])  # equal tokens, one id
    count = len(cands)
    same = tokens[:, None] == tokens[None, :]
    no_slower = (times[None, :, :] <= times[:, None, :]).all(axis=2)  # [i, j]: j no slower than i anywhere
    equal = (times[None, :, :] == times[:, None, :]).all(axis=2)
    order = np.arange(count)
    later = order[None, :] > order[:, None]  # [i, j]: j comes after i
    dominated = same & no_slower & (order[None, :] != order[:, None]) & ~(equal & later)
    return tuple(int(position) for position in np.flatnonzero(~dominated.any(axis=1)))
