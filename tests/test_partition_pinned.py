"""The coupled-memory split of profiles with a few entries at each end around identical decoders (a MoE model's
embedding and dense layers, its MoE layers, its MTP blocks and loss): exact against brute force over every split
megatron-core takes, and its closed-form memory test never refuses a split that fits."""

from __future__ import annotations

import itertools
import math

import pytest
from _partition_checks import solve_like_brute
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megapipe.layout import mtp_problem
from megapipe.partition import StageSpec
from megapipe.partition.coupled import uniform_rank_totals, uniform_shape
from megapipe.partition.memory import stage_ranks
from megapipe.partition.pinned import pinned_cases, pinned_may_fit, pinned_rank_totals, pinned_shape, pinned_split
from megapipe.records import LayerCost, LayerKind
from megapipe.schedules import build, rank_in_flight_profiles

UNIT = 2**27  # byte counts are multiples of 128 MiB: every memory sum is exact


def _layer(kind, time, static, act, name="x"):
    return LayerCost(name=name, kind=kind, fwd_ms=time / 3, bwd_ms=2 * time / 3, wgrad_ms=time / 3,
                     static_bytes=float(static * UNIT), act_bytes=float(act * UNIT))


def _fits(chunks, stages, built) -> bool:
    """Every rank's memory at every moment of the built orders, op by op."""
    ranks = built.stage_to_rank
    static = [math.fsum(e.static_bytes for e in chunk) for chunk in chunks]
    act = [math.fsum(e.act_bytes for e in chunk) for chunk in chunks]
    split = {(a.stage, a.microbatch) for order in built.orders for a in order if a.kind.value == "I"}
    for rank, order in enumerate(built.orders):
        held = sum(static[c] for c in range(len(chunks)) if ranks[c] == rank)
        if held > stages[rank].memory_bytes:
            return False
        for action in order:
            if action.kind.value == "F":
                held += act[action.stage]
                if held > stages[rank].memory_bytes:
                    return False
            elif action.kind.value == "W" or (action.kind.value == "B" and (action.stage, action.microbatch)
                                              not in split):
                held -= act[action.stage]
    return True


def _stages(layers, pp: int, fraction: float, slow: bool = False) -> list[StageSpec]:
    """Ranks with ``fraction`` of an even share of the static bytes and four microbatches' activations each."""
    need = (sum(e.static_bytes for e in layers) + 4 * sum(e.act_bytes for e in layers)) / pp
    cap = math.ceil(fraction * need / UNIT) * UNIT
    return [StageSpec(memory_bytes=cap, time_scale=1.5 if slow and rank == 1 else 1.0) for rank in range(pp)]


def _fitting_splits(layers, stages, schedule, num_microbatches, vp, *, mtp_rules=True):
    """(chunks, built schedule) of every split that fits (and that megatron-core takes, with ``mtp_rules``)."""
    pp = len(stages)
    built = build(schedule, pipeline_model_parallel_size=pp, num_microbatches=num_microbatches,
                  virtual_pipeline_model_parallel_size=vp)
    for cuts in itertools.combinations(range(1, len(layers)), pp * vp - 1):
        bounds = (0, *cuts, len(layers))
        chunks = [layers[a:b] for a, b in zip(bounds, bounds[1:])]
        if mtp_rules and mtp_problem([[e.kind for e in chunk] for chunk in chunks], pipeline_model_parallel_size=pp):
            continue
        if _fits(chunks, stages, built):
            yield chunks, built


def _brute(layers, stages, schedule, num_microbatches, vp, *, mtp_rules=True):
    """The least bottleneck over every split that fits (and that megatron-core takes, with ``mtp_rules``)."""
    return min((max(stages[built.stage_to_rank[c]].time_scale * math.fsum(e.fwd_ms + e.bwd_ms for e in chunk)
                    for c, chunk in enumerate(chunks))
                for chunks, built in _fitting_splits(layers, stages, schedule, num_microbatches, vp,
                                                     mtp_rules=mtp_rules)), default=None)


@st.composite
def moe_profiles(draw):
    """[embedding] + dense layers + MoE layers + [MTP blocks] + loss, each kind with its own time and bytes."""
    dense = draw(st.integers(0, 3))
    moe = draw(st.integers(2, 6))
    mtp = draw(st.integers(0, 2))
    embedding = draw(st.booleans())
    layers = [_layer(LayerKind.embedding, draw(st.integers(0, 2)), draw(st.integers(0, 3)), 1, "E")] if embedding \
        else []
    dense_layer = _layer(LayerKind.decoder, draw(st.integers(1, 3)), draw(st.integers(0, 2)), draw(st.integers(1, 3)))
    moe_layer = _layer(LayerKind.decoder, draw(st.integers(1, 4)), draw(st.integers(1, 4)), draw(st.integers(1, 3)))
    mtp_layer = _layer(LayerKind.mtp, draw(st.integers(2, 6)), draw(st.integers(1, 4)), draw(st.integers(1, 4)))
    layers += [dense_layer] * dense + [moe_layer] * moe + [mtp_layer] * mtp
    layers.append(_layer(LayerKind.loss, draw(st.integers(0, 4)), draw(st.integers(0, 3)), draw(st.integers(0, 2))))
    return layers


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(moe_profiles(), st.sampled_from([(2, 2), (2, 3), (3, 2)]), st.sampled_from([6, 12]), st.floats(0.5, 1.5),
       st.booleans(), st.sampled_from(["interleaved_1f1b", "zb_v"]))
def test_moe_profiles_exact_under_coupled_memory(layers, sizes, num_microbatches, fraction, slow, schedule):
    """The solver (free split, per-chunk shares, then the pinned split by counts) against brute force over every
    split megatron-core takes: the same least bottleneck, or both find none."""
    pp, vp = sizes
    if schedule == "zb_v":
        vp = 2
    if len(layers) < pp * vp or schedule == "interleaved_1f1b" and num_microbatches % pp:
        return
    stages = _stages(layers, pp, fraction, slow)
    best = _brute(layers, stages, schedule, num_microbatches, vp)
    part = solve_like_brute(layers, stages, best, memory_rel=1e-9, num_microbatches=num_microbatches,
                            schedule=schedule, virtual_pipeline_model_parallel_size=vp)
    if part is None:
        return
    assert mtp_problem(part.stage_kinds, pipeline_model_parallel_size=pp) is None


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(moe_profiles(), st.sampled_from([(2, 2), (2, 3), (3, 2)]), st.sampled_from([6, 12]), st.floats(0.5, 1.5),
       st.sampled_from(["interleaved_1f1b", "zb_v"]))
def test_pinned_split_and_may_fit_against_brute_force(layers, sizes, num_microbatches, fraction, schedule):
    """pinned_split alone is the least bottleneck over the splits megatron-core takes; pinned_may_fit is False only
    when no split fits at all (wherever its MTP blocks sit), and True when one does."""
    pp, vp = sizes
    if schedule == "zb_v":
        vp = 2
    if len(layers) < pp * vp or schedule == "interleaved_1f1b" and num_microbatches % pp:
        return
    shape = pinned_shape(layers)
    assert shape is not None
    stages = _stages(layers, pp, fraction)
    ranks = stage_ranks(schedule=schedule, pipeline_model_parallel_size=pp, num_stages=pp * vp)
    profiles = rank_in_flight_profiles(schedule, pipeline_model_parallel_size=pp, num_microbatches=num_microbatches,
                                       virtual_pipeline_model_parallel_size=vp)
    best = _brute(layers, stages, schedule, num_microbatches, vp)
    bounds = pinned_split(shape=shape, stages=stages, ranks=ranks, profiles=profiles)
    if best is None:
        assert bounds is None
    else:
        chunks = [layers[a:b] for a, b in zip(bounds, bounds[1:])]
        assert max(math.fsum(e.fwd_ms + e.bwd_ms for e in chunk) for chunk in chunks) == pytest.approx(best, rel=1e-9)
    anywhere = _brute(layers, stages, schedule, num_microbatches, vp, mtp_rules=False)
    assert pinned_may_fit(shape=shape, stages=stages, ranks=ranks, profiles=profiles) == (anywhere is not None)


def _brute_busiest(layers, stages, schedule, num_microbatches, vp):
    """The least busiest rank's F + B (all its stages together) over every split that fits and megatron-core takes."""
    def busiest(chunks, built) -> float:
        work = [0.0] * len(stages)
        for c, chunk in enumerate(chunks):
            work[built.stage_to_rank[c]] += math.fsum(e.fwd_ms + e.bwd_ms for e in chunk)
        return max(work)

    return min((busiest(*split) for split in _fitting_splits(layers, stages, schedule, num_microbatches, vp)),
               default=None)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(moe_profiles(), st.sampled_from([(2, 2), (2, 3), (3, 2), (2, 1), (3, 1), (4, 1)]), st.sampled_from([6, 12]),
       st.floats(0.5, 1.5), st.sampled_from(["interleaved_1f1b", "zb_v", "1f1b"]))
def test_pinned_rank_totals_bound_the_busiest_rank(layers, sizes, num_microbatches, fraction, schedule):
    """Water-filling each placement's ranks between their fewest and largest decoders (what the planner's memory
    floor does) never exceeds the busiest rank of the best split megatron-core takes, and finds no level exactly
    when no such split fits; one stage per rank (1F1B) as well as several."""
    from megapipe.plan.candidate_bounds import _capped_level

    pp, vp = sizes
    if schedule == "zb_v":
        vp = 2
    if schedule == "1f1b":
        vp = 1
    elif vp == 1:
        return
    if len(layers) < pp * vp or schedule == "interleaved_1f1b" and num_microbatches % pp:
        return
    shape = pinned_shape(layers)
    stages = _stages(layers, pp, fraction)
    ranks = stage_ranks(schedule=schedule, pipeline_model_parallel_size=pp, num_stages=pp * vp)
    profiles = rank_in_flight_profiles(schedule, pipeline_model_parallel_size=pp, num_microbatches=num_microbatches,
                                       virtual_pipeline_model_parallel_size=vp)
    found = pinned_rank_totals(shape=shape, stages=stages, ranks=ranks, profiles=profiles)
    assert found is not None
    unit = shape.decoder.fwd_ms + shape.decoder.bwd_ms
    levels = [_capped_level(pinned, unit, fewest, largest, shape.num_decoders) for pinned, fewest, largest in zip(*found)]
    level = min((value for value in levels if value is not None), default=None)
    best = _brute_busiest(layers, stages, schedule, num_microbatches, vp)
    if best is None:
        assert level is None
    else:
        assert level is not None and level <= best * (1 + 1e-9)
    uniform = uniform_shape(layers)
    if uniform is None or len(ranks) == pp:
        return
    # decoders of equal bytes between the embedding and the loss: the uniform closed form bounds it the same way
    totals = uniform_rank_totals(shape=uniform, stages=stages, ranks=ranks, profiles=profiles)
    assert totals is not None
    if best is None:
        assert totals is False or _capped_level(*_pinned_ends(uniform, layers, ranks, pp), *totals,
                                                uniform.num_decoders) is None
        return
    assert totals is not False
    assert _capped_level(*_pinned_ends(uniform, layers, ranks, pp), *totals,
                         uniform.num_decoders) <= best * (1 + 1e-9)


def _pinned_ends(shape, layers, ranks, pp):
    """(each rank's embedding and loss F + B, the lightest decoder's F + B) of a profile of decoders of equal bytes,
    as the planner's floor pins and prices them (its decoders may differ in time)."""
    import numpy as np

    pinned = np.zeros(pp)
    for entry, rank in ((shape.head, ranks[0]), (shape.tail, ranks[-1])):
        if entry is not None:
            pinned[rank] += entry.fwd_ms + entry.bwd_ms
    return pinned, min(e.fwd_ms + e.bwd_ms for e in layers if e.kind == LayerKind.decoder)


def test_pinned_cases_place_the_ends_every_way_once():
    """DeepSeek-V3's ends (the embedding and three dense layers; MTP and loss): 8 x 2 placements, each stage
    non-empty, none before the head's last stage or after the tail's first holding a decoder."""
    dense, moe = _layer(LayerKind.decoder, 1, 1, 1), _layer(LayerKind.decoder, 2, 2, 2)
    layers = ([_layer(LayerKind.embedding, 1, 1, 1)] + [dense] * 3 + [moe] * 10
              + [_layer(LayerKind.mtp, 3, 3, 3), _layer(LayerKind.loss, 1, 1, 1)])
    shape = pinned_shape(layers)
    assert (len(shape.head), shape.num_decoders, len(shape.tail)) == (4, 10, 2)
    cases = list(pinned_cases(shape, 8))
    assert len(cases) == 16
    layouts = set()
    for pins, kinds in cases:
        assert all(entries or low for entries, low in zip(pins.entries, pins.low))  # no stage can be empty
        holders = [stage for stage, cap in enumerate(pins.cap) if cap]
        assert holders == list(range(holders[0], holders[-1] + 1))
        layouts.add(kinds)
    assert len(layouts) == 16


def test_pinned_shape_leaves_long_ends_to_the_milp():
    """A profile without a long run of identical decoders has too many placements of its ends."""
    layers = [_layer(LayerKind.decoder, 1 + index, 1, 1) for index in range(14)]
    assert pinned_shape(layers) is None
    assert pinned_shape(layers[:6]) is not None
