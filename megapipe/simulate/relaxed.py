"""A lower bound on the simulated step: each rank's own order timed exactly, every other rank unbounded.

In the simulation (:mod:`megapipe.simulate.engine`) an op starts when its rank is free and its one cross-op
dependency has ended, plus a p2p message: F of stage s waits for F of stage s - 1, a backward op (B or I) of
stage s for the backward of stage s + 1, and the last stage's backward for its own F. Relax every rank but
one, r, so that its ops start as soon as their dependency allows: then the dependency of an op on r is a
chain through other ranks back to an earlier op on r (or to the start), and it ends no earlier than that
op's end plus the chain's durations and messages. By induction over r's order, each op on r ends no later
here than in the simulation, so the largest end over all ranks, plus the backward chain that must still run
after each backward op, is a lower bound on the step. It costs one pass over the ops with prefix sums for the
chains, without lowering the schedule, and it sees what the per-rank work floor cannot: a rank stalled while
the chunks it waits for, elsewhere, are much heavier than its own (a memory-bound interleaved split).
"""

from __future__ import annotations

from itertools import accumulate

from megapipe.schedules.base import Kind, Schedule
from megapipe.simulate.result import P2PCost, StageTimes

__all__ = ["relaxed_step_ms"]


def relaxed_step_ms(schedule: Schedule, times: StageTimes, *, p2p: P2PCost | None = None) -> float:
    """A lower bound on :func:`megapipe.simulate.simulate`'s step time for the same inputs (see the module)."""
    chains = _Chains(schedule, times, p2p or P2PCost())
    return max((_rank_end(schedule, rank, order, chains) for rank, order in enumerate(schedule.orders) if order),
               default=0.0)


class _Chains:
    """Durations and prefix sums over the stages: the forward chain into a stage, the backward chain out of it."""

    def __init__(self, schedule: Schedule, times: StageTimes, p2p: P2PCost):
        stages, s2r = schedule.num_stages, schedule.stage_to_rank
        split = any(action.kind is Kind.I for order in schedule.orders for action in order)
        self.fwd = list(times.fwd_ms)
        self.back = [b - w for b, w in zip(times.bwd_ms, times.wgrad_ms)] if split else list(times.bwd_ms)
        """The backward op on the chain: I when the backward is split, else B."""
        self.wgrad = list(times.wgrad_ms)
        self.bwd = list(times.bwd_ms)
        into_fwd = [p2p.between(s2r[s - 1], s2r[s]) if s else 0.0 for s in range(stages)]
        into_back = [p2p.between(s2r[s + 1], s2r[s]) if s < stages - 1 else 0.0 for s in range(stages)]
        self.into_fwd, self.into_back = into_fwd, into_back
        self.forward = [0.0, *accumulate(d + f for d, f in zip(into_fwd, self.fwd))]
        """forward[s]: sum over stages < s of (message in + F)."""
        self.backward = [0.0, *accumulate(d + b for d, b in zip(into_back, self.back))]
        """backward[s]: sum over stages < s of (message in + backward op)."""
        self.stages = stages

    def forward_between(self, low: int, high: int) -> float:
        """Messages and F of stages low+1..high-1, and the message into ``high``."""
        return self.forward[high] - self.forward[low + 1] + self.into_fwd[high]

    def backward_between(self, high: int, low: int) -> float:
        """Messages and backward ops of stages low+1..high-1 (each with its message in), and the message into
        ``low``."""
        return self.backward[high] - self.backward[low + 1] + self.into_back[low]

    def through_the_top(self, stage: int) -> float:
        """From F of ``stage`` ending to its backward op being ready, through every later stage and back."""
        last = self.stages - 1
        if stage == last:
            return 0.0
        return (self.forward[last + 1] - self.forward[stage + 1]
                + self.backward[last + 1] - self.backward[stage + 1] - self.into_back[last] + self.into_back[stage])

    def drain(self, stage: int) -> float:
        """The backward ops of stages below ``stage`` that must still run after its backward op ends."""
        return self.backward[stage]


def _rank_end(schedule: Schedule, rank: int, order, chains: _Chains) -> float:
    """When rank ``rank`` ends in the relaxation, with the backward chains that must follow its backward ops."""
    s2r = schedule.stage_to_rank
    mine = sorted(stage for stage in range(chains.stages) if s2r[stage] == rank)
    below = {stage: max((s for s in mine if s < stage), default=-1) for stage in mine}
    above = {stage: min((s for s in mine if s > stage), default=-1) for stage in mine}
    end_fwd: dict[tuple[int, int], float] = {}
    end_back: dict[tuple[int, int], float] = {}
    now = step = 0.0
    for action in order:
        stage, microbatch, kind = action.stage, action.microbatch, action.kind
        if kind is Kind.F:
            low = below[stage]
            before = end_fwd.get((low, microbatch))  # absent only in an order that deadlocks
            ready = chains.forward_between(-1, stage) if before is None else before + chains.forward_between(low, stage)
            now = max(now, ready) + chains.fwd[stage]
            end_fwd[stage, microbatch] = now
        elif kind is Kind.W:
            now += chains.wgrad[stage]
        else:
            after = end_back.get((above[stage], microbatch))
            if after is None:  # no later stage on this rank (or an order that deadlocks): through the top
                ready = end_fwd.get((stage, microbatch), 0.0) + chains.through_the_top(stage)
            else:
                ready = after + chains.backward_between(above[stage], stage)
            now = max(now, ready) + (chains.bwd[stage] if kind is Kind.B else chains.back[stage])
            end_back[stage, microbatch] = now
            step = max(step, now + chains.drain(stage))
    return max(step, now)
