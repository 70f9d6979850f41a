"""The search's closed-form prunes against the exact solver and simulator they stand in for."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megapipe import schedules
from megapipe.errors import InfeasibleError
from megapipe.partition.coupled import uniform_fits
from megapipe.partition.coupled import uniform_shape as layer_shape
from megapipe.plan.bounds import pipeline_floor_ms, split_can_fit
from megapipe.plan.evaluator import Evaluator
from megapipe.options import SearchOptions
from megapipe.plan.space import enumerate_candidates
from megapipe.records import ClusterSpec, GpuSpec, LayerCost, LayerKind, LinkSpec, ModelSpec, NodeGroup, TrainSpec
from megapipe.simulate import StageTimes, simulate

NVLINK = LinkSpec(kind="nvlink", bandwidth_gbytes_per_s=450.0, latency_us=3.0)
IB = LinkSpec(kind="infiniband", bandwidth_gbytes_per_s=50.0, latency_us=5.0)
MODEL = ModelSpec(name="m", num_layers=16, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
                  ffn_hidden_size=14336, vocab_size=128256, seq_length=4096)
TRAIN = TrainSpec(global_batch_size=64, seq_length=4096)


def _cluster(memory_gib: float) -> ClusterSpec:
    gpu = GpuSpec(name="g", bf16_tflops=989.0, hbm_gbytes_per_s=3350.0, memory_gib=memory_gib)
    return ClusterSpec(name="c", gpus_per_node=8, price_per_gpu_hour=2.0, intra_node=NVLINK, inter_node=IB,
                       node_groups=(NodeGroup(gpu=gpu, num_nodes=2),))


@pytest.mark.parametrize("memory_gib", [12.0, 20.0, 40.0])
def test_split_can_fit_equals_the_solver(memory_gib):
    """Every candidate, every schedule: with one stage per rank the closed form says no exactly when the solver
    finds no split; with several (interleaved, V) it never says no to a split that fits, and the exact coupled
    check (partition.coupled.uniform_fits) agrees with the solver."""
    cluster = _cluster(memory_gib)
    options = SearchOptions(micro_batch_sizes=(1, 2, 4), max_virtual_pipeline_model_parallel_size=4)
    ev = Evaluator(model=MODEL, cluster=cluster, options=options)
    space = enumerate_candidates(model=MODEL, cluster=cluster, train=TRAIN, options=options)
    verdicts, coupled = [], 0
    for cand in space.candidates:
        try:
            ev.partition(cand)
            fits = True
        except InfeasibleError:
            fits = False
        par = cand.parallel
        pp = par.pipeline_model_parallel_size
        ranks = schedules.spec(cand.schedule).stage_to_rank(
            pipeline_model_parallel_size=pp, num_stages=pp * schedules.chunks_per_rank(
                cand.schedule, par.virtual_pipeline_model_parallel_size))
        if len(ranks) == pp:
            assert ev.bounds.split_can_fit(cand) == fits, (cand.schedule, cand.parallel, cand.train)
        else:
            coupled += 1
            assert ev.bounds.split_can_fit(cand) or not fits, (cand.schedule, cand.parallel, cand.train)
            profiles = schedules.rank_in_flight_profiles(
                cand.schedule, pipeline_model_parallel_size=pp, num_microbatches=cand.num_microbatches,
                virtual_pipeline_model_parallel_size=par.virtual_pipeline_model_parallel_size)
            exact = uniform_fits(shape=layer_shape(ev.costs.bound_layers(cand)), stages=ev.costs.stage_specs(cand),
                                 ranks=ranks, profiles=profiles)
            assert exact == fits, (cand.schedule, cand.parallel, cand.train)
        verdicts.append(fits)
    assert 0 < sum(verdicts) < len(verdicts) and coupled


def test_split_can_fit_abstains_on_unequal_decoders():
    unit = LayerCost(name="d", kind=LayerKind.decoder, fwd_ms=1.0, bwd_ms=2.0, wgrad_ms=1.0, static_bytes=10.0, act_bytes=5.0)
    other = dataclasses.replace(unit, act_bytes=6.0)
    assert layer_shape([unit, other]) is None
    shape = layer_shape([unit] * 4)
    assert shape is not None and shape.head is None and shape.num_decoders == 4
    # Two stages with one in flight: each holds at most floor(31 / 15) = 2 decoders; four fit, five do not.
    assert split_can_fit(shape=shape, caps=(31.0, 31.0), in_flight=(1, 1))
    assert not split_can_fit(shape=dataclasses.replace(shape, num_decoders=5), caps=(31.0, 31.0), in_flight=(1, 1))
    assert not split_can_fit(shape=shape, caps=(100.0, 14.0), in_flight=(1, 1))  # second stage cannot hold one


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(schedules.SCHEDULE_NAMES),
    pp=st.integers(2, 5),
    m_factor=st.integers(1, 3),
    data=st.data(),
)
def test_pipeline_floor_never_exceeds_the_simulation(name, pp, m_factor, data):
    vp = {"interleaved_1f1b": data.draw(st.integers(2, 3)), "zb_v": 2, "dualpipe_v": 2}.get(name, 1)
    m = 2 * pp * m_factor
    schedule = schedules.build(name, pipeline_model_parallel_size=pp, num_microbatches=m,
                               virtual_pipeline_model_parallel_size=vp)
    stages = schedule.num_stages
    times = st.floats(0.1, 10.0, allow_nan=False)
    fwd = data.draw(st.lists(times, min_size=stages, max_size=stages))
    bwd = data.draw(st.lists(times, min_size=stages, max_size=stages))
    wgrad = [b * data.draw(st.floats(0.0, 1.0)) for b in bwd]
    result = simulate(schedule, StageTimes(fwd_ms=tuple(fwd), bwd_ms=tuple(bwd), wgrad_ms=tuple(wgrad)))
    floor = pipeline_floor_ms(schedule=name, stage_to_rank=schedule.stage_to_rank, fwd_ms=fwd, bwd_ms=bwd,
                              num_microbatches=m)
    assert floor <= result.step_time_ms * (1 + 1e-9)
    assert floor >= max(m * sum(f + b for f, b, r in zip(fwd, bwd, schedule.stage_to_rank) if r == rank)
                        for rank in range(pp)) * (1 - 1e-9)


def test_bound_layers_hold_the_profiles_numbers():
    """The one-layer unit costs, repeated, and the evaluator's profiles (both built from the shared unit costs)
    equal the cost model's own profile of each candidate (:func:`megapipe.cost.layer_costs`), entry by entry: a
    dense model with MTP, and a MoE model's feature sets."""
    from megapipe import cost
    from megapipe.config import compose, to_scenario
    from megapipe.config.options import search_options

    cluster = _cluster(80.0)
    options = SearchOptions(micro_batch_sizes=(1, 2), max_virtual_pipeline_model_parallel_size=2)
    model = dataclasses.replace(MODEL, mtp_num_layers=1)
    cases = [(model, cluster, options, enumerate_candidates(model=model, cluster=cluster, train=TRAIN,
                                                            options=options).candidates)]
    cfg = compose(["model=deepseek_v3", "cluster.num_nodes=32", "train.global_batch_size=1024"])
    scenario = to_scenario(cfg, search=True)
    moe_options = search_options(cfg)
    space = enumerate_candidates(model=scenario.model, cluster=scenario.cluster, train=scenario.train,
                                 fixed=scenario.fixed, options=moe_options)
    cases.append((scenario.model, scenario.cluster, moe_options,
                  [space.candidate(point) for point in space.points[::max(1, len(space.points) // 150)]]))
    for model, cluster, options, cands in cases:
        evaluator, seen = Evaluator(model=model, cluster=cluster, options=options), set()
        for cand in cands:
            key = cand.layer_key + (cand.parallel.data_parallel_size,)
            if key in seen:
                continue
            seen.add(key)
            expected = cost.layer_costs(model=model, gpu=cluster.gpu, cluster=cluster, parallel=cand.parallel,
                                        train=cand.train)
            units = Evaluator(model=model, cluster=cluster, options=options).costs.bound_layers(cand)
            assert evaluator.costs.profile(cand) == expected
            assert [dataclasses.replace(u, name="") for u in units] == [dataclasses.replace(f, name="")
                                                                        for f in expected.layers]
        assert len(seen) > 20


def test_bound_classes_share_bounds():
    """Schedules of one spec bound_class, at any virtual size, get the same bounds: the search bounds each class once."""
    from megapipe.schedules import spec

    cluster = _cluster(80.0)
    options = SearchOptions(micro_batch_sizes=(1, 2), max_virtual_pipeline_model_parallel_size=4,
                            per_stage_recompute=True)
    model = dataclasses.replace(MODEL, mtp_num_layers=1)
    space = enumerate_candidates(model=model, cluster=cluster, train=TRAIN, options=options)
    evaluator = Evaluator(model=model, cluster=cluster, options=options)
    seen: dict[tuple, object] = {}
    shared = 0
    for cand in space.candidates:
        # a fresh evaluator per candidate: no cached term can carry one schedule's value to another
        bound = Evaluator(model=model, cluster=cluster, options=options).bounds.bound(cand)
        assert evaluator.bounds.bound(cand) == bound
        assert evaluator.bounds.memory_bound_of(cand) == bound.memory_bytes
        key = cand.layer_key + (cand.parallel.data_parallel_size, spec(cand.schedule).bound_class, cand.per_stage_recompute)
        if key in seen:
            assert seen[key] == bound, (cand, key)
            shared += 1
        seen[key] = bound
    assert shared > 50


def test_every_point_pruned_for_memory_is_over_its_own_memory_bound():
    """The search decides memory once per group of points that hold the same bytes: a MoE model's points that differ
    in expert tensor parallelism or in a feature its bytes read (forced balance, recompute modules) are decided
    apart, so no point is pruned on another point's verdict. Every point is ordered by a cheap bound no greater than
    its full one."""
    from collections import Counter

    from megapipe.config import compose, to_scenario
    from megapipe.config.options import search_options
    from megapipe.plan import search as planner
    from megapipe.plan.dominance import surviving_points

    cfg = compose(["model=qwen3_30b_a3b", "cluster.num_nodes=2", "train.global_batch_size=64"])
    scenario = to_scenario(cfg, search=True)
    options = search_options(cfg)
    evaluator = Evaluator(model=scenario.model, cluster=scenario.cluster, options=options)
    space = enumerate_candidates(model=scenario.model, cluster=scenario.cluster, train=scenario.train,
                                 fixed=scenario.fixed, options=options)
    bounded, bounds = planner._bound_all(evaluator, space, Counter())
    dominated = set(range(len(space.points))) - set(surviving_points(evaluator.costs, space))
    members = [(cheap, index, point) for cheap, _, family in bounded for index, point in family]
    assert sorted(index for _, index, _ in members) == sorted(set(range(len(space.points))) - dominated)
    assert dominated and any(len(family) > 1 for _, _, family in bounded)
    assert {point.expert_tensor_parallel_size for point in space.points} != {1}  # ETP is searched here
    cap = scenario.cluster.gpu.usable_memory_bytes
    fresh = Evaluator(model=scenario.model, cluster=scenario.cluster, options=options)
    # a family (points that differ only in VP) is decided on its first point: every member's own bounds agree
    verdicts = [bounds.fits(family[0][1]) for _, _, family in bounded for _ in family]
    assert verdicts == [fresh.bounds.memory_bound_of(space.candidate(point)) <= cap for _, _, point in members]
    assert any(verdicts) and not all(verdicts)
    for cheap, _, point in members[::7]:
        assert cheap == fresh.bounds.pipeline_bound(space.candidate(point))  # per layer key, as per point
        assert cheap <= bounds.step(point) == fresh.bounds.bound(space.candidate(point)).step_ms


def _evaluator_and_space(overrides):
    """An evaluator and the enumerated space of the scenario the overrides compose."""
    from megapipe.config import compose, to_scenario
    from megapipe.config.options import search_options

    cfg = compose(overrides)
    scenario = to_scenario(cfg, search=True)
    options = search_options(cfg)
    evaluator = Evaluator(model=scenario.model, cluster=scenario.cluster, options=options)
    return evaluator, enumerate_candidates(model=scenario.model, cluster=scenario.cluster, train=scenario.train,
                                           fixed=scenario.fixed, options=options)


@pytest.mark.parametrize("overrides", [
    [],
    ["model=llama3_8b", "cluster.num_nodes=2", "train.global_batch_size=128"],
    ["model=llama3_70b", "cluster.num_nodes=4", "train.global_batch_size=64", "train.seq_length=4096",
     "search.what_if_schedules=true"],
    ["model=deepseek_v3", "cluster.num_nodes=64", "train.global_batch_size=4096", "search.what_if_schedules=true"],
])
def test_memory_floor_never_exceeds_a_partition_floor(overrides):
    """The memory floor (each rank's decoder capacity under its memory, water-filled) is a lower bound on the
    partition floor of every split the solver finds, on every schedule, and sharper than the closed-form bound
    where memory forces an uneven split; where it says no split fits, the solver finds none."""
    import random

    from megapipe.errors import MegapipeError

    evaluator, space = _evaluator_and_space(overrides)
    applied = sharper = 0
    for point in random.Random(0).sample(space.points, 150):
        cand = space.candidate(point)
        floor = evaluator.bounds.memory_floor_ms(cand)
        if floor is None:
            continue
        applied += 1
        if floor == float("inf"):
            with pytest.raises(MegapipeError):
                evaluator.prepare(cand)
            continue
        try:
            prepared = evaluator.prepare(cand)
        except MegapipeError:
            continue
        assert floor <= prepared.floor_ms * (1 + 1e-9), (point, floor, prepared.floor_ms)
        sharper += floor > evaluator.bounds.bound(cand).step_ms * (1 + 1e-6)
    assert applied >= 100 and sharper >= 1


def test_capped_level_is_the_least_level_that_holds_every_layer():
    """The water level with per-rank caps, solved at the corners, equals bisection on the held-layers sum."""
    import random

    import numpy as np

    from megapipe.plan.candidate_bounds import _capped_level

    rng = random.Random(3)
    for _ in range(300):
        ranks = rng.randint(1, 8)
        pinned = np.array([rng.choice([0.0, rng.uniform(0, 5)]) for _ in range(ranks)])
        fewest = np.array([float(rng.randint(0, 2)) for _ in range(ranks)])
        largest = fewest + np.array([float(rng.randint(0, 12)) for _ in range(ranks)])
        layers = rng.randint(1, 40)
        per_layer = rng.uniform(0.5, 3.0)
        level = _capped_level(pinned, per_layer, fewest, largest, layers)
        if largest.sum() < layers:
            assert level is None
            continue

        def held(value):
            return np.clip((value - pinned) / per_layer, fewest, largest).sum()

        low, high = float((pinned + fewest * per_layer).max()), float((pinned + largest * per_layer).max())
        if held(low) < layers:
            for _ in range(200):
                middle = (low + high) / 2
                low, high = (low, middle) if held(middle) >= layers else (middle, high)
            low = high
        assert level == pytest.approx(low, rel=1e-9, abs=1e-9)
        assert held(level * (1 + 1e-9) + 1e-12) >= layers - 1e-6


@pytest.mark.parametrize("overrides", [
    [],
    ["model=llama3_8b", "cluster.num_nodes=2", "train.global_batch_size=128"],
    ["model=qwen3_30b_a3b", "cluster.num_nodes=4", "train.global_batch_size=256", "search.what_if_schedules=true"],
    ["model=llama3_70b", "cluster.num_nodes=8", "train.global_batch_size=128"],
    ["model=deepseek_v3", "cluster.num_nodes=64", "train.global_batch_size=4096"],
])
def test_a_split_known_without_solving_is_the_solvers_and_its_floor_the_partitions(overrides):
    """Where the solver's split is known without solving (partition.free_split: layout stages coupled on ranks, no
    MTP layers, the split of least bottleneck without memory limits fits), it is the split the solver returns, and
    Evaluator.split_floor_ms is the very floor Evaluator.prepare gives; elsewhere (one stage per rank, MTP layers,
    a free split that overfills a rank) it answers None."""
    import random

    from megapipe import partition
    from megapipe.errors import MegapipeError

    evaluator, space = _evaluator_and_space(overrides)
    known = unknown = 0
    for point in random.Random(1).sample(space.points, min(200, len(space.points))):
        cand = space.candidate(point)
        par = cand.parallel
        floor = evaluator.split_floor_ms(cand)
        try:
            prepared = evaluator.prepare(cand)
        except MegapipeError:
            assert floor is None or cand.per_stage_recompute, point
            continue
        if floor is None:
            unknown += 1
            continue
        known += 1
        split = partition.free_split(
            evaluator.costs.profile(cand), list(evaluator.costs.stage_specs(cand)), num_microbatches=cand.num_microbatches,
            schedule=cand.schedule, virtual_pipeline_model_parallel_size=par.virtual_pipeline_model_parallel_size,
            microbatch_group_size_per_vp_stage=par.microbatch_group_size_per_vp_stage)
        assert split == (prepared.partition.entries_per_stage, prepared.partition.stage_to_rank), point
        assert floor == prepared.floor_ms, point
    mtp = any(layer.kind == LayerKind.mtp for layer in evaluator.costs.profile(space.candidate(space.points[0])).layers)
    assert unknown and (known or mtp), (known, unknown)
