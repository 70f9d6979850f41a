"""Closed forms the search prunes with before simulating; each is provable, so ranking stays exact.

* :func:`least_in_flight` and :func:`water_level`: a lower bound on the fullest rank's bytes
  over every split, without a partition.
* :func:`layer_shape` and :func:`split_can_fit`: the partition solver's memory feasibility in
  closed form when the decoder layers are identical (the cost model's case): a chunk with
  in-flight count k holds at most floor((cap - pinned) / (static + k act)) decoders, so a split
  exists iff every chunk can hold what it must and the capacities add up to the decoder count.
* :func:`pipeline_floor_ms`: a lower bound on the simulated step of one partition, from its
  stage times alone.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from megapipe.partition.coupled import UniformShape
from megapipe.schedules import spec

__all__ = ["least_in_flight", "water_level", "split_can_fit", "stage_capacities", "pipeline_floor_ms"]

_SLACK = 1e-6
"""Decoder-count slack that absorbs the solver's prefix-sum rounding: split_can_fit only says no when sure."""


def least_in_flight(schedule: str, pipeline_model_parallel_size: int, num_microbatches: int) -> tuple[int, ...]:
    """Per rank, microbatches every layer on it keeps at least: the spec's in-flight floor.

    1F1B keeps min(p - r, m) and GPipe m; ZB-H1/H2 release at W, after 1F1B's B, so they hold
    at least as many; interleaved and V-shaped schedules are bounded by 1 (a chunk may sit
    where little is in flight).
    """
    return spec(schedule).least_in_flight(pipeline_model_parallel_size, num_microbatches)


def water_level(pinned: Sequence[float], per_layer: Sequence[float], num_layers: int) -> float:
    """Smallest M with sum_r max(0, (M - pinned_r) / per_layer_r) >= num_layers.

    Ranks join in increasing ``pinned`` order; with active set A the level is
    (N + sum_A pinned/cost) / sum_A 1/cost, valid once it does not exceed the next pinned value.
    """
    order = sorted(range(len(pinned)), key=pinned.__getitem__)
    weight = offset = 0.0
    level = max(pinned)
    for position, rank in enumerate(order):
        weight += 1.0 / per_layer[rank]
        offset += pinned[rank] / per_layer[rank]
        level = (num_layers + offset) / weight
        following = pinned[order[position + 1]] if position + 1 < len(order) else float("inf")
        if level <= following:
            break
    return max(level, max(pinned))


def split_can_fit(*, shape: UniformShape, caps: Sequence[float], in_flight: Sequence[int]) -> bool:
    """False only if no split into len(caps) non-empty layout stages keeps every stage within its cap.

    Layout stage c needs pinned_c + d_c (static + k_c act) for d_c decoders; a stage holding
    neither the head nor the tail needs d_c >= 1. Decoders are interchangeable, so such counts
    exist iff each stage's capacity meets its minimum and the capacities sum to num_decoders.
    """
    found = stage_capacities(shape=shape, caps=caps, in_flight=in_flight)
    return found is not None and sum(found[1]) >= shape.num_decoders


def stage_capacities(*, shape: UniformShape, caps: Sequence[float], in_flight: Sequence[int]
                     ) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(fewest, most) decoders each layout stage can hold within its cap (:func:`split_can_fit`'s capacities, at
    most num_decoders each), or None when some stage cannot hold its fewest."""
    last = len(caps) - 1
    decoder = shape.decoder
    fewest, most = [], []
    for chunk, (cap, count) in enumerate(zip(caps, in_flight)):
        pinned, holds_entry = 0.0, False
        for entry, where in ((shape.head, 0), (shape.tail, last)):
            if entry is not None and chunk == where:
                pinned += entry.static_bytes + count * entry.act_bytes
                holds_entry = True
        unit = decoder.static_bytes + count * decoder.act_bytes
        room = cap - pinned
        low = 0 if holds_entry else 1
        if unit <= 0:
            if room < -_SLACK * abs(cap):
                return None
            capacity = shape.num_decoders
        else:
            capacity = math.floor(room / unit + _SLACK)
            if capacity < low:
                return None
        fewest.append(low)
        most.append(min(capacity, shape.num_decoders))
    return tuple(fewest), tuple(most)


def pipeline_floor_ms(*, schedule: str, stage_to_rank: Sequence[int], fwd_ms: Sequence[float],
                      bwd_ms: Sequence[float], num_microbatches: int) -> float:
    """A lower bound on the simulated pipeline time of one partition.

    Rank r runs m (F + B) of each of its stages back to back; its first op is an F of some
    stage s on it, which waits for F of stages 0..s-1 of that microbatch; with a fused
    backward its last op is a B of a stage s on it, after which B of stages s-1..0 must still
    run. With f the smallest stage on r: step >= sum_{s<f} F_s + m sum_{s on r} (F_s + B_s)
    (+ sum_{s<f} B_s when fused). Message delays are >= 0 and left out.
    """
    fused = not spec(schedule).split_backward
    first: dict[int, int] = {}
    busy: dict[int, float] = {}
    for stage, rank in enumerate(stage_to_rank):
        first.setdefault(rank, stage)
        busy[rank] = busy.get(rank, 0.0) + fwd_ms[stage] + bwd_ms[stage]
    floor = 0.0
    for rank, stage in first.items():
        before = sum(fwd_ms[:stage]) + (sum(bwd_ms[:stage]) if fused else 0.0)
        floor = max(floor, before + num_microbatches * busy[rank])
    return floor
