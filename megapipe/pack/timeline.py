"""A packing run to the end: every job works through its token budget, and when one finishes the others are
repacked onto the nodes it frees.

A job whose node group or node count changes at a repack idles ``restart_h`` first (checkpoint, restart,
reload); one that keeps its place runs on. Each stretch a job spends on one place is a :class:`Segment`:
what the timeline picture draws, nodes by hours.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from megapipe.records import JobSpec

__all__ = ["Segment", "Timeline", "run_timeline"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Segment:
    """One job on one place between two repacks."""

    job: int
    """Index of the job in the policy's job list."""
    group: int
    nodes: int
    start_h: float
    restart_h: float
    """Hours at the start spent restarting on the new place (0 when the job kept its place)."""
    end_h: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Timeline:
    finish_h: tuple[float, ...]
    """Per job, the hour its token budget is done."""
    average_utilisation: float
    """Model FLOPs done over the cluster's peak x the makespan."""
    average_weighted_flops_per_s: float
    """Weighted model FLOPs done over the makespan: the throughput objective over the whole run."""
    repacks: int
    restarts: int
    segments: tuple[Segment, ...]


def run_timeline(jobs: Sequence[JobSpec], decide: Callable[[list[int]], Sequence], *, peak: float,
                 restart_h: float) -> Timeline:
    """Place the unfinished jobs (``decide(active) -> options``, each with ``group``, ``nodes``, ``tokens_per_s``
    and ``flops_per_s``), advance to the next finish, repack, until every budget is done."""
    remaining = [job.tokens for job in jobs]
    finish = [math.inf] * len(jobs)
    active = list(range(len(jobs)))
    where: dict[int, tuple[int, int]] = {}
    clock = done = weighted = 0.0
    repacks = restarts = 0
    segments: list[Segment] = []
    while active:
        picked = decide(active)
        idle = {}
        for j, option in zip(active, picked):
            moved = j in where and where[j] != (option.group, option.nodes)
            idle[j] = restart_h if moved else 0.0
            restarts += moved
            where[j] = (option.group, option.nodes)
        ends = {j: idle[j] + remaining[j] / option.tokens_per_s / 3600.0 for j, option in zip(active, picked)}
        step = min(ends.values())
        for j, option in zip(active, picked):
            working = max(0.0, step - idle[j]) * 3600.0
            remaining[j] = max(0.0, remaining[j] - option.tokens_per_s * working)
            done += option.flops_per_s * working
            weighted += jobs[j].weight * option.flops_per_s * working
            segments.append(Segment(job=j, group=option.group, nodes=option.nodes, start_h=clock,
                                    restart_h=min(idle[j], step), end_h=clock + step))
        clock += step
        for j in [j for j in active if ends[j] <= step * (1 + 1e-12)]:
            finish[j] = clock
            remaining[j] = 0.0
        active = [j for j in active if remaining[j] > 0 and finish[j] == math.inf]
        repacks += 1
    seconds = clock * 3600.0
    return Timeline(finish_h=tuple(finish), average_utilisation=done / (peak * seconds) if seconds > 0 else 0.0,
                    average_weighted_flops_per_s=weighted / seconds if seconds > 0 else 0.0, repacks=repacks - 1,
                    restarts=restarts, segments=_merged(segments))


def _merged(segments: list[Segment]) -> tuple[Segment, ...]:
    """Consecutive segments of a job on the same place, with no restart between, as one."""
    out: list[Segment] = []
    last: dict[int, int] = {}
    for segment in segments:
        index = last.get(segment.job)
        previous = out[index] if index is not None else None
        if (previous is not None and segment.restart_h == 0.0 and previous.end_h == segment.start_h
                and (previous.group, previous.nodes) == (segment.group, segment.nodes)):
            out[index] = Segment(job=previous.job, group=previous.group, nodes=previous.nodes,
                                 start_h=previous.start_h, restart_h=previous.restart_h, end_h=segment.end_h)
            continue
        last[segment.job] = len(out)
        out.append(segment)
    return tuple(out)
