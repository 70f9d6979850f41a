"""One pipeline rank's share of the decoders under its coupled memory (interleaved and V-shaped schedules).

A rank holds layout stages c = 1..v; with ``d_c`` identical decoders on stage c it needs, at every moment k
that can be its peak (:func:`megapipe.schedules.rank_in_flight_profiles`),

    sum_c (static + n_kc act) d_c  <=  memory left beside the embedding and the loss,

and the split asks for its largest total ``sum_c d_c`` within per-stage bounds ``low_c <= d_c <= high_c``.

Every schedule megapipe builds keeps fewer microbatches of a later stage than of an earlier one on the same
rank at each of those moments (an earlier chunk's forward runs first and its backward last), so each row's
weights fall along the stages. Then moving a decoder to a later stage never raises any row, and the
*back-loaded* counts (fill the last stage to its bound, then the one before, ...) have the smallest row
values of all counts with the same total: with ``P_j`` the prefix sums and
``n_kc = sum_{j >= c} (n_kj - n_k,j+1)``, a row is ``sum_j (n_kj - n_k,j+1) P_j`` (plus ``static * total``),
and back-loading minimises every prefix sum at once. So the largest total is exact in O(rows x stages)
(:meth:`RankProblem.largest`). Rows that do not fall along the stages keep the general path: a greedy,
the linear relaxation, a branch and bound, or HiGHS.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

__all__ = ["RankProblem"]

_EPS = 1e-9
_SEARCHED_CHUNKS = 6
"""Up to this many chunks per rank the rank's integer program is searched directly; beyond it, HiGHS."""
_RELAXED_CHUNKS = 5
"""From this many chunks per rank on, the linear relaxation (HiGHS) settles the greedy counts or bounds the search;
below it the rows' own bounds prune the few counts well enough (and scipy stays unimported)."""


class RankProblem:
    """max sum_s d_s over one rank's stages, lo_s <= d_s <= hi_s, within its memory at every profile vector.

    ``decoder``: the identical decoder's cost; ``stages``: the rank's layout stages in stage order; ``profile``:
    its in-flight vectors (one count per stage); ``cap``: its memory; ``pinned``: (time, static, act) each layout
    stage holds besides its decoders (the embedding, the loss); ``low``: each stage's fewest decoders.
    The monotone path runs on numpy arrays (a rank may hold 40 stages and 80 rows); the general path on plain
    Python lists.
    """

    def __init__(self, decoder, stages: Sequence[int], profile, cap: float, pinned, low: Sequence[int]):
        self.stages, self.low = tuple(stages), tuple(low)
        counts = np.asarray(profile).reshape(len(profile), len(self.stages))
        self.weights = decoder.static_bytes + counts * decoder.act_bytes
        """Bytes per decoder: one row per profile vector, one column per stage."""
        pinned_bytes = np.zeros(len(counts))
        for index, stage in enumerate(self.stages):  # the embedding and the loss, where this rank holds them
            _, static, act = pinned[stage]
            if static or act:
                pinned_bytes = pinned_bytes + (static + counts[:, index] * act)
        room = cap - pinned_bytes
        self._limits = room + _EPS * np.maximum(1.0, np.abs(room))
        self._lows = np.asarray(self.low, dtype=float)
        self._spare = self._limits - self.weights @ self._lows
        """Each row's room left with the fewest decoders on every stage (negative: even they do not fit)."""
        self._fewest = sum(self.low) if (self._spare >= 0).all() else None
        """The fewest decoders in all, or None when even they do not fit."""
        self._last_most: int | float | None = None
        self.monotone = bool((self.weights[:, :-1] >= self.weights[:, 1:]).all())
        """Every row's weights fall along the stages: :meth:`largest` is exact by back-loading."""
        self._rows: list[list[float]] | None = None
        self._cache: dict[tuple[int, ...], list[int] | None] = {}
        self._largest: dict[tuple[int, ...], int | None] = {}

    @property
    def limit(self) -> list[float]:
        """Each row's memory left beside the pinned entries, with a relative slack of 1e-9 for rounding."""
        return self._limits.tolist()

    @property
    def rows(self) -> list[list[float]]:
        """:attr:`weights` as lists, for the general path's plain-Python loops."""
        if self._rows is None:
            self._rows = self.weights.tolist()
        return self._rows

    @property
    def columns(self) -> list[tuple[float, ...]]:
        return list(zip(*self.rows)) if self.rows else [()] * len(self.stages)

    def _used(self, counts: Sequence[float]) -> list[float]:
        return [sum(w * c for w, c in zip(row, counts)) for row in self.rows]

    def fits(self, counts: Sequence[int]) -> bool:
        return bool((self.weights @ np.asarray(counts, dtype=float) <= self._limits).all())

    def upper(self, high: Sequence[int]) -> float:
        """An upper bound on the largest total: each memory row alone, filled with its cheapest decoders."""
        base = sum(self.low)
        bound = float(sum(high))
        for row, used, limit in zip(self.rows, self._used(self.low), self.limit):
            cheapest = min(row) if row else 0.0
            if cheapest > 0:
                bound = min(bound, base + max(limit - used, 0.0) / cheapest)
        return bound

    def _greedy(self, high: tuple[int, ...]) -> list[int]:
        """Feasible counts: add decoders one at a time where they use the least of the tightest room (the stage
        whose largest share of any row's room is smallest; the first such stage on ties)."""
        counts = list(self.low)
        if not self.rows:
            return list(high)
        used = np.array(self._used(counts))
        columns, limit = self._arrays()
        top = np.asarray(high)
        now = np.asarray(counts)
        while True:
            after = used + columns  # (stages, rows): each stage's rows with one more decoder
            share = (columns / np.maximum(limit - used, 1e-300)).max(axis=1)
            share[(after > limit).any(axis=1) | (now >= top)] = math.inf
            best = int(share.argmin())
            if share[best] == math.inf:
                return [int(c) for c in now]
            now[best] += 1
            used = after[best]

    def _arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """The columns (stages x rows) and the row limits as arrays."""
        return self.weights.T, self._limits

    def largest(self, high: tuple[int, ...]) -> int | None:
        """The largest feasible total with d_s <= high_s, or None when even the smallest counts do not fit."""
        if not self.monotone:
            found = self._best(high)
            return None if found is None else sum(found)
        if high not in self._largest:
            self._largest[high] = self._back_loaded_largest(high)
        return self._largest[high]

    def back_loaded(self, high: Sequence[int], total: int, start: int = 0) -> list[int]:
        """The counts of stages ``start``.. that hold ``total`` decoders with the last stages filled first."""
        counts = list(self.low[start:])
        left = total - sum(counts)
        for index in range(len(counts) - 1, -1, -1):
            take = min(left, high[start + index] - counts[index])
            counts[index] += take
            left -= take
        return counts

    def _back_loaded_largest(self, high: tuple[int, ...]) -> int | None:
        """Exact for monotone rows: each row alone admits the back-loaded counts up to a total found from the
        last stage (the stages it fills whole, then what its room leaves of the next); the least of those
        totals, checked against :meth:`fits` (float rounding)."""
        if self._fewest is None or any(h < lo for h, lo in zip(high, self.low)):
            return None
        if self._last_stage_most() < high[-1] - self.low[-1]:  # memory binds within the last stage
            return self._fewest + self._last_stage_most()
        best = self._rows_largest(high)
        while best > self._fewest and not self.fits(self.back_loaded(high, best)):
            best -= 1
        while best < sum(high) and self.fits(self.back_loaded(high, best + 1)):
            best += 1
        return best

    def _last_stage_most(self) -> int | float:
        """Most decoders the last stage takes beyond its fewest while every other stage holds its fewest, as
        :meth:`fits` says (math.inf when no row limits it): every bound with room for more on the last stage
        has its back-loaded largest total here."""
        if self._last_most is None:
            last = self.weights[:, -1]
            if not (last > 0).all():
                self._last_most = math.inf
                return self._last_most
            ratios = np.floor(self._spare / last)
            bounded = ratios[np.isfinite(ratios)]  # a rank without a memory limit leaves its rows unbounded
            if not len(bounded):
                self._last_most = math.inf
                return self._last_most
            most = int(bounded.min())
            counts = list(self.low)
            while most > 0 and not self.fits(counts[:-1] + [counts[-1] + most]):
                most -= 1
            while self.fits(counts[:-1] + [counts[-1] + most + 1]):
                most += 1
            self._last_most = most
        return self._last_most

    def _rows_largest(self, high: tuple[int, ...]) -> int:
        """The least over rows of the back-loaded total each row admits alone."""
        spare = np.asarray(high, dtype=float) - self._lows
        weights, size = self.weights, len(high)
        filled = np.cumsum(weights[:, ::-1] * spare[::-1], axis=1)  # the last j + 1 stages filled whole
        whole = (filled <= self._spare[:, None]).sum(axis=1)
        totals = np.concatenate([[0.0], np.cumsum(spare[::-1])])[whole]
        part = np.flatnonzero(whole < size)
        if len(part):
            stage = size - 1 - whole[part]
            left = self._spare[part] - np.where(whole[part] > 0, filled[part, np.maximum(whole[part] - 1, 0)], 0.0)
            weight = weights[part, stage]
            totals[part] += np.minimum(spare[stage], np.floor(left / np.where(weight > 0, weight, 1.0)))
        return int(totals.min()) + sum(self.low)

    def _best(self, high: tuple[int, ...]) -> list[int] | None:
        """Counts of the largest feasible total (cached per ``high``)."""
        if high in self._cache:
            return self._cache[high]
        found: list[int] | None
        if any(h < lo for h, lo in zip(high, self.low)) or not self.fits(self.low):
            found = None
        elif self.fits(high):
            found = list(high)
        else:
            found = self._greedy(high)
            # With monotone rows the greedy fills the last stages first, as back-loading does, so it reaches the
            # exact largest total; otherwise (or should rounding say otherwise) the bounds settle it exactly.
            settled = self.monotone and sum(found) >= self.largest(high)
            if not settled and sum(found) < math.floor(self.upper(high) + 1e-9):
                relaxed = self._relaxation(high) if len(high) >= _RELAXED_CHUNKS else None
                if relaxed is None or sum(found) < math.floor(relaxed[0] + 1e-9):
                    found = (self._branch_and_bound(high, found, relaxed) if len(high) <= _SEARCHED_CHUNKS
                             else self._solve(high))
        self._cache[high] = found
        return found

    def _relaxation(self, high: tuple[int, ...]) -> tuple[float, list[float]] | None:
        """The linear relaxation's optimum and its memory rows' multipliers (HiGHS's duals, >= 0), or None when
        HiGHS gives none. The greedy counts are optimal when they reach the optimum's floor; otherwise the
        multipliers combine the rows into the one constraint that bounds the branch and bound best."""
        from scipy.optimize import linprog

        result = linprog(-np.ones(len(high)), A_ub=np.asarray(self.rows, dtype=float),
                         b_ub=np.asarray(self.limit, dtype=float), bounds=list(zip(self.low, high)), method="highs")
        if result.status != 0:
            return None
        return -float(result.fun), [max(0.0, -float(value)) for value in result.ineqlin.marginals]

    def _surrogate(self, high: tuple[int, ...], relaxed: tuple[float, list[float]] | None):
        """Per depth, the remaining stages' combined-row costs (cheapest first, with their spare counts), and the
        multipliers; None without a relaxation."""
        if relaxed is None or not any(relaxed[1]):
            return None
        weights = relaxed[1]
        cost = [sum(w * row[index] for w, row in zip(weights, self.rows)) for index in range(len(high))]
        order = [sorted(((cost[s], high[s] - self.low[s]) for s in range(index, len(high)))) for index in
                 range(len(high))]
        low_cost = [sum(cost[s] * self.low[s] for s in range(index, len(high))) for index in range(len(high))]
        return weights, order, low_cost

    def _branch_and_bound(self, high: tuple[int, ...], incumbent: list[int],
                          relaxed: tuple[float, list[float]] | None = None) -> list[int]:
        """Exact: depth-first over the stages' counts (largest first), pruned by the rows' relaxation and by the
        relaxation's combined row (a fractional knapsack over the remaining stages)."""
        size = len(high)
        columns = list(zip(*self.rows))
        cheapest = [[min(row[index:]) for row in self.rows] for index in range(size)]
        best, best_total = list(incumbent), sum(incumbent)
        chosen = [0] * size
        surrogate = self._surrogate(high, relaxed)

        def combined_room(index: int, used: list[float]) -> float:
            """Most decoders the remaining stages take under the combined row (math.inf without one)."""
            if surrogate is None:
                return math.inf
            weights, order, low_cost = surrogate
            capacity = sum(w * (limit - now) for w, limit, now in zip(weights, self.limit, used)) - low_cost[index]
            if capacity < -1e-9 * max(1.0, abs(capacity)):
                return -1.0
            room = float(sum(self.low[index:]))
            for cost, spare in order[index]:
                if cost <= 0:
                    room += spare
                    continue
                take = min(spare, capacity / cost)
                room += take
                capacity -= take * cost
                if take < spare:
                    break
            return room

        def visit(index: int, used: list[float], total: int) -> None:
            nonlocal best, best_total
            if index == size:
                if total > best_total:
                    best, best_total = chosen[:], total
                return
            spare = [limit - now - sum(w * c for w, c in zip(row[index:], self.low[index:]))
                     for limit, now, row in zip(self.limit, used, self.rows)]
            if any(value < 0 for value in spare):
                return
            room = min((value / cheap for value, cheap in zip(spare, cheapest[index]) if cheap > 0), default=math.inf)
            if total + min(sum(high[index:]), sum(self.low[index:]) + math.floor(room + 1e-9)) <= best_total:
                return
            combined = combined_room(index, used)
            if combined < 0 or combined != math.inf and total + math.floor(combined + 1e-9) <= best_total:
                return
            column = columns[index]
            for count in range(high[index], self.low[index] - 1, -1):
                after = [now + count * weight for now, weight in zip(used, column)]
                if all(value <= limit for value, limit in zip(after, self.limit)):
                    chosen[index] = count
                    visit(index + 1, after, total + count)

        visit(0, [0.0] * len(self.rows), 0)
        return best

    def _solve(self, high: tuple[int, ...]) -> list[int]:
        from scipy.optimize import Bounds, LinearConstraint, milp

        result = milp(-np.ones(len(high)), integrality=np.ones(len(high)),
                      bounds=Bounds(np.asarray(self.low, dtype=float), np.asarray(high, dtype=float)),
                      constraints=LinearConstraint(np.asarray(self.rows, dtype=float), -np.inf,
                                                   np.asarray(self.limit, dtype=float)))
        if result.x is None:
            return list(self.low)
        return [int(round(x)) for x in result.x]

    def counts(self, high: tuple[int, ...], total: int) -> list[int]:
        """Feasible counts summing to ``total`` (at most the largest): the largest total's counts, trimmed from
        the fullest stages (fewer decoders never need more memory)."""
        counts = list(self._best(high) or self.low)
        while sum(counts) > total:
            index = max((i for i in range(len(counts)) if counts[i] > self.low[i]), key=lambda i: (counts[i], -i))
            counts[index] -= 1
        return counts
