"""Ranking checks: within one source, does megapipe order a model's configurations as they measured?

A planner is judged by the plan it ranks first, so an error that reverses two configurations of one
model on one GPU count matters more than the same error spread evenly. For every source (a table or
write-up, :func:`megapipe.validation.fit.source_of`) with two or more runs of one model on the same GPU
type and count, the runs are ordered by throughput (tokens per second of the whole run: they share
their GPUs), measured and predicted. Kendall's tau (Kendall 1938; tau-a: concordant minus discordant
pairs over all pairs whose measured throughputs differ by more than 2%) says how far the orders agree, and every
inverted pair is listed. Runs of one source at different sequence lengths are different jobs, grouped apart.

Pure: rows in, records out.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import combinations

from megapipe.validation.fit import source_of
from megapipe.validation.report import Row

__all__ = ["RankingGroup", "ranking_groups", "kendall_tau", "ranking_markdown", "AblationStep", "ablation_steps",
           "ablation_markdown"]


@dataclass(frozen=True, slots=True, kw_only=True)
class RankingGroup:
    """Runs of one model on one GPU type and count, from one source."""

    source: str
    model: str
    cluster: str
    num_gpus: int
    ids: tuple[str, ...]
    """The runs, fastest measured first."""
    measured_tokens_per_s: tuple[float, ...]
    predicted_tokens_per_s: tuple[float, ...]
    inverted: tuple[tuple[str, str], ...]
    """(measured faster, measured slower) pairs that the prediction orders the other way."""
    tau: float
    """Kendall's tau-a of the predicted against the measured order (1: the same order)."""

    @property
    def pairs(self) -> int:
        return len(self.ids) * (len(self.ids) - 1) // 2

    @property
    def holds(self) -> bool:
        return not self.inverted


TIE = 0.02
"""Measured throughputs closer than this share are a tie: published re-measurements of one configuration differ
by more (Megatron-LM's MoE recipes against their refresh, docs/validation.md)."""


def kendall_tau(measured: Sequence[float], predicted: Sequence[float]) -> tuple[float, tuple[tuple[int, int], ...]]:
    """(tau-a, discordant index pairs (i, j) with measured[i] > measured[j]); measured ties (:data:`TIE`) skipped."""
    concordant, discordant = 0, []
    counted = 0
    for i, j in combinations(range(len(measured)), 2):
        if abs(measured[i] - measured[j]) <= TIE * max(measured[i], measured[j]):
            continue
        counted += 1
        high, low = (i, j) if measured[i] > measured[j] else (j, i)
        if predicted[high] > predicted[low]:
            concordant += 1
        else:
            discordant.append((high, low))
    tau = (concordant - len(discordant)) / counted if counted else 1.0
    return tau, tuple(discordant)


def _tokens_per_s(row: Row, step_s: float) -> float:
    train = row.resolved.train
    return train.global_batch_size * train.seq_length / step_s


def ranking_groups(rows: Sequence[Row], *, predicted: Callable[[Row], float | None] = lambda row: row.predicted_s
                   ) -> tuple[RankingGroup, ...]:
    """Every group of two or more comparable runs, with the order ``predicted`` (a row's step time) gives.

    Rows whose ``predicted`` is None (leave-one-source-out skipped) are left out of the groups."""
    groups: dict[tuple, list[Row]] = {}
    for row in rows:
        if predicted(row) is None or row.resolved.run.step_only:
            continue
        run = row.resolved.run
        key = (source_of(row.resolved), run.model.name, run.cluster, run.num_gpus, row.resolved.train.seq_length)
        groups.setdefault(key, []).append(row)
    out = []
    for (source, model, cluster, gpus, _), members in sorted(groups.items()):
        if len(members) < 2:
            continue
        members = sorted(members, key=lambda row: (-_tokens_per_s(row, row.measured_s), row.resolved.run.id))
        measured = tuple(_tokens_per_s(row, row.measured_s) for row in members)
        guessed = tuple(_tokens_per_s(row, predicted(row)) for row in members)
        tau, discordant = kendall_tau(measured, guessed)
        ids = tuple(row.resolved.run.id for row in members)
        out.append(RankingGroup(source=source, model=model, cluster=cluster, num_gpus=gpus, ids=ids,
                                measured_tokens_per_s=measured, predicted_tokens_per_s=guessed,
                                inverted=tuple((ids[i], ids[j]) for i, j in discordant), tau=tau))
    return tuple(out)


def ranking_markdown(groups: Sequence[RankingGroup], *, loso: Sequence[RankingGroup] = ()) -> str:
    """The ranking checks as a Markdown table: one line per group, with tau and the inverted pairs
    under the fitted runtime and (when given) under leave-one-source-out."""
    if not groups:
        return "No source has two or more runs of one model on one GPU count: no ranking check.\n"
    by_key = {(group.source, group.model, group.num_gpus): group for group in loso}
    lines = ["| source | model | GPUs | runs, fastest measured first | tau | inverted pairs | LOSO tau | "
             "LOSO inverted pairs |", "|---|---|---|---|---|---|---|---|"]
    for group in groups:
        other = by_key.get((group.source, group.model, group.num_gpus))
        lines.append(f"| {group.source} | {group.model} | {group.num_gpus:,} {group.cluster} | {', '.join(group.ids)} | "
                     f"{group.tau:+.2f} | {_pairs(group)} | {'' if other is None else f'{other.tau:+.2f}'} | "
                     f"{'' if other is None else _pairs(other)} |")
    held = sum(group.holds for group in groups)
    lines.append("")
    lines.append(f"{held} of {len(groups)} groups ranked in the measured order with the fitted runtime"
                 + (f", {sum(group.holds for group in loso)} of {len(loso)} with leave-one-source-out" if loso else "")
                 + ".")
    return "\n".join(lines) + "\n"


def _pairs(group: RankingGroup) -> str:
    return "; ".join(f"{fast} > {slow}" for fast, slow in group.inverted) or "none"


@dataclass(frozen=True, slots=True, kw_only=True)
class AblationStep:
    """One step of a published optimisation sequence: what changed, and the gain measured and predicted."""

    sequence: str
    previous: str
    run: str
    measured_gain: float
    """Throughput of this run over the previous step's, minus 1."""
    predicted_gain: float

    @property
    def same_direction(self) -> bool:
        return (self.measured_gain >= 0) == (self.predicted_gain >= 0) or abs(self.measured_gain) < 0.01


def ablation_steps(rows: Sequence[Row], *, predicted: Callable[[Row], float | None] = lambda row: row.predicted_s
                   ) -> tuple[AblationStep, ...]:
    """Consecutive runs of each ablation sequence (``PublishedRun.ablation``, in file order)."""
    sequences: dict[str, list[Row]] = {}
    for row in rows:
        if row.resolved.run.ablation and predicted(row) is not None:
            sequences.setdefault(row.resolved.run.ablation, []).append(row)
    out = []
    for name, members in sorted(sequences.items()):
        for before, after in zip(members, members[1:]):
            measured = _tokens_per_s(after, after.measured_s) / _tokens_per_s(before, before.measured_s) - 1
            guessed = _tokens_per_s(after, predicted(after)) / _tokens_per_s(before, predicted(before)) - 1
            out.append(AblationStep(sequence=name, previous=before.resolved.run.id, run=after.resolved.run.id,
                                    measured_gain=measured, predicted_gain=guessed))
    return tuple(out)


def ablation_markdown(steps: Sequence[AblationStep]) -> str:
    """Each step's measured and predicted gain over the step before it."""
    if not steps:
        return "No ablation sequences in the data set.\n"
    lines = ["| sequence | from | to | measured gain | predicted gain |", "|---|---|---|---|---|"]
    for step in steps:
        lines.append(f"| {step.sequence} | {step.previous} | {step.run} | {step.measured_gain:+.1%} | "
                     f"{step.predicted_gain:+.1%} |")
    agree = sum(step.same_direction for step in steps)
    error = sum(abs(step.predicted_gain - step.measured_gain) for step in steps) / len(steps)
    lines += ["", f"{agree} of {len(steps)} steps predicted in the measured direction; mean |predicted - measured| "
              f"gain {error:.1%}."]
    return "\n".join(lines) + "\n"
