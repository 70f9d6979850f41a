"""The min-max split under the coupled rank memory (:mod:`megapipe.partition.coupled`) for any profile, as a
mixed-integer program (HiGHS through ``scipy.optimize.milp``), exact when it finishes within its time limit.

A profile made of a few runs of identical entries is solved over the runs: each stage boundary picks the run it
falls in and an offset inside it, so the program grows with the number of runs, not of entries; any other profile
is solved over per-entry boundary indicators. The cost model's profiles take the closed forms instead
(:func:`~megapipe.partition.coupled.uniform_split`, :func:`~megapipe.partition.pinned.pinned_split`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from megapipe.partition.coupled import bottleneck_of, profile_rows, rank_stages
from megapipe.records import LayerCost, StageSpec
from megapipe.units import GIB

__all__ = ["milp_split", "Unsolved"]


class Unsolved(Exception):
    """HiGHS stopped at its time limit without a split (it did not prove that none fits)."""


def milp_split(*, layers: Sequence[LayerCost], stages: Sequence[StageSpec], ranks: Sequence[int],
               profiles: Sequence[Sequence[Sequence[int]]], time_limit_s: float = 20.0,
               lower_bound: float = 0.0) -> tuple[int, ...] | None:
    """The min-max split under the coupled rank memory for any profile, as a MILP; None when none fits.
    Raises :class:`Unsolved` when HiGHS stops at ``time_limit_s`` without a split.

    Variables ``z[s, l]`` (s = 1..S-1) say that entry l lies in layout stage s or later, monotone in l
    and in s; entry l is in stage s exactly when ``z[s, l] - z[s+1, l] = 1`` (z[0] = 1, z[S] = 0). Each
    stage holds >= 1 entry, ``time_scale * time(s) <= T``, and every rank meets every profile vector.
    """
    runs = _runs(layers)
    if 2 * len(runs) < len(layers):
        return _run_search(layers=layers, runs=runs, stages=stages, ranks=ranks, profiles=profiles,
                           time_limit_s=time_limit_s, lower_bound=lower_bound)
    return _entry_milp(layers=layers, stages=stages, ranks=ranks, profiles=profiles, time_limit_s=time_limit_s)


def _run_search(*, layers, runs, stages, ranks, profiles, time_limit_s: float, lower_bound: float
                ) -> tuple[int, ...] | None:
    """Binary search for the least bottleneck over the values a bottleneck can take (a contiguous
    sum of entries' times on some rank's GPU), each step a feasibility program of the run
    formulation: HiGHS decides "is there a split within T" far faster than it proves the min-max
    optimal, and the search needs about log2(entries^2) of them."""
    import time

    deadline = time.perf_counter() + time_limit_s

    model = _RunModel(layers=layers, runs=runs, stages=stages, ranks=ranks, profiles=profiles)

    def feasible(bottleneck: float):
        left = deadline - time.perf_counter()
        if left <= 0:
            raise Unsolved("time limit reached")
        return model.solve(bottleneck, left)

    incumbent = feasible(math.inf)  # memory alone
    if incumbent is None:
        return None
    high = bottleneck_of(layers, stages, ranks, incumbent)
    prefix = np.concatenate([[0.0], np.cumsum([layer.fwd_ms + layer.bwd_ms for layer in layers])])
    sums = (prefix[None, :] - prefix[:, None])[np.triu_indices(len(prefix), 1)]
    scales = sorted({stage.time_scale for stage in stages})
    values = np.unique(np.concatenate([scale * sums for scale in scales]))
    values = values[(values >= lower_bound * (1 - 1e-9)) & (values < high * (1 - 1e-9))]
    if len(values):  # sums equal up to rounding are one value
        values = values[np.concatenate([[True], np.diff(values) > 1e-9 * values[1:]])]
    low_index, high_index = 0, len(values)  # values[high_index] stands for `high` (feasible)
    while low_index < high_index:
        middle = (low_index + high_index) // 2
        found = feasible(float(values[middle]) * (1 + 1e-9))
        if found is None:
            low_index = middle + 1
        else:
            high_index, incumbent = middle, found
    return incumbent


def _runs(layers: Sequence[LayerCost]) -> list[tuple[int, int]]:
    """(start, length) of each maximal run of entries with equal time and bytes."""
    runs: list[tuple[int, int]] = []
    previous = None
    for index, layer in enumerate(layers):
        key = (layer.fwd_ms + layer.bwd_ms, layer.static_bytes, layer.act_bytes)
        if runs and key == previous:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((index, 1))
        previous = key
    return runs


def _solve_milp(cost, rows, cols, data, lower, upper, low, high, integrality, time_limit_s):
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_matrix

    matrix = coo_matrix((data, (rows, cols)), shape=(len(lower), len(cost))).tocsr()
    result = milp(cost, constraints=LinearConstraint(matrix, lower, upper), integrality=integrality,
                  bounds=Bounds(low, high), options={"time_limit": time_limit_s})
    if result.x is None:
        if result.status == 2:  # proven infeasible
            return None
        raise Unsolved(result.message)
    return result.x


@dataclass(frozen=True, slots=True, kw_only=True)
class _RunRows:
    """The run formulation's rows over its variables: (y[s, r], o[s, r]) pairs per boundary and run, then T."""

    values: dict[str, np.ndarray]
    """Per entry: "n" ones, "t" F + B (ms), "s" static and "a" activation GiB."""
    prefix: dict[str, np.ndarray]
    starts: np.ndarray
    lengths: np.ndarray
    count: int
    num_stages: int

    @classmethod
    def build(cls, layers, runs, num_stages: int) -> _RunRows:
        """The entries' quantities and prefix sums, and the runs' starts and lengths."""
        gib = GIB  # bytes in GiB keep the memory rows well scaled
        values = {
            "n": np.ones(len(layers)),
            "t": np.array([layer.fwd_ms + layer.bwd_ms for layer in layers]),
            "s": np.array([layer.static_bytes for layer in layers]) / gib,
            "a": np.array([layer.act_bytes for layer in layers]) / gib,
        }
        return cls(values=values, prefix={q: np.concatenate([[0.0], np.cumsum(v)]) for q, v in values.items()},
                   starts=np.array([start for start, _ in runs]),
                   lengths=np.array([length for _, length in runs], dtype=float),
                   count=len(layers), num_stages=num_stages)

    @property
    def num_runs(self) -> int:
        """How many runs of identical entries."""
        return len(self.starts)

    @property
    def width(self) -> int:
        """How many variables: a (y, o) pair per boundary and run, and the bottleneck T last."""
        return 2 * (self.num_stages - 1) * self.num_runs + 1

    def row(self, weights: dict[str, np.ndarray]) -> tuple[np.ndarray, float]:
        """Coefficients and constant of sum_q sum_s weights[q][s] * (stage s's sum of quantity q)."""
        boundaries, num_runs, width = self.num_stages - 1, self.num_runs, self.width
        out = np.zeros(width)
        constant = 0.0
        y_part = np.zeros((boundaries, num_runs))
        o_part = np.zeros((boundaries, num_runs))
        for q, w in weights.items():
            delta = w[:-1] - w[1:]  # boundary s ends stage s-1 (+) and starts stage s (-)
            y_part += delta[:, None] * self.prefix[q][self.starts][None, :]
            o_part += delta[:, None] * self.values[q][self.starts][None, :]
            constant += w[-1] * self.prefix[q][self.count]
        out[0:width - 1:2] = y_part.ravel()
        out[1:width - 1:2] = o_part.ravel()
        return out, constant

    def boundary_rows(self) -> list[tuple[np.ndarray, float, float]]:
        """(coefficients, lower, upper) rows: one run per boundary, offsets within their run, ascending runs."""
        boundaries, num_runs, width = self.num_stages - 1, self.num_runs, self.width
        out = []
        for boundary in range(boundaries):
            one = np.zeros(width)
            one[2 * boundary * num_runs:2 * (boundary + 1) * num_runs:2] = 1.0
            out.append((one, 1.0, 1.0))
            for run in range(num_runs):
                offset = np.zeros(width)
                offset[2 * (boundary * num_runs + run) + 1] = 1.0
                offset[2 * (boundary * num_runs + run)] = -(self.lengths[run] - 1.0)
                out.append((offset, -np.inf, 0.0))
            if boundary + 1 < boundaries:  # boundaries ascend, so their runs do (a cut)
                order = np.zeros(width)
                order[2 * (boundary + 1) * num_runs:2 * (boundary + 2) * num_runs:2] = np.arange(num_runs)
                order[2 * boundary * num_runs:2 * (boundary + 1) * num_runs:2] = -np.arange(num_runs)
                out.append((order, 0.0, np.inf))
        return out

    def stage_rows(self, stages, ranks) -> list[tuple[np.ndarray, float, float]]:
        """(coefficients, lower, upper) rows: every stage non-empty, every stage's time within T."""
        out = []
        for stage in range(self.num_stages):
            unit = np.zeros(self.num_stages)
            unit[stage] = 1.0
            coefficients, constant = self.row({"n": unit})
            out.append((coefficients, 1.0 - constant, np.inf))
            coefficients, constant = self.row({"t": unit * stages[ranks[stage]].time_scale})
            coefficients[self.width - 1] = -1.0
            out.append((coefficients, -np.inf, -constant))
        return out

    def memory_rows(self, stages, ranks, profiles) -> list[tuple[np.ndarray, float, float]]:
        """(coefficients, lower, upper) rows: every rank's coupled memory (GiB) at every profile vector."""
        out = []
        for rank, owned in enumerate(rank_stages(ranks, len(stages))):
            for vector in profiles[rank]:
                static, act = np.zeros(self.num_stages), np.zeros(self.num_stages)
                static[list(owned)] = 1.0
                act[list(owned)] = vector
                coefficients, constant = self.row({"s": static, "a": act})
                out.append((coefficients, -np.inf, stages[rank].memory_bytes / GIB - constant))
        return out

    def variable_bounds(self, runs: Sequence[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
        """Lower and upper bounds of the variables for ``runs`` (T's upper bound is set per solve)."""
        num_runs, count, num_stages = self.num_runs, self.count, self.num_stages
        low, high = np.zeros(self.width), np.ones(self.width)
        for boundary in range(num_stages - 1):
            stage = boundary + 1
            for run, (start, length) in enumerate(runs):
                high[2 * (boundary * num_runs + run) + 1] = length - 1.0
                # boundary s lies in [s, count - (S - s)]: every stage before and after it holds an entry
                if start + length - 1 < stage or start > count - (num_stages - stage):
                    high[2 * (boundary * num_runs + run)] = 0.0
        return low, high


class _RunModel:
    """The run formulation, built once and solved for several bottlenecks.

    Boundary s (the first entry of stage s, s = 1..S-1) lies in run r (binary ``y[s, r]``) at offset
    ``o[s, r]`` (integer, 0 <= o <= (length_r - 1) y); a prefix sum at the boundary is then exactly
    ``sum_r prefix(start_r) y[s, r] + value_r o[s, r]``, and a stage's sum is the difference of its
    two boundaries' prefixes. Rows: one run per boundary, offsets within their run, ascending runs
    (a cut), every stage non-empty, every stage's time within T, every rank's coupled memory.
    """

    def __init__(self, *, layers, runs, stages, ranks, profiles):
        from scipy.sparse import csr_matrix

        rows = _RunRows.build(layers, runs, len(ranks))
        self.runs, self.num_stages, self.count, self.width = runs, len(ranks), len(layers), rows.width
        table = rows.boundary_rows() + rows.stage_rows(stages, ranks) + rows.memory_rows(stages, ranks, profiles)
        self.matrix = csr_matrix(np.array([coefficients for coefficients, _, _ in table]))
        self.lower, self.upper = np.array([low for _, low, _ in table]), np.array([high for _, _, high in table])
        self.low, self.high = rows.variable_bounds(runs)

    def solve(self, bottleneck: float | None, time_limit_s: float) -> tuple[int, ...] | None:
        """A split with every stage's time within ``bottleneck`` (None: the least bottleneck, optimised;
        ``math.inf``: memory alone); None when none exists."""
        from scipy.optimize import Bounds, LinearConstraint, milp

        high = self.high.copy()
        high[-1] = np.inf if bottleneck is None else bottleneck
        integrality = np.ones(self.width)
        integrality[-1] = 0
        cost = np.zeros(self.width)
        cost[-1] = 1.0 if bottleneck is None else 0.0
        result = milp(cost, constraints=LinearConstraint(self.matrix, self.lower, self.upper),
                      integrality=integrality, bounds=Bounds(self.low, high), options={"time_limit": time_limit_s})
        if result.x is None:
            if result.status == 2:  # proven infeasible
                return None
            raise Unsolved(result.message)
        x, num_runs = result.x, len(self.runs)
        bounds = [0]
        for boundary in range(self.num_stages - 1):
            run = max(range(num_runs), key=lambda r: x[2 * (boundary * num_runs + r)])
            bounds.append(self.runs[run][0] + int(round(x[2 * (boundary * num_runs + run) + 1])))
        return tuple(bounds + [self.count])


class _EntryProgram:
    """The per-entry formulation (see :func:`milp_split`), built row by row as sparse triplets.

    Columns: ``z[s, l]`` for s = 1..S-1 and every entry l, then the bottleneck T last.
    """

    def __init__(self, *, count: int, num_stages: int):
        self.count, self.num_stages = count, num_stages
        self.width = (num_stages - 1) * count + 1
        self.rows: list[int] = []
        self.cols: list[int] = []
        self.data: list[float] = []
        self.lower: list[float] = []
        self.upper: list[float] = []

    def variable(self, stage: int, entry: int) -> int:
        """The column of ``z[stage, entry]``."""
        return (stage - 1) * self.count + entry

    def add(self, coefficients: dict[int, float], low: float, high: float) -> None:
        """Appends the row ``low <= sum_col coefficients[col] x[col] <= high``."""
        row = len(self.lower)
        for col, value in coefficients.items():
            self.rows.append(row)
            self.cols.append(col)
            self.data.append(value)
        self.lower.append(low)
        self.upper.append(high)

    def stage_sum(self, stage: int, values: Sequence[float]) -> tuple[dict[int, float], float]:
        """The stage's sum of ``values`` as coefficients on z, and its constant (z[0] = 1)."""
        variable = self.variable
        coefficients: dict[int, float] = {}
        for entry, value in enumerate(values):
            if stage >= 1:
                coefficients[variable(stage, entry)] = coefficients.get(variable(stage, entry), 0.0) + value
            if stage + 1 <= self.num_stages - 1:
                coefficients[variable(stage + 1, entry)] = coefficients.get(variable(stage + 1, entry), 0.0) - value
        return coefficients, (math.fsum(values) if stage == 0 else 0.0)

    def add_monotone_rows(self) -> None:
        """Adds the rows that make z monotone in the entry and in the stage."""
        count, num_stages, variable = self.count, self.num_stages, self.variable
        for stage in range(1, num_stages):
            for entry in range(count - 1):
                self.add({variable(stage, entry): 1.0, variable(stage, entry + 1): -1.0}, -np.inf, 0.0)
            if stage + 1 <= num_stages - 1:
                for entry in range(count):
                    self.add({variable(stage + 1, entry): 1.0, variable(stage, entry): -1.0}, -np.inf, 0.0)

    def add_stage_rows(self, layers, stages, ranks) -> None:
        """Adds the rows that keep every stage non-empty and its time on its rank's GPU within T."""
        ones = [1.0] * self.count
        times = [layer.fwd_ms + layer.bwd_ms for layer in layers]
        for stage in range(self.num_stages):
            coefficients, constant = self.stage_sum(stage, ones)
            self.add(coefficients, 1.0 - constant, np.inf)
            scale = stages[ranks[stage]].time_scale
            coefficients, constant = self.stage_sum(stage, [scale * t for t in times])
            coefficients[self.width - 1] = -1.0
            self.add(coefficients, -np.inf, -constant)

    def add_memory_rows(self, layers, stages, ranks, profiles) -> None:
        """Adds the rows that keep every rank's coupled memory within its bytes at every profile vector."""
        for rank, owned in enumerate(rank_stages(ranks, len(stages))):
            for vector in profile_rows(profiles[rank]):
                total: dict[int, float] = {}
                constant = 0.0
                for n, stage in zip(vector, owned):
                    coefficients, part = self.stage_sum(
                        stage, [layer.static_bytes + n * layer.act_bytes for layer in layers])
                    constant += part
                    for col, value in coefficients.items():
                        total[col] = total.get(col, 0.0) + value
                self.add(total, -np.inf, stages[rank].memory_bytes - constant)

    def solve(self, time_limit_s: float) -> tuple[int, ...] | None:
        """The least-bottleneck split's boundaries, or None when the rows are proven infeasible."""
        count, num_stages, width = self.count, self.num_stages, self.width
        low, high = np.zeros(width), np.ones(width)
        high[-1] = np.inf
        for stage in range(1, num_stages):
            high[self.variable(stage, 0)] = 0.0  # the first entry is in stage 0
        low[self.variable(num_stages - 1, count - 1)] = 1.0  # the last entry is in the last stage
        integrality = np.ones(width)
        integrality[-1] = 0
        cost = np.zeros(width)
        cost[-1] = 1.0
        x = _solve_milp(cost, self.rows, self.cols, self.data, self.lower, self.upper, low, high, integrality,
                        time_limit_s)
        if x is None:
            return None
        z = np.round(x[:-1]).reshape(num_stages - 1, count)
        bounds = [0] + [int(count - z[stage - 1].sum()) for stage in range(1, num_stages)] + [count]
        return tuple(bounds)


def _entry_milp(*, layers, stages, ranks, profiles, time_limit_s: float) -> tuple[int, ...] | None:
    """The per-entry formulation (see :func:`milp_split`)."""
    program = _EntryProgram(count=len(layers), num_stages=len(ranks))
    program.add_monotone_rows()
    program.add_stage_rows(layers, stages, ranks)
    program.add_memory_rows(layers, stages, ranks, profiles)
    return program.solve(time_limit_s)
