"""Partition solver: exactness against brute force, baselines against Megatron / DeepSpeed, errors."""

from __future__ import annotations

import ast
import importlib.util
import itertools
import math
import pathlib

import numpy as np
import pytest
from _partition_checks import solve_like_brute
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megapipe.errors import ConfigError, InfeasibleError, ScheduleError
from megapipe.layout import parse_layout
from megapipe.partition import (
    StageSpec,
    equal_bounds,
    given_split,
    in_flight_counts,
    parameters_bounds,
    solve,
)
from megapipe.records import Profile
from megapipe.records import LayerCost, LayerKind
from megapipe.schedules import build
from megapipe.simulate import StageTimes, simulate

GIB = 2**30
UNIT = 2**27  # byte counts are multiples of 128 MiB: integral, so every memory sum is exact


def _layer(kind, fwd, bwd, static, act, params=0.0, name="x"):
    return LayerCost(
        name=name, kind=kind, fwd_ms=fwd, bwd_ms=bwd, wgrad_ms=bwd / 2,
        static_bytes=static, act_bytes=act, param_count=params,
    )  # fmt: skip


def _brute(layers, scales, caps, in_flight, ranks=None, rank_caps=None):
    """min over every composition of max stage time, with per-stage (and optionally per-rank) memory caps."""
    num_stages, num_entries = len(scales), len(layers)
    best, best_bounds = None, None
    for cuts in itertools.combinations(range(1, num_entries), num_stages - 1):
        bounds = (0, *cuts, num_entries)
        chunks = [layers[bounds[c] : bounds[c + 1]] for c in range(num_stages)]
        memory = [
            math.fsum(e.static_bytes for e in chunk) + k * math.fsum(e.act_bytes for e in chunk)
            for chunk, k in zip(chunks, in_flight)
        ]
        if any(used > cap for used, cap in zip(memory, caps)):
            continue
        if rank_caps is not None:
            per_rank = [sum(used for used, r in zip(memory, ranks) if r == rank) for rank in range(len(rank_caps))]
            if any(used > cap for used, cap in zip(per_rank, rank_caps)):
                continue
        worst = max(s * math.fsum(e.fwd_ms + e.bwd_ms for e in chunk) for s, chunk in zip(scales, chunks))
        if best is None or worst < best:
            best, best_bounds = worst, bounds
    return best, best_bounds


@st.composite
def instances(draw, max_entries=9, max_stages=4, min_stages=1):
    num_entries = draw(st.integers(1, max_entries))
    times = st.one_of(st.integers(0, 6).map(float), st.floats(0.0, 10.0, allow_subnormal=False))
    layers = []
    for index in range(num_entries):
        kind = LayerKind.decoder
        if index == 0 and draw(st.booleans()):
            kind = LayerKind.embedding
        elif index == num_entries - 1 and index and draw(st.booleans()):
            kind = LayerKind.loss
        static = draw(st.integers(0, 8)) * UNIT
        act = draw(st.integers(0, 4)) * UNIT
        layers.append(_layer(kind, draw(times), draw(times), float(static), float(act), name=f"e{index}"))
    num_stages = draw(st.integers(min_stages, max_stages))
    scale = st.one_of(st.sampled_from([0.5, 1.0, 1.5, 2.0, 3.0]), st.floats(0.25, 4.0))
    total = sum(e.static_bytes for e in layers) + 6 * sum(e.act_bytes for e in layers)
    cap = st.one_of(st.integers(0, int(total // UNIT) + 1).map(lambda n: float(n * UNIT)), st.just(math.inf))
    stages = [StageSpec(time_scale=draw(scale), memory_bytes=draw(cap)) for _ in range(num_stages)]
    return layers, stages, draw(st.integers(1, 6)), draw(st.sampled_from(["1f1b", "gpipe"]))


def _check_constraints(part, layers, stages, caps):
    assert sum(part.entries_per_stage) == len(layers) and min(part.entries_per_stage) >= 1
    flat = [kind for kinds in part.stage_kinds for kind in kinds]
    assert flat == [e.kind for e in layers]
    assert parse_layout(part.layout) == part.stage_kinds
    if layers[0].kind == LayerKind.embedding:
        assert part.stage_kinds[0][0] == LayerKind.embedding
    start = 0
    for chunk, count in enumerate(part.entries_per_stage):
        entries = layers[start : start + count]
        rank = part.stage_to_rank[chunk]
        assert part.stage_time_ms[chunk] == stages[rank].time_scale * math.fsum(e.fwd_ms + e.bwd_ms for e in entries)
        expected = math.fsum(e.static_bytes for e in entries) + part.stage_in_flight[chunk] * math.fsum(
            e.act_bytes for e in entries
        )
        assert part.stage_memory_bytes[chunk] == expected <= caps[chunk]
        start += count
    assert all(used <= stage.memory_bytes for used, stage in zip(part.rank_memory_bytes, stages))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instances())
def test_optimal_matches_brute_force(instance):
    layers, stages, num_microbatches, schedule = instance
    in_flight = in_flight_counts(
        schedule=schedule, pipeline_model_parallel_size=len(stages), num_microbatches=num_microbatches
    )
    caps = [stage.memory_bytes for stage in stages]
    best, _ = _brute(layers, [s.time_scale for s in stages], caps, in_flight)
    if best is None:
        with pytest.raises(InfeasibleError):
            solve(Profile(layers=layers), stages, num_microbatches=num_microbatches, schedule=schedule)
        return
    part = solve(Profile(layers=layers), stages, num_microbatches=num_microbatches, schedule=schedule)
    assert part.bottleneck_ms == pytest.approx(best, rel=1e-9, abs=1e-12)
    _check_constraints(part, layers, stages, caps)


@settings(max_examples=100, deadline=None)
@given(instances())
def test_without_memory_check_matches_unconstrained_brute_force(instance):
    layers, stages, num_microbatches, schedule = instance
    free = [StageSpec(time_scale=s.time_scale) for s in stages]
    best, _ = _brute(layers, [s.time_scale for s in stages], [math.inf] * len(stages), [1] * len(stages))
    if best is None:  # fewer entries than stages
        with pytest.raises(InfeasibleError, match="need at least one each"):
            solve(layers, stages, num_microbatches=num_microbatches, check_memory=False)
        return
    part = solve(layers, stages, num_microbatches=num_microbatches, schedule=schedule, check_memory=False)
    assert part.bottleneck_ms == pytest.approx(best, rel=1e-9, abs=1e-12)
    assert solve(layers, free, num_microbatches=num_microbatches).bottleneck_ms == pytest.approx(best, rel=1e-9, abs=1e-12)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def _coupled_brute(layers, stages, schedule, num_microbatches, vp):
    """min over every composition into P * v stages of the bottleneck, each rank's chunks within its memory at
    every moment of the schedule (the built orders, counted op by op)."""
    from megapipe.schedules import build

    pp = len(stages)
    built = build(schedule, pipeline_model_parallel_size=pp, num_microbatches=num_microbatches,
                  virtual_pipeline_model_parallel_size=vp)
    ranks = built.stage_to_rank
    split = {(a.stage, a.microbatch) for order in built.orders for a in order if a.kind.value == "I"}
    best = None
    for cuts in itertools.combinations(range(1, len(layers)), pp * vp - 1):
        bounds = (0, *cuts, len(layers))
        chunks = [layers[bounds[c]:bounds[c + 1]] for c in range(pp * vp)]
        static = [math.fsum(e.static_bytes for e in chunk) for chunk in chunks]
        act = [math.fsum(e.act_bytes for e in chunk) for chunk in chunks]
        fits = True
        for rank, order in enumerate(built.orders):
            held = sum(static[c] for c in range(pp * vp) if ranks[c] == rank)
            for action in order:
                if action.kind.value == "F":
                    held += act[action.stage]
                    if held > stages[rank].memory_bytes:
                        fits = False
                        break
                elif action.kind.value == "W" or (action.kind.value == "B" and (action.stage, action.microbatch)
                                                  not in split):
                    held -= act[action.stage]
            if not fits:
                break
        if not fits:
            continue
        worst = max(stages[ranks[c]].time_scale * math.fsum(e.fwd_ms + e.bwd_ms for e in chunk)
                    for c, chunk in enumerate(chunks))
        best = worst if best is None or worst < best else best
    return best


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    instances(max_entries=8, max_stages=2, min_stages=2),
    st.sampled_from(["interleaved_1f1b", "zb_v"]),
    st.sampled_from([2, 4, 6]),
)
def test_virtual_stages_exact_under_coupled_rank_memory(instance, schedule, num_microbatches):
    """Against brute force over every split, with each rank's memory tracked op by op through the schedule."""
    layers, stages, _, _ = instance
    vp = 2
    if len(layers) < len(stages) * vp:
        return
    best = _coupled_brute(layers, stages, schedule, num_microbatches, vp)
    solve_like_brute(layers, stages, best, memory_rel=1e-12, num_microbatches=num_microbatches, schedule=schedule,
                     virtual_pipeline_model_parallel_size=vp)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.integers(4, 10), st.integers(1, 3), st.integers(1, 6), st.sampled_from([2, 3]), st.sampled_from([4, 8]),
    st.integers(10, 60), st.booleans(),
)
def test_identical_decoders_exact_by_counts(num_decoders, static, act, vp, num_microbatches, cap_units, ends):
    """The counts solver (cost-model profiles) against brute force: interleaved 1F1B, two ranks, one slower."""
    decoder = _layer(LayerKind.decoder, 1.0, 2.0, static * UNIT, act * UNIT)
    layers = [decoder] * num_decoders
    if ends:
        layers = [_layer(LayerKind.embedding, 0.5, 0.5, 2 * UNIT, UNIT)] + layers + [
            _layer(LayerKind.loss, 2.0, 2.0, 2 * UNIT, 3 * UNIT)]
    if len(layers) < 2 * vp:
        return
    stages = [StageSpec(memory_bytes=cap_units * UNIT), StageSpec(time_scale=1.5, memory_bytes=cap_units * UNIT)]
    _assert_interleaved_equals_brute(layers, stages, num_microbatches, vp)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    instances(max_entries=10, max_stages=3, min_stages=2),
    st.sampled_from(["interleaved_1f1b", "zb_v", "1f1b"]),
    st.sampled_from([2, 4, 6]),
    st.booleans(),
)
def test_a_split_known_without_solving_is_the_solvers(instance, schedule, num_microbatches, check_memory):
    """free_split answers only where the solver's split is the one of least bottleneck without memory limits, and
    then it is the solver's split (entries per layout stage and ranks); where it answers None on coupled stages with
    memory checked, the free split overfills some rank."""
    from megapipe.partition import free_split
    from megapipe.partition.memory import stage_ranks

    layers, stages, _, _ = instance
    vp = 1 if schedule == "1f1b" else 2
    if len(layers) < len(stages) * vp:
        return
    inputs = dict(num_microbatches=num_microbatches, schedule=schedule, virtual_pipeline_model_parallel_size=vp)
    try:
        known = free_split(layers, stages, check_memory=check_memory, **inputs)
    except ScheduleError:  # sizes the schedule refuses: the solver refuses them alike
        with pytest.raises(ScheduleError):
            solve(layers, stages, check_memory=check_memory, **inputs)
        return
    try:
        part = solve(layers, stages, check_memory=check_memory, **inputs)
    except InfeasibleError:
        assert known is None
        return
    coupled = len(stage_ranks(schedule=schedule, pipeline_model_parallel_size=len(stages),
                              num_stages=len(stages) * vp)) > len(stages)
    if not coupled:
        assert known is None
    elif known is not None:
        assert known == (part.entries_per_stage, part.stage_to_rank)
    elif not check_memory:
        raise AssertionError("without memory the solver's split is always the free one")
    else:
        free = solve(layers, stages, check_memory=False, **inputs)
        assert not all(used <= stage.memory_bytes for used, stage in zip(
            free.rank_memory_bytes, stages))


def _assert_interleaved_equals_brute(layers, stages, num_microbatches, vp, *, memory_rel=0.0):
    """The solver's interleaved 1F1B split against brute force: the same bottleneck, or both find none."""
    best = _coupled_brute(layers, stages, "interleaved_1f1b", num_microbatches, vp)
    solve_like_brute(layers, stages, best, memory_rel=memory_rel, num_microbatches=num_microbatches,
                     schedule="interleaved_1f1b", virtual_pipeline_model_parallel_size=vp)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.integers(1, 3), st.integers(7, 10), st.integers(1, 3), st.integers(2, 5), st.sampled_from([2, 4]),
    st.integers(20, 120), st.booleans(),
)
def test_runs_of_identical_entries_exact_under_coupled_memory(dense, moe, dense_act, moe_static, num_microbatches,
                                                               cap_units, slow):
    """A MoE model's profile (embedding, dense layers, MoE layers, MTP, loss) is solved over its runs of
    identical entries; against brute force on interleaved 1F1B, two ranks (one slower when ``slow``)."""
    from megapipe.partition.milp import _runs

    layers = ([_layer(LayerKind.embedding, 0.5, 0.5, 2 * UNIT, UNIT)]
              + [_layer(LayerKind.decoder, 1.0, 2.0, UNIT, dense_act * UNIT)] * dense
              + [_layer(LayerKind.decoder, 1.5, 3.0, moe_static * UNIT, 2 * UNIT)] * moe
              + [_layer(LayerKind.decoder, 2.0, 4.0, moe_static * UNIT, 3 * UNIT)]  # MTP costs like a MoE layer and more
              + [_layer(LayerKind.loss, 2.0, 2.0, 2 * UNIT, 3 * UNIT)])
    assert 2 * len(_runs(layers)) < len(layers)  # the run formulation decides
    stages = [StageSpec(memory_bytes=cap_units * UNIT),
              StageSpec(time_scale=1.5 if slow else 1.0, memory_bytes=cap_units * UNIT)]
    _assert_interleaved_equals_brute(layers, stages, num_microbatches, 2, memory_rel=1e-9)


def test_coupled_memory_accepts_splits_the_per_chunk_shares_rejected():
    """A rank's chunks peak at different moments: the rank holds less than the sum of their peaks, so a split
    that needs exactly the coupled peak fits (the per-chunk share rule, which sums the peaks, refused it)."""
    layers = [_layer(LayerKind.decoder, 1.0, 2.0, 2.0 * UNIT, 1.0 * UNIT) for _ in range(8)]
    call = dict(num_microbatches=4, schedule="interleaved_1f1b", virtual_pipeline_model_parallel_size=2)
    free = solve(layers, [StageSpec()] * 2, **call)
    assert free.entries_per_stage == (2, 2, 2, 2)
    coupled = free.rank_memory_bytes
    assert all(peak < summed for peak, summed in zip(coupled, free.rank_stage_peaks_bytes))
    part = solve(layers, [StageSpec(memory_bytes=peak) for peak in coupled], **call)
    assert part.entries_per_stage == (2, 2, 2, 2) and part.rank_memory_bytes == pytest.approx(coupled)
    sim = simulate(build("interleaved_1f1b", pipeline_model_parallel_size=2, num_microbatches=4,
                         virtual_pipeline_model_parallel_size=2),
                   StageTimes(fwd_ms=(1.0,) * 4, bwd_ms=(2.0,) * 4, wgrad_ms=(1.0,) * 4, act_bytes=part.stage_act_bytes))
    static = part._rank_sums(part.stage_static_bytes)
    assert [s + r.peak_activation_bytes for s, r in zip(static, sim.ranks)] == pytest.approx(list(coupled))


def test_heterogeneous_stages_get_work_in_proportion_to_speed():
    layers = [_layer(LayerKind.decoder, 1.0, 2.0, 0.0, 0.0) for _ in range(12)]
    part = solve(layers, [StageSpec(time_scale=1.0), StageSpec(time_scale=2.0)], num_microbatches=4)
    assert part.entries_per_stage == (8, 4) and part.bottleneck_ms == 24.0


def test_memory_cap_moves_layers_off_the_first_stage():
    # 1F1B: stage j keeps 4 - j microbatches, so n layers need n * (5 - j) units; caps allow 3, 4, 5, 8.
    layers = [_layer(LayerKind.decoder, 1.0, 2.0, UNIT, UNIT) for _ in range(16)]
    free = solve(layers, [StageSpec()] * 4, num_microbatches=8)
    capped = solve(layers, [StageSpec(memory_bytes=16.0 * UNIT)] * 4, num_microbatches=8)
    assert free.entries_per_stage == (4, 4, 4, 4) and free.bottleneck_ms == 12.0
    assert capped.entries_per_stage[0] <= 3 and capped.bottleneck_ms == 15.0  # 3 + 4 + 4 + 4 < 16 layers
    assert _brute(layers, [1.0] * 4, [16.0 * UNIT] * 4, (4, 3, 2, 1))[0] == 15.0


def test_closed_form_in_flight_matches_schedule_builder():
    from megapipe.schedules import build
    from megapipe.schedules.registry import _peak_from_orders

    for pp, m in [(1, 1), (2, 1), (4, 2), (4, 8), (8, 16)]:
        for name in ("1f1b", "gpipe"):
            built = _peak_from_orders(build(name, pipeline_model_parallel_size=pp, num_microbatches=m))
            ours = in_flight_counts(schedule=name, pipeline_model_parallel_size=pp, num_microbatches=m)
            assert ours == built, (name, pp, m)


def _megatron_profile(num_layers):
    return (
        [_layer(LayerKind.embedding, 1.0, 1.0, 0.0, 0.0)]
        + [_layer(LayerKind.decoder, 1.0, 2.0, 0.0, 0.0) for _ in range(num_layers)]
        + [_layer(LayerKind.loss, 1.0, 1.0, 0.0, 0.0)]
    )


@pytest.mark.engine
def test_equal_matches_megatron_uniform_split():
    pytest.importorskip("megatron.core")
    import torch
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    for num_layers, pp, vp in [(8, 2, 1), (8, 2, 2), (12, 4, 1), (24, 4, 3), (6, 1, 1), (32, 8, 2)]:
        config = TransformerConfig(
            num_layers=num_layers, hidden_size=64, num_attention_heads=4, pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=vp if vp > 1 else None, pipeline_dtype=torch.float32,
        )  # fmt: skip
        layers = _megatron_profile(num_layers)
        part = solve(layers, [StageSpec()] * pp, num_microbatches=pp, method="equal", check_memory=False,
                     schedule="interleaved_1f1b" if vp > 1 else "1f1b", virtual_pipeline_model_parallel_size=vp)
        offset = 0
        for chunk, kinds in enumerate(part.stage_kinds):
            vp_stage, pp_rank = (chunk // pp, chunk % pp) if vp > 1 else (None, chunk)
            assert kinds.count(LayerKind.decoder) == get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
            assert offset == get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
            offset += kinds.count(LayerKind.decoder)
        assert part.stage_kinds[0][0] == LayerKind.embedding and part.stage_kinds[-1][-1] == LayerKind.loss


def test_equal_remainder_goes_to_first_stages():
    kinds = [e.kind for e in _megatron_profile(9)]
    bounds = equal_bounds(kinds, num_stages=4)
    counts = [kinds[bounds[c] : bounds[c + 1]].count(LayerKind.decoder) for c in range(4)]
    assert counts == [3, 2, 2, 2]
    # 10 layers + embedding + loss fill 4 stages equally: Megatron's account_for_embedding/loss_in_pipeline_split
    kinds = [e.kind for e in _megatron_profile(10)]
    bounds = equal_bounds(kinds, num_stages=4)
    assert [kinds[bounds[c] : bounds[c + 1]].count(LayerKind.decoder) for c in range(4)] == [2, 3, 3, 2]
    mtp = kinds[:-1] + [LayerKind.mtp, LayerKind.loss]
    assert equal_bounds(mtp, num_stages=2)[1] == 6  # E + 5 t | 5 t, m, L
    # 126 layers on PP16 x VP8: the first chunk holds only E, the last only L
    kinds = [e.kind for e in _megatron_profile(126)]
    bounds = equal_bounds(kinds, num_stages=128)
    assert kinds[bounds[0]:bounds[1]] == [LayerKind.embedding] and kinds[bounds[-2]:bounds[-1]] == [LayerKind.loss]


def _deepspeed_partition_balanced(weights, num_parts):
    """DeepSpeed's recurrence written out with scalar loops, the way ds_utils.partition_balanced runs it."""
    n, m = len(weights), num_parts
    prefix = [0.0, *itertools.accumulate(float(w) for w in weights)]
    inf = math.inf
    dp_max = [[inf] * (m + 1) for _ in range(n + 1)]
    dp_min = [[inf] * (m + 1) for _ in range(n + 1)]
    dp_cost = [[inf] * (m + 1) for _ in range(n + 1)]
    position = [[0] * (m + 1) for _ in range(n + 1)]
    dp_max[0][0] = dp_cost[0][0] = 0.0
    for i in range(1, n + 1):
        for j in range(1, min(i, m) + 1):
            for k in range(i):
                part = prefix[i] - prefix[k]
                high, low = max(dp_max[k][j - 1], part), min(dp_min[k][j - 1], part)
                if dp_cost[i][j] >= high - low:
                    dp_cost[i][j], dp_max[i][j], dp_min[i][j], position[i][j] = high - low, high, low, k
    parts = [n]
    for j in range(m, 0, -1):
        parts.append(position[parts[-1]][j])
    return tuple(reversed(parts))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.one_of(st.integers(0, 5), st.integers(0, 10**6)), min_size=1, max_size=12), st.integers(1, 5))
def test_parameters_follows_deepspeed_recurrence(weights, num_parts):
    if len(weights) < num_parts:
        with pytest.raises(InfeasibleError, match="cannot fill"):
            parameters_bounds(weights, num_stages=num_parts)
        return
    expected = tuple(range(num_parts + 1)) if len(weights) == num_parts else _deepspeed_partition_balanced(weights, num_parts)
    assert parameters_bounds(weights, num_stages=num_parts) == expected


def test_parameters_examples():
    # DeepSpeed minimises the spread (max - min), not the max: [5,1|1,5] has spread 0.
    assert parameters_bounds([5, 1, 1, 5], num_stages=2) == (0, 2, 4)
    # Spread 1 for [4|1,1,1|1,1] is minimal; ties go to the latest cut.
    assert parameters_bounds([4, 1, 1, 1, 1, 1], num_stages=3) == (0, 1, 4, 6)
    layers = [_layer(LayerKind.decoder, 1.0, 1.0, 0.0, 0.0, params=p) for p in (5, 1, 1, 5)]
    part = solve(layers, [StageSpec()] * 2, num_microbatches=2, method="parameters")
    assert part.entries_per_stage == (2, 2) and part.method == "parameters"


def _installed_deepspeed_functions():
    spec = importlib.util.find_spec("deepspeed")
    if spec is None or spec.origin is None:
        return None
    source = (pathlib.Path(spec.origin).parent / "runtime" / "utils.py").read_text()
    wanted = {"partition_uniform", "partition_balanced"}
    body = [node for node in ast.parse(source).body if isinstance(node, ast.FunctionDef) and node.name in wanted]
    namespace: dict = {}
    exec(compile(ast.Module(body=body, type_ignores=[]), "deepspeed.runtime.utils", "exec"), namespace)
    return namespace


def test_parameters_matches_installed_deepspeed():
    functions = _installed_deepspeed_functions()
    if functions is None:
        pytest.skip("deepspeed is not installed")
    rng = np.random.default_rng(0)
    for _ in range(200):
        num_parts = int(rng.integers(1, 6))
        weights = rng.integers(0, 50, size=int(rng.integers(num_parts, 12))).tolist()
        assert parameters_bounds(weights, num_stages=num_parts) == tuple(
            functions["partition_balanced"](weights, num_parts)
        )


def test_baseline_over_memory_is_flagged_or_raised():
    # 1F1B on 2 stages: a layer costs 4 + 2 * 1 = 6 GiB on stage 0 and 5 GiB on stage 1.
    layers = [_layer(LayerKind.decoder, 1.0, 2.0, 4.0 * GIB, 1.0 * GIB) for _ in range(9)]
    stages = [StageSpec(memory_bytes=25.0 * GIB)] * 2
    flagged = solve(layers, stages, num_microbatches=4, method="equal", check_memory=False)
    assert flagged.entries_per_stage == (5, 4) and not flagged.fits_memory
    assert flagged.rank_memory_bytes == (30.0 * GIB, 20.0 * GIB)
    with pytest.raises(InfeasibleError, match=r"^equal split: stage 0 needs at least 30\.0 GiB but has 25\.0 GiB "):
        solve(layers, stages, num_microbatches=4, method="equal")
    fitted = solve(layers, stages, num_microbatches=4)
    assert fitted.fits_memory and fitted.entries_per_stage == (4, 5)


def test_infeasible_memory_names_tightest_stage():
    layers = [_layer(LayerKind.embedding, 1.0, 1.0, 40.0 * GIB, 1.0 * GIB)]
    layers += [_layer(LayerKind.decoder, 1.0, 2.0, 10.0 * GIB, 2.0 * GIB) for _ in range(6)]
    stages = [StageSpec(memory_bytes=72.0 * GIB)] * 2
    # Stage 0 holds 2 microbatches: E alone needs 42 GiB, E + t needs 56, E + 2t needs 70, E + 3t needs 84.
    # Stage 1 holds 1: 4t = 48, 3t = 36. Best split E+2t | 4t fits, so shrink memory until it does not.
    assert solve(layers, stages, num_microbatches=4).entries_per_stage == (3, 4)
    tight = [StageSpec(memory_bytes=45.0 * GIB)] * 2
    # Smallest worst overage: E+t | 5t -> 56 - 45 = 11 and 60 - 45 = 15; E+2t | 4t -> 25 and 3; E | 6t -> 72 - 45 = 27.
    with pytest.raises(InfeasibleError, match=r"^stage 1 needs at least 60\.0 GiB but has 45\.0 GiB \(over by 15\.0 GiB\): add pipeline stages, recompute, or a smaller micro-batch$"):
        solve(layers, tight, num_microbatches=4)


def test_bad_arguments():
    layers = [_layer(LayerKind.decoder, 1.0, 1.0, 0.0, 0.0) for _ in range(3)]
    with pytest.raises(InfeasibleError, match="3 entries but 2 pipeline ranks x 2 virtual stages"):
        solve(layers, [StageSpec()] * 2, num_microbatches=2, schedule="interleaved_1f1b", virtual_pipeline_model_parallel_size=2)
    with pytest.raises(ConfigError, match="method='fastest'"):
        solve(layers, [StageSpec()], num_microbatches=1, method="fastest")
    with pytest.raises(ConfigError, match=r"stages\[1\]\.time_scale=0\.0"):
        solve(layers, [StageSpec(), StageSpec(time_scale=0.0)], num_microbatches=1)
    with pytest.raises(ConfigError, match="num_microbatches=0"):
        solve(layers, [StageSpec()], num_microbatches=0)
    with pytest.raises(ConfigError, match="stages is empty"):
        solve(layers, [], num_microbatches=1)
    with pytest.raises(InfeasibleError, match="equal split: num_layers=3 decoder layers cannot fill 4 stages"):
        equal_bounds([e.kind for e in layers], num_stages=4)


def test_evaluate_reports_a_given_split():
    layers = _megatron_profile(6)
    stages = [StageSpec(memory_bytes=1.0)] * 2
    part = given_split(layers, stages, entries_per_stage=(4, 4), num_microbatches=4)
    assert part.layout == "Et*3|t*3L" and part.stage_time_ms == (11.0, 11.0) and part.method == "given"
    with pytest.raises(ConfigError, match="must sum to the profile's 8 entries"):
        given_split(layers, stages, entries_per_stage=(4, 3), num_microbatches=4)


def test_entry_too_big_for_a_small_middle_stage_skips_it():
    # The heavy entry fits stages 0 and 2 but not stage 1, so stage 1 must end before it or start after it.
    layers = [_layer(LayerKind.decoder, 1.0, 1.0, UNIT, 0.0) for _ in range(6)]
    layers[3] = _layer(LayerKind.decoder, 1.0, 1.0, 8.0 * UNIT, 0.0)
    stages = [StageSpec(), StageSpec(memory_bytes=4.0 * UNIT), StageSpec()]
    part = solve(layers, stages, num_microbatches=1)
    best, bounds = _brute(layers, [1.0] * 3, [s.memory_bytes for s in stages], (1, 1, 1))
    assert part.bottleneck_ms == best == 6.0
    first, second, _ = part.entries_per_stage
    assert not first <= 3 < first + second


def test_virtual_stage_error_names_the_rank():
    layers = [_layer(LayerKind.decoder, 1.0, 2.0, 2.0 * GIB, 1.0 * GIB) for _ in range(8)]
    with pytest.raises(InfeasibleError, match=r"^pipeline rank \d \(all its chunks, at their peak together\) needs at "
                                              r"least .* GiB but has 8\.0 GiB; no split fits every rank \(over by"):
        solve(layers, [StageSpec(memory_bytes=8.0 * GIB)] * 2, num_microbatches=4,
              schedule="interleaved_1f1b", virtual_pipeline_model_parallel_size=2)


def _utilisation(need, cap):
    if cap == math.inf or (cap == 0 and need <= 0):
        return 0.0
    return need / cap if cap > 0 else math.inf


def _least_utilisation_brute(layers, scales, caps, in_flight):
    """(bottleneck, least max utilisation among splits at that bottleneck), costs on prefix sums as the solver."""
    num_stages, num_entries = len(scales), len(layers)
    times = [0.0, *itertools.accumulate(e.fwd_ms + e.bwd_ms for e in layers)]
    static = [0.0, *itertools.accumulate(e.static_bytes for e in layers)]
    act = [0.0, *itertools.accumulate(e.act_bytes for e in layers)]
    splits = []
    for cuts in itertools.combinations(range(1, num_entries), num_stages - 1):
        bounds = (0, *cuts, num_entries)
        pairs = list(zip(bounds[:-1], bounds[1:]))
        need = [(static[b] - static[a]) + k * (act[b] - act[a]) for (a, b), k in zip(pairs, in_flight)]
        if any(used > cap for used, cap in zip(need, caps)):
            continue
        worst = max(s * (times[b] - times[a]) for s, (a, b) in zip(scales, pairs))
        splits.append((worst, max(_utilisation(n, c) for n, c in zip(need, caps))))
    if not splits:
        return None, None
    best = min(worst for worst, _ in splits)
    return best, min(level for worst, level in splits if worst <= best * (1 + 1e-9))


@st.composite
def tied_instances(draw):
    """Integer stage times (many splits share the bottleneck) on 2-5 stages, 1F1B or GPipe."""
    layers, stages, num_microbatches, schedule = draw(instances(max_entries=10, max_stages=5, min_stages=2))
    layers = [
        _layer(e.kind, float(draw(st.integers(0, 3))), float(draw(st.integers(0, 3))), e.static_bytes, e.act_bytes)
        for e in layers
    ]
    return layers, stages, num_microbatches, schedule


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tied_instances())
def test_optimal_split_has_least_utilisation_among_bottleneck_optimal(instance):
    layers, stages, num_microbatches, schedule = instance
    in_flight = in_flight_counts(
        schedule=schedule, pipeline_model_parallel_size=len(stages), num_microbatches=num_microbatches
    )
    caps = [s.memory_bytes for s in stages]
    best, level = _least_utilisation_brute(layers, [s.time_scale for s in stages], caps, in_flight)
    if best is None:
        return
    part = solve(layers, stages, num_microbatches=num_microbatches, schedule=schedule)
    assert part.bottleneck_ms == pytest.approx(best, rel=1e-9, abs=1e-12)
    if any(math.isfinite(cap) for cap in caps):  # with no finite cap the min-max split is kept as found
        got = max(_utilisation(used, cap) for used, cap in zip(part.stage_memory_bytes, caps))
        assert got == pytest.approx(level, rel=1e-9, abs=1e-12)


def test_tied_bottleneck_moves_layers_off_the_fullest_stage():
    # 7 equal layers on 3 stages: every split with at most 3 layers a stage has bottleneck 9 ms. 1F1B keeps
    # 3, 2, 1 microbatches, so a layer needs 4, 3, 2 units; (2, 2, 3) peaks at 8 units, (3, 3, 1) at 12.
    layers = [_layer(LayerKind.decoder, 1.0, 2.0, UNIT, UNIT) for _ in range(7)]
    part = solve(layers, [StageSpec(memory_bytes=64.0 * UNIT)] * 3, num_microbatches=8)
    assert part.bottleneck_ms == 9.0 and part.entries_per_stage == (2, 2, 3)
    assert max(part.stage_memory_bytes) == 8 * UNIT
    # Without a finite cap, and with virtual stages, the min-max split is kept as found (latest cuts last).
    assert solve(layers, [StageSpec()] * 3, num_microbatches=8).entries_per_stage == (3, 3, 1)


def test_rank_problem_largest_total_equals_brute_force_with_many_chunks():
    """A rank of 5 or 6 chunks settles its largest total through the linear relaxation and the combined-row
    bound; the total equals exhaustive enumeration of every count vector."""
    import itertools
    import random

    from megapipe.partition.rank_problem import RankProblem
    from megapipe.records import LayerCost, LayerKind

    rng = random.Random(7)
    checked = 0
    for _ in range(150):
        chunks, rows = rng.choice((5, 6)), rng.randint(2, 8)
        decoder = LayerCost(name="t", kind=LayerKind.decoder, fwd_ms=1.0, bwd_ms=2.0, wgrad_ms=0.0,
                            static_bytes=rng.uniform(1, 4), act_bytes=rng.uniform(0.2, 2))
        profile = [tuple(rng.randint(0, 6) for _ in range(chunks)) for _ in range(rows)]
        low = [1] * chunks
        problem = RankProblem(decoder, list(range(chunks)), profile, rng.uniform(40, 160),
                              [(0.0, 0.0, 0.0)] * chunks, low)
        high = tuple(rng.randint(1, 4) for _ in range(chunks))
        feasible = [sum(c) for c in itertools.product(*(range(lo, h + 1) for lo, h in zip(low, high)))
                    if problem.fits(c)]
        assert problem.largest(high) == (max(feasible) if feasible else None)
        checked += bool(feasible)
    assert checked > 50


def test_rank_problem_back_loading_is_exact_and_keeps_the_general_counts():
    """Rows whose weights fall along the stages (every schedule's in-flight profiles do): the back-loaded
    largest total equals exhaustive enumeration, and the counts the split uses are the general path's (the
    greedy's, which fills the last stages first and so reaches the optimum)."""
    import itertools
    import random

    from megapipe.partition.rank_problem import RankProblem
    from megapipe.records import LayerCost, LayerKind

    rng = random.Random(11)
    for _ in range(400):
        chunks, rows = rng.randint(1, 6), rng.randint(1, 8)
        decoder = LayerCost(name="t", kind=LayerKind.decoder, fwd_ms=1.0, bwd_ms=2.0, wgrad_ms=0.0,
                            static_bytes=rng.uniform(1, 4), act_bytes=rng.uniform(0.2, 2))
        profile = [tuple(sorted((rng.randint(0, 8) for _ in range(chunks)), reverse=True)) for _ in range(rows)]
        low = [rng.randint(0, 1) for _ in range(chunks)]
        pinned = [(0.0, rng.uniform(0, 3), rng.uniform(0, 1))] + [(0.0, 0.0, 0.0)] * (chunks - 1)
        args = (decoder, list(range(chunks)), profile, rng.uniform(20, 160), pinned, low)
        fast, general = RankProblem(*args), RankProblem(*args)
        general.monotone = False
        assert fast.monotone
        high = tuple(rng.randint(lo, lo + 5) for lo in low)
        feasible = [sum(c) for c in itertools.product(*(range(lo, h + 1) for lo, h in zip(low, high)))
                    if fast.fits(c)]
        assert fast.largest(high) == general.largest(high) == (max(feasible) if feasible else None)
        if feasible and len(high) <= 6:
            for total in range(sum(low), max(feasible) + 1):
                assert fast.counts(high, total) == general.counts(high, total)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=1, max_size=12), st.lists(st.integers(0, 50), min_size=1, max_size=12),
       st.lists(st.integers(1, 8), min_size=1, max_size=6))
def test_memory_reach_without_a_limit_reaches_the_end(static, act, in_flight):
    """With no memory limit every stage may run to the last entry: the shortcut for infinite caps gives what the
    search over sums gives for a cap above every sum."""
    import numpy as np

    from megapipe.partition.memory import memory_reach

    size = min(len(static), len(act))
    static_prefix = np.concatenate([[0.0], np.cumsum(static[:size], dtype=float)])
    act_prefix = np.concatenate([[0.0], np.cumsum(act[:size], dtype=float)])
    free = memory_reach(static_prefix=static_prefix, act_prefix=act_prefix, in_flight=in_flight,
                        caps=[math.inf] * len(in_flight))
    above = memory_reach(static_prefix=static_prefix, act_prefix=act_prefix, in_flight=in_flight,
                         caps=[float(static_prefix[-1] + max(in_flight) * act_prefix[-1] + 1)] * len(in_flight))
    assert free.dtype == above.dtype and (free == above).all() and (free == size).all()


@settings(max_examples=150, deadline=None)
@given(st.sampled_from([(2, 2, 4), (4, 2, 8), (4, 4, 12), (8, 2, 16)]), st.data())
def test_ranks_fit_agrees_with_the_ranks_peaks(sizes, data):
    """The early-stopping fit test answers what comparing every rank's peak (:func:`rank_peaks`) with its cap does,
    caps placed exactly at a rank's peak included (the float the solver's fit turns on)."""
    from megapipe.partition.coupled import rank_peaks, ranks_fit
    from megapipe.partition.memory import stage_ranks
    from megapipe.schedules import rank_in_flight_profiles

    pp, vp, microbatches = sizes
    profiles = rank_in_flight_profiles("interleaved_1f1b", pipeline_model_parallel_size=pp, num_microbatches=microbatches,
                                       virtual_pipeline_model_parallel_size=vp)
    ranks = stage_ranks(schedule="interleaved_1f1b", pipeline_model_parallel_size=pp, num_stages=pp * vp)
    amounts = st.floats(0.0, 1e10, allow_nan=False)
    static = data.draw(st.lists(amounts, min_size=pp * vp, max_size=pp * vp))
    act = data.draw(st.lists(amounts, min_size=pp * vp, max_size=pp * vp))
    peaks = rank_peaks(static=static, act=act, ranks=ranks, profiles=profiles)
    where = data.draw(st.lists(st.sampled_from(["below", "at", "above"]), min_size=pp, max_size=pp))
    caps = [math.nextafter(peak, -math.inf) if at == "below" else peak if at == "at" else peak + 1e9
            for peak, at in zip(peaks, where)]
    assert ranks_fit(static=static, act=act, ranks=ranks, profiles=profiles, caps=caps) == ("below" not in where)
    assert ranks_fit(static=static, act=act, ranks=ranks, profiles=profiles, caps=caps) == all(
        peak <= cap for peak, cap in zip(peaks, caps))
