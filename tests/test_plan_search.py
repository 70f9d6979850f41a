"""The planner on the real cost model, solver, schedules and simulator."""

from __future__ import annotations

import dataclasses

import pytest

from megapipe.errors import ConfigError, InfeasibleError
from megapipe.plan.evaluator import Evaluator
from megapipe.placement import placements
from megapipe.plan.rank import rank_plans
from megapipe.options import SearchOptions
from megapipe.plan.search import search
from megapipe.plan.space import enumerate_candidates
from megapipe.records import ClusterSpec, GpuSpec, LinkSpec, ModelSpec, NodeGroup, TrainSpec

H100 = GpuSpec(name="h100", bf16_tflops=989.0, hbm_gbytes_per_s=3350.0, memory_gib=80.0)
A100 = GpuSpec(name="a100", bf16_tflops=312.0, hbm_gbytes_per_s=2039.0, memory_gib=80.0, matmul_efficiency=0.8)
NVLINK = LinkSpec(kind="nvlink", bandwidth_gbytes_per_s=450.0, latency_us=3.0)
IB = LinkSpec(kind="infiniband", bandwidth_gbytes_per_s=50.0, latency_us=5.0)
SMALL = ModelSpec(name="small", num_layers=12, hidden_size=2048, num_attention_heads=16, num_query_groups=4,
                  ffn_hidden_size=5632, vocab_size=32000, seq_length=4096)
TRAIN = TrainSpec(global_batch_size=32, seq_length=4096)


def cluster(num_nodes: int = 2, gpus_per_node: int = 4, gpu: GpuSpec = H100, groups=None) -> ClusterSpec:
    return ClusterSpec(name="c", gpus_per_node=gpus_per_node, price_per_gpu_hour=2.0, intra_node=NVLINK,
                       inter_node=IB, node_groups=groups or (NodeGroup(gpu=gpu, num_nodes=num_nodes),))


OPTIONS = SearchOptions(micro_batch_sizes=(1, 2, 4), max_virtual_pipeline_model_parallel_size=3, what_if_schedules=True)


@pytest.fixture(scope="module")
def brute():
    """Every candidate of the small space evaluated exactly (no bounds)."""
    c = cluster()
    ev = Evaluator(model=SMALL, cluster=c, options=OPTIONS)
    space = enumerate_candidates(model=SMALL, cluster=c, train=TRAIN, options=OPTIONS)
    plans, bounds = [], []
    for cand in space.candidates:
        try:
            plan = ev.evaluate(cand)
        except InfeasibleError:
            continue
        plans.append(plan)
        bounds.append(ev.bounds.bound(cand))
    return plans, bounds


def test_bounds_never_exceed_exact(brute):
    """Branch and bound is exact only if every bound is a true lower bound."""
    plans, bounds = brute
    assert len(plans) > 50
    for plan, bound in zip(plans, bounds):
        assert bound.step_ms <= plan.step_time_s * 1e3 * (1 + 1e-9), (plan.key, bound.step_ms, plan.step_time_s)
        assert bound.memory_bytes <= max(s.total_bytes for s in plan.stages) * (1 + 1e-9), plan.key


def test_search_equals_brute_force(brute):
    plans, _ = brute
    expected = rank_plans(plans, objective="throughput", top_k=5)
    result = search(model=SMALL, cluster=cluster(), train=TRAIN, options=OPTIONS)
    assert [p.key for p in result.plans] == [p.key for p in expected]
    assert result.stats.simulated < len(plans)
    assert dict(result.stats.pruned).get("bound", 0) > 0


def test_plan_metrics_are_consistent():
    result = search(model=SMALL, cluster=cluster(), train=TRAIN, options=OPTIONS)
    best = result.best
    tokens = TRAIN.global_batch_size * TRAIN.seq_length
    assert best.tokens_per_s == pytest.approx(tokens / best.step_time_s)
    assert best.tokens_per_s_per_gpu == pytest.approx(best.tokens_per_s / 8)
    assert best.step_time_s == pytest.approx((best.pipeline_ms + best.dp_sync_ms + best.optimizer_ms) / 1e3)
    assert 0 < best.mfu < 1
    assert best.cost_per_million_tokens == pytest.approx(1e6 / best.tokens_per_s * 8 * 2.0 / 3600)
    assert best.parallel.world_size == 8
    assert sum(best.decoder_layers_per_stage) == SMALL.num_layers
    for stage in best.stages:
        assert stage.total_bytes == pytest.approx(stage.static_bytes + stage.activation_bytes)
        assert stage.total_bytes <= H100.usable_memory_bytes
    # the equal split of the best configuration can never beat the optimal split
    assert result.baseline is not None and result.baseline.method == "equal"
    assert result.baseline.key == best.key
    assert result.baseline.pipeline_ms >= best.pipeline_ms * (1 - 1e-9)


def test_everything_fixed_evaluates_one_candidate():
    fixed = {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2, "context_parallel_size": 1,
             "virtual_pipeline_model_parallel_size": 1, "sequence_parallel": True, "micro_batch_size": 1,
             "recompute_granularity": "none", "schedule": "1f1b"}
    result = search(model=SMALL, cluster=cluster(), train=TRAIN, fixed=fixed, options=OPTIONS)
    assert result.stats.enumerated == 1 and result.stats.simulated == 1
    assert len(result.plans) == 1 and result.best.parallel.data_parallel_size == 2


def test_no_feasible_plan_says_what_fits():
    tiny = dataclasses.replace(H100, memory_gib=0.5)
    with pytest.raises(InfeasibleError, match="more GPUs, recompute_granularity=full, or a smaller micro_batch_size"):
        search(model=SMALL, cluster=cluster(gpu=tiny), train=TRAIN, options=OPTIONS)


def test_zero_memory_cluster_is_a_config_error():
    broken = dataclasses.replace(H100, memory_gib=0.0)
    with pytest.raises(ConfigError, match="memory_gib=0.0"):
        search(model=SMALL, cluster=cluster(gpu=broken), train=TRAIN, options=OPTIONS)


def test_ignore_memory_limit_flags_the_gib_over():
    tight = dataclasses.replace(H100, memory_gib=2.0)
    options = dataclasses.replace(OPTIONS, ignore_memory_limit=True)
    fixed = {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1, "schedule": "1f1b",
             "micro_batch_size": 4, "recompute_granularity": "none"}
    result = search(model=SMALL, cluster=cluster(gpu=tight), train=TRAIN, fixed=fixed, options=options)
    best = result.best
    assert not best.feasible and best.memory_over_gib > 0
    peak = max(stage.total_bytes for stage in best.stages)
    assert best.memory_over_gib == pytest.approx((peak - tight.usable_memory_bytes) / 2**30)
    assert any("does not fit" in warning for warning in best.warnings)


def test_bubble_target_picks_micro_batch_size():
    fixed = {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 4, "schedule": "1f1b",
             "recompute_granularity": "full", "sequence_parallel": False}
    free = search(model=SMALL, cluster=cluster(), train=TRAIN, fixed=fixed,
                  options=dataclasses.replace(OPTIONS, top_k=10))
    by_bubble = sorted(free.plans, key=lambda plan: plan.bubble_fraction)
    assert len(by_bubble) == 3 and by_bubble[0].bubble_fraction < by_bubble[1].bubble_fraction
    low = by_bubble[0].bubble_fraction
    options = dataclasses.replace(OPTIONS, bubble_target=(0.0, low + 1e-6), top_k=10)
    result = search(model=SMALL, cluster=cluster(), train=TRAIN, fixed=fixed, options=options)
    assert len(result.plans) == 1  # one layout: its micro-batch sizes compete on the bubble
    assert result.best.train.micro_batch_size == by_bubble[0].train.micro_batch_size
    high = by_bubble[-1].bubble_fraction
    options = dataclasses.replace(OPTIONS, bubble_target=(high - 1e-6, 1.0), top_k=10)
    result = search(model=SMALL, cluster=cluster(), train=TRAIN, fixed=fixed, options=options)
    assert result.best.train.micro_batch_size == by_bubble[-1].train.micro_batch_size


def test_mixed_cluster_places_gpu_types_and_beats_equal_split():
    groups = (NodeGroup(gpu=H100, num_nodes=1), NodeGroup(gpu=A100, num_nodes=1))
    mixed = cluster(groups=groups)
    fixed = {"tensor_model_parallel_size": 4, "pipeline_model_parallel_size": 2, "schedule": "1f1b",
             "micro_batch_size": 1, "recompute_granularity": "none", "sequence_parallel": True}
    result = search(model=SMALL, cluster=mixed, train=TRAIN, fixed=fixed, options=OPTIONS)
    best = result.best
    assert sorted(best.stage_gpus) == ["a100", "h100"]
    assert result.hetero_gain is not None and result.hetero_gain > 0.05
    counts = dict(zip(best.stage_gpus, best.decoder_layers_per_stage))
    assert counts["h100"] > counts["a100"]  # the faster GPU gets more layers
    par = best.parallel
    assert len(placements(mixed, par)) == 2
    assert placements(mixed, dataclasses.replace(par, pipeline_model_parallel_size=1, data_parallel_size=2)) == ()


def test_default_search_ranks_what_megatron_runs_equal_to_brute_force(brute):
    """Without search.what_if_schedules only 1f1b and interleaved_1f1b are ranked, exactly as brute force ranks them."""
    plans, _ = brute
    runnable = [plan for plan in plans if plan.schedule in ("1f1b", "interleaved_1f1b")]
    expected = rank_plans(runnable, objective="throughput", top_k=5)
    options = dataclasses.replace(OPTIONS, what_if_schedules=False)
    result = search(model=SMALL, cluster=cluster(), train=TRAIN, options=options)
    assert [p.key for p in result.plans] == [p.key for p in expected]
    assert not any(plan.what_if for plan in result.plans) and result.best is result.plans[0]
    pinned = search(model=SMALL, cluster=cluster(), train=TRAIN, options=options,
                    fixed={"schedule": "zb_h1", "pipeline_model_parallel_size": 2})
    assert all(plan.what_if for plan in pinned.plans)


def test_what_if_plans_never_become_the_plan_to_run(brute):
    """With what-if schedules searched, the plan to run is still the best one megatron-core runs."""
    plans, _ = brute
    pipelined = [plan for plan in plans if plan.parallel.pipeline_model_parallel_size == 4]
    runnable = rank_plans([plan for plan in pipelined if not plan.what_if], objective="throughput", top_k=1)[0]
    result = search(model=SMALL, cluster=cluster(), train=TRAIN, fixed={"pipeline_model_parallel_size": 4},
                    options=dataclasses.replace(OPTIONS, what_if_schedules=True, top_k=2))
    assert all(plan.what_if for plan in result.plans)  # at PP=4 zero-bubble schedules rank first
    assert not result.best.what_if and result.best.key == runnable.key


@pytest.mark.parametrize("schedule", ["zb_h1", "zb_v"])
def test_plans_carry_megatron_schedule_warnings(schedule):
    """Every ranked plan (and so the JSON and plan.yaml) says Megatron will not run the schedule as planned."""
    from megapipe.plan.document import json_summary, plan_document

    result = search(model=SMALL, cluster=cluster(), train=TRAIN, options=OPTIONS,
                    fixed={"schedule": schedule, "pipeline_model_parallel_size": 2})
    runs = "interleaved 1F1B" if schedule == "zb_v" else "1F1B"
    for plan in result.plans:
        assert plan.what_if
        assert any(f"what-if: megatron-core has no {schedule} schedule" in w and f"with {runs}" in w
                   for w in plan.warnings)
        assert any("V-shaped placement" in w for w in plan.warnings) == (schedule == "zb_v")
    document = plan_document(result=result, model=SMALL, cluster=cluster(), inputs={})
    for plan in [document["best"], *document["plans"], *json_summary(result)["plans"]]:
        assert any(f"no {schedule} schedule" in w for w in plan["warnings"])


def _signature(result):
    """What a search answers: every ranked plan, the chosen one, the equal-split baseline and the reference."""
    if result is None:
        return None

    def plan(item):
        return None if item is None else (item.parallel, item.train, item.schedule, item.step_time_s,
                                          item.layout, item.method, item.memory_spread, item.memory_over_gib)

    return [plan(item) for item in result.plans], plan(result.chosen), plan(result.baseline), plan(result.reference)


@pytest.mark.parametrize("overrides", [
    ["model=mixtral_8x7b", "cluster.num_nodes=8", "train.global_batch_size=512", "train.seq_length=4096",
     "search.max_virtual_pipeline_model_parallel_size=4", "search.top_k=1"],
    ["model=llama3_8b", "cluster.num_nodes=2", "train.global_batch_size=128", "train.seq_length=4096",
     "search.top_k=3", "search.max_pipeline_model_parallel_size=4"],
])
def test_search_by_depth_equals_a_search_per_fixed_depth(overrides):
    """pack's curves take the fixed-depth baseline's points from one search: the whole search's answer and each
    depth's plans and chosen plan are those of the search run alone with that depth fixed (a depth over the whole
    search's limit, 8 in the second case, is searched alone; a depth with no plan is None in both). A depth's
    equal-split baseline is left out only where it is no faster than the chosen plan."""
    from megapipe.config import compose, to_scenario
    from megapipe.config.options import search_options
    from megapipe.errors import MegapipeError
    from megapipe.plan.search import search_by_depth
    from megapipe.plan.unit_costs import SharedCosts

    cfg = compose(overrides)
    scenario = to_scenario(cfg, search=True)
    inputs = dict(model=scenario.model, cluster=scenario.cluster, train=scenario.train, fixed=scenario.fixed,
                  options=search_options(cfg))
    depths = (1, 2, 4, 8, 16)
    found = search_by_depth(depths=depths, shared=SharedCosts(), **inputs)
    assert _signature(found[None]) == _signature(search(**inputs))
    answered = 0
    for depth in depths:
        try:
            alone = search(**{**inputs, "fixed": {**scenario.fixed, "pipeline_model_parallel_size": depth}})
        except MegapipeError:
            alone = None
        mine, theirs = _signature(found[depth]), _signature(alone)
        if alone is None:
            assert mine is None, depth
        else:  # the same plans and chosen plan; the equal split only where it could have beaten the chosen one
            assert mine[:2] == theirs[:2] and mine[3] == theirs[3], depth
            assert mine[2] in (None, theirs[2]), depth
            assert mine[2] is not None or theirs[2] is None or theirs[2][3] >= theirs[1][3], depth
        answered += alone is not None
        if alone is not None:
            assert found[depth].best.parallel.pipeline_model_parallel_size == depth
    assert answered >= 3


def test_a_search_leaves_no_reference_cycles_and_the_collector_as_it_was():
    """Searches pause Python's cycle collector (plan/search.py: _no_cycle_collection): that is safe only while they
    drop no reference cycles, which the collector then finds none of; and it runs again afterwards (or stays off,
    when the caller had turned it off)."""
    import gc

    from megapipe.plan.search import search_by_depth

    inputs = dict(model=SMALL, cluster=cluster(), train=TRAIN, options=OPTIONS)
    gc.collect()
    assert gc.isenabled()
    try:
        gc.disable()
        search(**inputs)
        search_by_depth(depths=(1, 2, 4), **inputs)
        assert not gc.isenabled()
        assert gc.collect() == 0
    finally:
        gc.enable()
    search(**inputs)
    assert gc.isenabled()
