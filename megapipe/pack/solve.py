"""The exact packing: each job picks one (node group, node count) option; the groups' node counts bound the sum.

Every job runs at once on nodes of its own (a static split of the cluster). Objectives:

- ``throughput``: the most weighted model FLOP/s, ``sum_j w_j F_j(option)``;
- ``makespan``: every token budget done soonest, ``min max_j tokens_j / tokens_per_s_j(option)``; among
  the makespan-optimal packings, the most weighted FLOP/s;
- ``deadlines``: the most weight of jobs that meet their deadline; among those packings, the most FLOP/s.

:func:`solve_packing` is what ``megapipe pack`` runs: :func:`solve_dp`, a dynamic program over the node groups' used
nodes (a multiple-choice knapsack, exact, every objective staged as below), where that table is small
(:data:`DP_STATES`), else :func:`solve_milp`, the same knapsack as a MILP (HiGHS through ``scipy.optimize.milp``,
any number of node groups), solved stage by stage (the objective, then its tie-break, then, for a what-if, the
fewest moves among the packings within ``slack`` of the optimum, which only the MILP takes). :func:`solve_brute`
enumerates every packing (small cases, for the tests).
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from megapipe.errors import InfeasibleError
from megapipe.pack.curves import Option
from megapipe.records import JobSpec

__all__ = ["Packing", "score", "solve_packing", "uses_dp", "solve_milp", "solve_dp", "solve_brute",
           "feasible_or_raise", "DP_STATES"]

_TOL = 1e-9
_NO_PACKING = "no packing fits every job on the cluster's nodes; drop or defer a job (arrives_later) or add nodes"


@dataclass(frozen=True, slots=True, kw_only=True)
class Packing:
    """One option index per job (into that job's options), and the objective it reaches."""

    choice: tuple[int, ...]
    objective: str
    value: float
    """Weighted FLOP/s (throughput), hours (makespan) or met weight (deadlines)."""
    moves: int = 0
    """What-if: jobs whose node group or node count changed."""


def score(jobs: Sequence[JobSpec], options: Sequence[Sequence[Option]], choice: Sequence[int], objective: str) -> float:
    picked = [options[j][o] for j, o in enumerate(choice)]
    if objective == "throughput":
        return math.fsum(job.weight * option.flops_per_s for job, option in zip(jobs, picked))
    if objective == "makespan":
        return max(option.hours(job.tokens) for job, option in zip(jobs, picked))
    return math.fsum(job.weight for job, option in zip(jobs, picked) if option.hours(job.tokens) <= job.deadline_hours)


def feasible_or_raise(jobs: Sequence[JobSpec], options: Sequence[Sequence[Option]], capacities: Sequence[int]) -> None:
    """A clear error for a job with no option, or jobs whose smallest options cannot share the cluster."""
    for job, opts in zip(jobs, options):
        if not opts:
            raise InfeasibleError(
                f"job {job.name!r} ({job.model.name}, global batch {job.train.global_batch_size}, seq "
                f"{job.train.seq_length}) fits on no node count of any node group it may use"
                + (f" (gpu={job.gpu})" if job.gpu else "")
                + f" (at most {max(capacities)} nodes); give it more nodes, a smaller model or a larger cluster")
    if len(capacities) == 1:
        need = sum(min(option.nodes for option in opts) for opts in options)
        if need > capacities[0]:
            raise InfeasibleError(f"the jobs' smallest footprints need {need} nodes together and the cluster has "
                                  f"{capacities[0]}; drop or defer a job (arrives_later) or add nodes")


def _milp(cost, rows, lower, upper, integrality, bounds_high):
    from scipy.optimize import Bounds, LinearConstraint, milp

    result = milp(cost, constraints=LinearConstraint(np.array(rows), lower, upper), integrality=integrality,
                  bounds=Bounds(np.zeros(len(cost)), bounds_high), options={"time_limit": 60.0})
    if result.x is None:
        return None
    return result.x


@dataclass(frozen=True, slots=True, kw_only=True)
class _PackProgram:
    """The packing MILP: a binary per (job, option) in ``index`` order, then the makespan variable last."""

    index: tuple[tuple[int, int], ...]
    """(job, option) of each binary variable."""
    rows: tuple[np.ndarray, ...]
    lower: tuple[float, ...]
    upper: tuple[float, ...]
    integrality: np.ndarray
    high: np.ndarray
    flops: np.ndarray
    """Each variable's weighted FLOP/s, scaled to at most 1 (0 for the makespan)."""
    met: np.ndarray
    """Each variable's weight when its option meets the job's deadline, else 0."""

    @property
    def width(self) -> int:
        """How many variables."""
        return len(self.index) + 1

    def solve(self, cost: np.ndarray, extra_rows=()) -> np.ndarray:
        """The MILP's solution minimising ``cost`` with ``extra_rows`` ((row, lower, upper) each) added."""
        extra = list(extra_rows)
        x = _milp(cost, list(self.rows) + [r for r, _, _ in extra], list(self.lower) + [lo for _, lo, _ in extra],
                  list(self.upper) + [hi for _, _, hi in extra], self.integrality, self.high)
        if x is None:
            raise InfeasibleError(_NO_PACKING)
        return x

    def primary(self, objective: str) -> np.ndarray:
        """The cost vector of ``objective`` (minimised)."""
        if objective == "throughput":
            return -self.flops
        if objective == "makespan":
            primary = np.zeros(self.width)
            primary[-1] = 1.0
            return primary
        return -self.met

    def choice(self, x: np.ndarray, num_jobs: int) -> list[int]:
        """The option index each job takes in solution ``x``."""
        choice = [0] * num_jobs
        for k, (j, o) in enumerate(self.index):
            if x[k] > 0.5:
                choice[j] = o
        return choice


def _capacity_rows(jobs, options, capacities, index, width: int) -> list[tuple[np.ndarray, float, float]]:
    """(row, lower, upper) rows: one option per job, and each node group's nodes within its capacity."""
    out = []
    for j in range(len(jobs)):
        row = np.zeros(width)
        row[[k for k, (jj, _) in enumerate(index) if jj == j]] = 1.0
        out.append((row, 1.0, 1.0))
    for group, capacity in enumerate(capacities):
        row = np.zeros(width)
        for k, (j, o) in enumerate(index):
            if options[j][o].group == group:
                row[k] = options[j][o].nodes
        out.append((row, -np.inf, float(capacity)))
    return out


def _makespan_rows(jobs, index, hours: np.ndarray, width: int) -> list[tuple[np.ndarray, float, float]]:
    """(row, lower, upper) rows: every job's ``hours`` (per variable) within the makespan variable."""
    out = []
    for j in range(len(jobs)):
        row = np.zeros(width)
        for k, (jj, _) in enumerate(index):
            if jj == j:
                row[k] = hours[k]
        row[-1] = -1.0
        out.append((row, -np.inf, 0.0))
    return out


def _pack_program(jobs, options, capacities, objective: str) -> _PackProgram:
    """The packing MILP's variables, rows and objective columns for ``objective``."""
    index = tuple((j, o) for j, opts in enumerate(options) for o in range(len(opts)))
    width = len(index) + 1
    table = _capacity_rows(jobs, options, capacities, index, width)
    integrality = np.ones(width)
    integrality[-1] = 0
    high = np.ones(width)
    high[-1] = np.inf
    flops = np.array([jobs[j].weight * options[j][o].flops_per_s for j, o in index] + [0.0])
    scale = float(flops.max()) or 1.0
    hours = np.array([options[j][o].hours(jobs[j].tokens) if jobs[j].tokens > 0 else 0.0 for j, o in index])
    met = np.array([jobs[j].weight if jobs[j].deadline_hours is not None
                    and options[j][o].hours(jobs[j].tokens) <= jobs[j].deadline_hours else 0.0 for j, o in index]
                   + [0.0])
    if objective == "makespan":
        table += _makespan_rows(jobs, index, hours, width)
    return _PackProgram(index=index, rows=tuple(row for row, _, _ in table), lower=tuple(lo for _, lo, _ in table),
                        upper=tuple(hi for _, _, hi in table), integrality=integrality, high=high,
                        flops=flops / scale, met=met)


def _fewest_moves(program: _PackProgram, options, previous, primary: np.ndarray, best: float, objective: str,
                  slack: float) -> tuple[np.ndarray, int]:
    """The solution with the fewest moves from ``previous`` within ``slack`` of ``best`` (the most FLOP/s among
    them), and its number of moves."""
    stay = np.zeros(program.width)
    for k, (j, o) in enumerate(program.index):
        if previous[j] is not None and (options[j][o].group, options[j][o].nodes) == tuple(previous[j]):
            stay[k] = 1.0
    movable = sum(1 for item in previous if item is not None)
    bound = best * (1 + slack) if objective == "makespan" else best * (1 - slack)  # best <= 0 otherwise
    within = (primary, -np.inf, bound + _TOL * max(1.0, abs(best)))
    x = program.solve(-stay, [within])
    stayed = int(round(float(stay @ x)))
    x = program.solve(-program.flops, [within, (stay, stayed - 0.5, np.inf)])  # the most FLOP/s with those moves
    return x, movable - stayed


def solve_milp(jobs: Sequence[JobSpec], options: Sequence[Sequence[Option]], capacities: Sequence[int], *,
               objective: str = "throughput", previous: Sequence[tuple[int, int] | None] | None = None,
               slack: float = 0.0) -> Packing:
    """The optimal packing; with ``previous`` ((group, nodes) per job, None for a new one), the one with the
    fewest moves among those within ``slack`` of the optimum."""
    feasible_or_raise(jobs, options, capacities)
    program = _pack_program(jobs, options, capacities, objective)
    # stage 1: the objective
    primary = program.primary(objective)
    x = program.solve(primary)
    best = float(primary @ x)
    # stage 2: the tie-break (FLOP/s) for makespan and deadlines
    if objective != "throughput":
        x = program.solve(-program.flops, [(primary, -np.inf, best + _TOL * max(1.0, abs(best)))])
    moves = 0
    if previous is not None:
        x, moves = _fewest_moves(program, options, previous, primary, best, objective, slack)
    choice = program.choice(x, len(jobs))
    return Packing(choice=tuple(choice), objective=objective, value=score(jobs, options, choice, objective),
                   moves=moves)


DP_STATES = 1 << 16
"""The most node-count states (each node group's capacity + 1, multiplied) :func:`solve_packing` gives the dynamic
program; a larger table (several large node groups) goes to the MILP."""

_MET_UNITS_LIMIT = 1 << 62
"""The deadlines objective counts met weight in exact integer units (each weight's decimal over their common
denominator, int64 in the table); weights whose units would sum past this go to the MILP."""


def solve_packing(jobs: Sequence[JobSpec], options: Sequence[Sequence[Option]], capacities: Sequence[int], *,
                  objective: str = "throughput", previous: Sequence[tuple[int, int] | None] | None = None,
                  slack: float = 0.0) -> Packing:
    """The optimal packing (:func:`solve_dp` where its table is small and without a what-if's ``previous``, else
    :func:`solve_milp`, which also takes the fewest moves): what ``megapipe pack`` runs."""
    if previous is None and uses_dp(capacities) and (objective != "deadlines" or _met_units(jobs) is not None):
        return solve_dp(jobs, options, capacities, objective=objective)
    return solve_milp(jobs, options, capacities, objective=objective, previous=previous, slack=slack)


def uses_dp(capacities: Sequence[int]) -> bool:
    """Whether :func:`solve_packing` solves a packing on these node groups by the dynamic program (no what-if): the
    MILP's solver need not be loaded."""
    return math.prod(int(capacity) + 1 for capacity in capacities) <= DP_STATES


def solve_dp(jobs: Sequence[JobSpec], options: Sequence[Sequence[Option]], capacities: Sequence[int], *,
             objective: str = "throughput") -> Packing:
    """The optimal packing by dynamic programming over the node groups' used nodes (a multiple-choice knapsack,
    job by job over its options; a table of ``prod(capacity + 1)`` states), every objective as :func:`solve_milp`
    stages it:

    - ``throughput``: the most weighted FLOP/s;
    - ``makespan``: the least makespan (the smallest job-hours threshold every job can keep, by bisection over the
      options' hours), then the most weighted FLOP/s with every job within it;
    - ``deadlines``: the most deadline weight met, counted exactly in units of the weights' decimals, then the most
      weighted FLOP/s.

    Among equal packings the first option of each job (in its order) that reaches the optimum is kept."""
    feasible_or_raise(jobs, options, capacities)
    capacities = tuple(int(capacity) for capacity in capacities)
    allowed = [range(len(opts)) for opts in options]
    met = None
    if objective == "makespan":
        hours = [[option.hours(job.tokens) if job.tokens > 0 else 0.0 for option in opts]
                 for job, opts in zip(jobs, options)]
        limit = _least_makespan(hours, options, capacities)
        within = limit + _TOL * max(1.0, abs(limit))
        allowed = [[o for o, value in enumerate(row) if value <= within] for row in hours]
    elif objective == "deadlines":
        units = _met_units(jobs)
        if units is None:
            raise ValueError("the deadline weights' decimals are too fine for the table's units; use solve_milp")
        met = [[unit if job.deadline_hours is not None and option.hours(job.tokens) <= job.deadline_hours else 0
                for option in opts] for job, unit, opts in zip(jobs, units, options)]
    choice = _best_table(jobs, options, capacities, allowed, met)
    if choice is None:
        raise InfeasibleError(_NO_PACKING)
    return Packing(choice=tuple(choice), objective=objective, value=score(jobs, options, choice, objective))


def _met_units(jobs: Sequence[JobSpec]) -> list[int] | None:
    """Each job's weight in integer units of the decimals the job list gives (``repr``, the shortest decimal that reads
    back as the float: 0.1 + 0.2 then weighs what 0.3 does, as the MILP's tolerance has it); None when they could
    overflow the table's int64."""
    from fractions import Fraction

    weights = [Fraction(repr(float(job.weight))) for job in jobs]
    denominator = math.lcm(*(weight.denominator for weight in weights)) if weights else 1
    units = [int(weight * denominator) for weight in weights]
    common = math.gcd(*units) or 1
    units = [unit // common for unit in units]
    return units if sum(abs(unit) for unit in units) < _MET_UNITS_LIMIT else None


def _window(shape: tuple[int, ...], group: int, nodes: int) -> tuple[tuple, tuple]:
    """(target, source) slices: the states using ``nodes`` more of ``group``'s nodes than the source's."""
    target, source = [slice(None)] * len(shape), [slice(None)] * len(shape)
    target[group], source[group] = slice(nodes, None), slice(0, shape[group] - nodes)
    return tuple(target), tuple(source)


def _fits_all(options, capacities: tuple[int, ...], allowed) -> bool:
    """Whether every job can take one of its ``allowed`` options within the capacities."""
    shape = tuple(capacity + 1 for capacity in capacities)
    reach = np.ones(shape, dtype=bool)  # no job yet: any budget of nodes will do
    for opts, keep in zip(options, allowed):
        new = np.zeros(shape, dtype=bool)
        for o in keep:
            option = opts[o]
            if option.nodes > capacities[option.group]:
                continue
            target, source = _window(shape, option.group, option.nodes)
            new[target] |= reach[source]
        reach = new
    return bool(reach[capacities])


def _least_makespan(hours, options, capacities: tuple[int, ...]) -> float:
    """The least of the options' hours that every job can keep at once: the optimal makespan."""
    levels = sorted({value for row in hours for value in row})
    low = bisect.bisect_left(levels, max(min(row) for row in hours))  # no job finishes before its fastest option
    high = len(levels) - 1
    if not _fits_all(options, capacities, [range(len(row)) for row in hours]):
        raise InfeasibleError(_NO_PACKING)
    while low < high:
        middle = (low + high) // 2
        if _fits_all(options, capacities, [[o for o, value in enumerate(row) if value <= levels[middle]]
                                           for row in hours]):
            high = middle
        else:
            low = middle + 1
    return levels[low]


def _best_table(jobs, options, capacities: tuple[int, ...], allowed, met) -> list[int] | None:
    """The choice of the most weighted FLOP/s (with ``met``, of the most met units first) among ``allowed`` options
    within the capacities; None when none fits."""
    shape = tuple(capacity + 1 for capacity in capacities)
    flops = np.zeros(shape)  # the best value using at most each state's nodes; -inf where nothing fits
    units = np.zeros(shape, dtype=np.int64) if met is not None else None
    picks = []
    for j, (job, opts, keep) in enumerate(zip(jobs, options, allowed)):
        new = np.full(shape, -np.inf)
        new_units = np.zeros(shape, dtype=np.int64) if met is not None else None
        pick = np.full(shape, -1, dtype=np.int32)
        for o in keep:
            option = opts[o]
            if option.nodes > capacities[option.group]:
                continue
            target, source = _window(shape, option.group, option.nodes)
            value = flops[source] + job.weight * option.flops_per_s
            held = new[target]
            if met is None:
                better = value > held
            else:
                count = units[source] + met[j][o]
                held_units = new_units[target]
                better = np.isfinite(value) & (~np.isfinite(held) | (count > held_units)
                                               | ((count == held_units) & (value > held)))
                held_units[better] = count[better]
            held[better] = value[better]
            pick[target][better] = o
        flops, units = new, new_units
        picks.append(pick)
    if not np.isfinite(flops[capacities]):
        return None
    choice, state = [0] * len(jobs), list(capacities)
    for j in range(len(jobs) - 1, -1, -1):
        o = int(picks[j][tuple(state)])
        choice[j] = o
        state[options[j][o].group] -= options[j][o].nodes
    return choice


def solve_brute(jobs: Sequence[JobSpec], options: Sequence[Sequence[Option]], capacities: Sequence[int], *,
                objective: str = "throughput") -> Packing | None:
    """Every packing tried (small cases only); None when none fits."""
    best_choice, best_key = None, None
    for choice in itertools.product(*(range(len(opts)) for opts in options)):
        used = [0] * len(capacities)
        for j, o in enumerate(choice):
            used[options[j][o].group] += options[j][o].nodes
        if any(u > c for u, c in zip(used, capacities)):
            continue
        value = score(jobs, options, choice, objective)
        flops = score(jobs, options, choice, "throughput")
        key = (-value if objective == "makespan" else value, flops)
        if best_key is None or key > best_key:
            best_choice, best_key = choice, key
    if best_choice is None:
        return None
    return Packing(choice=tuple(best_choice), objective=objective, value=score(jobs, options, best_choice, objective))
