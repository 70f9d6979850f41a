"""ZB-H1 and ZB-H2 (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", Sec. 3.1).

The backward is split into I (input gradient, the paper's B) and W (weight
gradient); W is off the critical path and fills what would be bubble.

* ZB-H1 is 1F1B (Megatron's warm-up of P-s-1 forwards) with each I followed by a
  W, except that stage s defers its W by s microbatches; the deferred W fill
  the cool-down. Every stage holds at most P microbatches (1F1B's peak, on its
  first stage) and the flushed idle per stage is (P-1)(F+B-W) when W <= F, B.
* ZB-H2 comes from a global-clock list schedule on unit-time ops (the paper's
  T_F = T_B = T_W): each tick every stage starts the next I whose own F and
  downstream I are done, else the next F if its upstream F is done and the
  stage has fewer than 2(P-s)-1 microbatches between F and I and fewer than 2P-1
  between F and W, else its oldest pending W. Its steady-state idle is
  (P-1)(F+B-2W) on the first stage (0 for F=B=W) with 2P-1 microbatches in
  flight; with a flush its bubble equals ZB-H1's for F=B=W.

The orders are then fixed and can be simulated with any op times.
"""

from __future__ import annotations

from collections import deque

from megapipe.schedules.base import Action, Kind
from megapipe.schedules.spec import InFlightFloor, PathShare, ScheduleName, ScheduleSpec

__all__ = ["ZB_H1", "ZB_H2", "zb_h1_orders", "zb_h2_orders", "list_schedule_orders"]


def _zb_h1_rank(stage: int, pp: int, m: int) -> tuple[Action, ...]:
    warmup = min(pp - stage - 1, m)
    order = [Action(stage, Kind.F, mb, 0, stage) for mb in range(warmup)]
    weights = 0
    for mb in range(m):
        if warmup + mb < m:
            order.append(Action(stage, Kind.F, warmup + mb, 0, stage))
        order.append(Action(stage, Kind.I, mb, 0, stage))
        if mb >= stage:
            order.append(Action(stage, Kind.W, weights, 0, stage))
            weights += 1
    order.extend(Action(stage, Kind.W, mb, 0, stage) for mb in range(weights, m))
    return tuple(order)


def zb_h1_orders(*, pipeline_model_parallel_size: int, num_microbatches: int) -> tuple[tuple[Action, ...], ...]:
    pp = pipeline_model_parallel_size
    return tuple(_zb_h1_rank(stage, pp, num_microbatches) for stage in range(pp))


def _pick(stage: int, tick: int, state, m: int, last: int, caps: tuple[int, int]):
    next_f, next_i, done_w, f_end, i_end, pending_w = state
    k = next_i[stage]
    if k < next_f[stage] and f_end[stage][k] <= tick and (stage == last or i_end[stage + 1][k] <= tick):
        return Kind.I, k
    k = next_f[stage]
    if (
        k < m and k - next_i[stage] < caps[0] and k - done_w[stage] < caps[1]
        and (stage == 0 or f_end[stage - 1][k] <= tick)
    ):
        return Kind.F, k
    if pending_w[stage]:
        return Kind.W, pending_w[stage][0]
    return None


def list_schedule_orders(
    *, pipeline_model_parallel_size: int, num_microbatches: int, caps: tuple[tuple[int, int], ...]
) -> tuple[tuple[Action, ...], ...]:
    """Unit-time list schedule, priority I > F > W; ``caps[s]`` = (max F-I, max F-W) on stage s."""
    pp, m = pipeline_model_parallel_size, num_microbatches
    never = float("inf")
    f_end = [[never] * m for _ in range(pp)]
    i_end = [[never] * m for _ in range(pp)]
    pending_w: list[deque[int]] = [deque() for _ in range(pp)]
    next_f, next_i, done_w = [0] * pp, [0] * pp, [0] * pp
    state = (next_f, next_i, done_w, f_end, i_end, pending_w)
    orders: list[list[Action]] = [[] for _ in range(pp)]
    tick = 0
    while any(count < m for count in done_w):
        picks = [_pick(stage, tick, state, m, pp - 1, caps[stage]) for stage in range(pp)]
        assert any(picks) or tick < 4 * m * pp, "list schedule made no progress"
        for stage, pick in enumerate(picks):
            if pick is None:
                continue
            kind, mb = pick
            orders[stage].append(Action(stage, kind, mb, 0, stage))
            if kind is Kind.F:
                f_end[stage][mb] = tick + 1
                next_f[stage] += 1
            elif kind is Kind.I:
                i_end[stage][mb] = tick + 1
                next_i[stage] += 1
                pending_w[stage].append(mb)
            else:
                pending_w[stage].popleft()
                done_w[stage] += 1
        tick += 1
    return tuple(tuple(order) for order in orders)


def zb_h2_orders(*, pipeline_model_parallel_size: int, num_microbatches: int) -> tuple[tuple[Action, ...], ...]:
    pp = pipeline_model_parallel_size
    caps = tuple((2 * (pp - stage) - 1, 2 * pp - 1) for stage in range(pp))
    return list_schedule_orders(pipeline_model_parallel_size=pp, num_microbatches=num_microbatches, caps=caps)


def _zb_flushed(pp: int, m: int, v: int) -> float:
    """Idle (P-1)(F+B-W) per stage with F = B = W: (P-1)/(3m+P-1) of wall time (Qi et al. 2024, sec. 3.1)."""
    return (pp - 1) / (3 * m + pp - 1)


ZB_H1 = ScheduleSpec(
    name=ScheduleName.zb_h1,
    summary="ZB-H1 (Qi et al. 2024): 1F1B with split backward, W deferred into the cool-down, 1F1B memory",
    orders=lambda pp, m, v, group: zb_h1_orders(pipeline_model_parallel_size=pp, num_microbatches=m),
    split_backward=True,
    torch_class="ScheduleInterleavedZeroBubble",
    path_share=PathShare.forward,
    in_flight_floor=InFlightFloor.staircase,
    flushed_bubble=_zb_flushed,
    in_flight=lambda pp, m, v, group: (min(pp, m),) * pp,
    sizes_ok=lambda pp, m, v, group: v == 1,
)

ZB_H2 = ScheduleSpec(
    name=ScheduleName.zb_h2,
    summary="ZB-H2 (Qi et al. 2024): more warm-up forwards, zero steady-state bubble at 2P - 1 in flight",
    orders=lambda pp, m, v, group: zb_h2_orders(pipeline_model_parallel_size=pp, num_microbatches=m),
    split_backward=True,
    path_share=PathShare.forward,
    in_flight_floor=InFlightFloor.staircase,
    # With a flush its bubble equals ZB-H1's; its zero is the steady-state figure (Qi et al. 2024, sec. 3.1).
    flushed_bubble=_zb_flushed,
    steady_bubble=lambda pp, m, v: 0.0,
    in_flight=lambda pp, m, v, group: (min(2 * pp - 1, m),) * pp,
    sizes_ok=lambda pp, m, v, group: v == 1,
)
