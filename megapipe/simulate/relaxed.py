"""A lower bound on the simulated step: each rank's own order timed exactly, every other rank unbounded.

In the simulation (:mod:`megapipe.simulate.engine`) an op starts when its rank is free and its one cross-op
dependency has ended, plus a p2p message: F of stage s waits for F of stage s - 1, a backward op (B or I) of
stage s for the backward of stage s + 1, and the last stage's backward for its own F. Relax every rank but
one, r, so that its ops start as soon as their dependency allows: then the dependency of an op on r is a
chain through other ranks back to an earlier op on r (or to the start), and it ends no earlier than that
op's end plus the chain's durations and messages. By induction over r's order, each op on r ends no later
here than in the simulation, so the largest end over all ranks, plus the backward chain that must still run
after each backward op, is a lower bound on the step. It costs one pass over the ops (:class:`~megapipe.schedules.RankOps`, which interleaved 1F1B and
1F1B give in closed form) with prefix sums for the chains, without building or lowering the schedule, and it sees what the per-rank work floor cannot: a rank stalled while
the chunks it waits for, elsewhere, are much heavier than its own (a memory-bound interleaved split).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate

from megapipe.schedules.base import KIND_CODE, Kind, RankOps
from megapipe.simulate.result import P2PCost, StageTimes

__all__ = ["relaxed_step_ms"]

_F, _B, _W = KIND_CODE[Kind.F], KIND_CODE[Kind.B], KIND_CODE[Kind.W]


def relaxed_step_ms(rank_ops: Sequence[RankOps], stage_to_rank: Sequence[int], times: StageTimes, *,
                    num_microbatches: int, p2p: P2PCost | None = None, enough_ms: float | None = None) -> float:
    """A lower bound on :func:`megapipe.simulate.simulate`'s step time for the schedule whose per-rank orders
    are ``rank_ops`` (:func:`megapipe.schedules.rank_ops`), with the same times and messages (see the module).

    Each rank's end bounds the step alone, so with ``enough_ms`` the ranks are timed busiest first and the first
    end at or past it is returned: still a lower bound, and the caller only needed to know it reaches that far."""
    chains = _Chains(rank_ops, stage_to_rank, times, p2p or P2PCost())
    work = [0.0] * len(rank_ops)
    for stage, rank in enumerate(stage_to_rank):
        work[rank] += times.fwd_ms[stage] + times.bwd_ms[stage]
    order = sorted((rank for rank, ops in enumerate(rank_ops) if ops.kinds), key=lambda rank: (-work[rank], rank))
    step = 0.0
    for rank in order:
        step = max(step, _rank_end(rank_ops[rank], rank, chains, num_microbatches))
        if enough_ms is not None and step >= enough_ms:
            break
    return step


class _Chains:
    """Durations and prefix sums over the stages: the forward chain into a stage, the backward chain out of it."""

    def __init__(self, rank_ops: Sequence[RankOps], stage_to_rank: Sequence[int], times: StageTimes, p2p: P2PCost):
        stages, s2r = len(stage_to_rank), stage_to_rank
        split = any(KIND_CODE[Kind.I] in ops.kinds for ops in rank_ops)
        self.fwd = list(times.fwd_ms)
        self.bwd = list(times.bwd_ms)
        self.wgrad = list(times.wgrad_ms)
        self.back = [b - w for b, w in zip(self.bwd, self.wgrad)] if split else self.bwd
        """The backward op on the chain: I when the backward is split, else B."""
        self.into_fwd = [p2p.between(s2r[s - 1], s2r[s]) if s else 0.0 for s in range(stages)]
        self.into_back = [p2p.between(s2r[s + 1], s2r[s]) if s < stages - 1 else 0.0 for s in range(stages)]
        self.forward = [0.0, *accumulate(d + f for d, f in zip(self.into_fwd, self.fwd))]
        """forward[s]: sum over stages < s of (message in + F)."""
        self.backward = [0.0, *accumulate(d + b for d, b in zip(self.into_back, self.back))]
        """backward[s]: sum over stages < s of (message in + backward op)."""
        self.stage_to_rank = s2r

    def forward_between(self, low: int, high: int) -> float:
        """Messages and F of stages low+1..high-1, and the message into ``high`` (low = -1: from the start)."""
        return self.forward[high] - self.forward[low + 1] + self.into_fwd[high]

    def backward_between(self, high: int, low: int) -> float:
        """Messages and backward ops of stages low+1..high-1, and the message into ``low``."""
        return self.backward[high] - self.backward[low + 1] + self.into_back[low]

    def through_the_top(self, stage: int) -> float:
        """From F of ``stage`` ending to its backward op being ready, through every later stage and back."""
        last = len(self.fwd) - 1
        if stage == last:
            return 0.0
        return (self.forward[last + 1] - self.forward[stage + 1]
                + self.backward[last + 1] - self.backward[stage + 1] - self.into_back[last] + self.into_back[stage])

    def neighbours(self, rank: int) -> tuple[list[int], list[int]]:
        """Per stage of ``rank``: the nearest stage below and above it on the same rank (-1: none)."""
        stages = len(self.fwd)
        below, above = [-1] * stages, [-1] * stages
        mine = [stage for stage in range(stages) if self.stage_to_rank[stage] == rank]
        for lower, upper in zip(mine, mine[1:]):
            below[upper], above[lower] = lower, upper
        return below, above


def _rank_end(ops: RankOps, rank: int, chains: _Chains, m: int) -> float:
    """When ``rank`` ends in the relaxation, with the backward chain that must follow each of its backward ops.
    An op whose dependency on this rank has not run yet (an order that deadlocks) waits for no more than the
    chain from the start: still a lower bound."""
    below, above = chains.neighbours(rank)
    stages = len(chains.fwd)
    start = [chains.forward_between(-1, s) for s in range(stages)]
    up = [chains.forward_between(below[s], s) if below[s] >= 0 else 0.0 for s in range(stages)]
    down = [chains.backward_between(above[s], s) if above[s] >= 0 else 0.0 for s in range(stages)]
    top = [chains.through_the_top(s) for s in range(stages)]
    fwd, bwd, back, wgrad, drain = chains.fwd, chains.bwd, chains.back, chains.wgrad, chains.backward
    end_fwd, end_back = [0.0] * (stages * m), [0.0] * (stages * m)
    now = step = 0.0
    for kind, stage, microbatch in zip(ops.kinds, ops.stages, ops.microbatches):
        if kind == _F:
            low = below[stage]
            ready = start[stage] if low < 0 else end_fwd[low * m + microbatch] + up[stage]
            now = (ready if ready > now else now) + fwd[stage]
            end_fwd[stage * m + microbatch] = now
        elif kind == _W:
            now += wgrad[stage]
        else:
            high = above[stage]
            ready = end_fwd[stage * m + microbatch] + top[stage] if high < 0 else \
                end_back[high * m + microbatch] + down[stage]
            now = (ready if ready > now else now) + (bwd[stage] if kind == _B else back[stage])
            end_back[stage * m + microbatch] = now
            if now + drain[stage] > step:
                step = now + drain[stage]
    return step if step > now else now
