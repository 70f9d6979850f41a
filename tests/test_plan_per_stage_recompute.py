"""Per-stage recompute: the exact split with one option per stage, against brute force and uniform settings."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from megapipe.partition.options import split_with_options
from megapipe.records import LayerCost, LayerKind, StageSpec


def _brute(options, stages, in_flight):
    n, best = len(options[0]), None
    for cuts in itertools.combinations(range(1, n), len(stages) - 1):
        bounds = (0, *cuts, n)
        worst = 0.0
        for j, spec in enumerate(stages):
            a, b = bounds[j], bounds[j + 1]
            fitting = [spec.time_scale * sum(e.fwd_ms + e.bwd_ms for e in layers[a:b]) for layers in options
                       if sum(e.static_bytes for e in layers[a:b]) + in_flight[j] * sum(e.act_bytes for e in layers[a:b])
                       <= spec.memory_bytes]
            if not fitting:
                worst = None
                break
            worst = max(worst, min(fitting))
        if worst is not None and (best is None or worst < best):
            best = worst
    return best


def _layer(fwd, bwd, static, act):
    return LayerCost(name="d", kind=LayerKind.decoder, fwd_ms=fwd, bwd_ms=bwd, wgrad_ms=0.0, static_bytes=static,
                     act_bytes=act)


@settings(max_examples=150, deadline=None)
@given(data=st.data(), n=st.integers(2, 7), num_stages=st.integers(1, 3), num_options=st.integers(1, 3))
def test_split_with_options_equals_brute_force(data, n, num_stages, num_options):
    if num_stages > n:
        num_stages = n
    small = st.integers(1, 9)
    base = [(data.draw(small), data.draw(small), data.draw(small), data.draw(small)) for _ in range(n)]
    options = []
    for level in range(num_options):  # more recompute: slower backward, fewer activation bytes
        options.append([_layer(f, b + level * f, s, max(a - 3 * level, 0)) for f, b, s, a in base])
    stages = [StageSpec(time_scale=data.draw(st.sampled_from([1.0, 1.5])), memory_bytes=data.draw(st.integers(5, 60)))
              for _ in range(num_stages)]
    in_flight = [num_stages - j for j in range(num_stages)]
    found = split_with_options(options=options, stages=stages, in_flight=in_flight)
    expected = _brute(options, stages, in_flight)
    if expected is None:
        assert found is None
        return
    assert found is not None and found.bottleneck_ms == expected
    assert len(found.bounds) == num_stages + 1 and found.bounds[0] == 0 and found.bounds[-1] == n
    for j, choice in enumerate(found.choices):  # the reported choice really fits its stage
        layers = options[choice][found.bounds[j]:found.bounds[j + 1]]
        assert layers and sum(e.static_bytes for e in layers) + in_flight[j] * sum(e.act_bytes for e in layers) \
            <= stages[j].memory_bytes


def test_per_stage_recompute_beats_every_uniform_setting():
    """Memory is tight on the first 1F1B stage (P microbatches in flight): recomputing only there
    lets the split balance, which no single recompute setting for all stages matches."""
    from megapipe.options import SearchOptions
    from megapipe.plan.search import search
    from megapipe.records import ClusterSpec, GpuSpec, LinkSpec, ModelSpec, NodeGroup, TrainSpec

    link = LinkSpec(kind="nvlink", bandwidth_gbytes_per_s=450.0, latency_us=3.0)
    gpu = GpuSpec(name="g", bf16_tflops=989.0, hbm_gbytes_per_s=3350.0, memory_gib=14.0)
    cluster = ClusterSpec(name="c", gpus_per_node=8, price_per_gpu_hour=2.0, intra_node=link, inter_node=link,
                          node_groups=(NodeGroup(gpu=gpu, num_nodes=1),))
    model = ModelSpec(name="m", num_layers=16, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
                      ffn_hidden_size=14336, vocab_size=128256, seq_length=4096)
    train = TrainSpec(global_batch_size=64, seq_length=4096)
    fixed = {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 4, "micro_batch_size": 1,
             "schedule": "1f1b", "sequence_parallel": True}
    uniform = search(model=model, cluster=cluster, train=train, fixed=fixed, options=SearchOptions())
    mixed = search(model=model, cluster=cluster, train=train, fixed=fixed,
                   options=SearchOptions(per_stage_recompute=True))
    best = mixed.best
    assert len(set(best.stage_recompute)) > 1 and best.feasible
    assert best.tokens_per_s > max(plan.tokens_per_s for plan in uniform.plans) * 1.05
    assert best.train.recompute_granularity.value == "full" and any("per-stage recompute" in w for w in best.warnings)
    assert all(stage.total_bytes <= gpu.usable_memory_bytes for stage in best.stages)
    assert best.to_dict()["stage_recompute"] == list(best.stage_recompute)


def test_per_stage_bounds_hold():
    """The bounds and the memory check the search prunes per-stage candidates with, against exact evaluation."""
    from megapipe.errors import InfeasibleError
    from megapipe.plan.evaluator import Evaluator
    from megapipe.options import SearchOptions
    from megapipe.plan.space import enumerate_candidates
    from megapipe.records import ClusterSpec, GpuSpec, LinkSpec, ModelSpec, NodeGroup, TrainSpec

    link = LinkSpec(kind="nvlink", bandwidth_gbytes_per_s=450.0, latency_us=3.0)
    gpu = GpuSpec(name="g", bf16_tflops=989.0, hbm_gbytes_per_s=3350.0, memory_gib=16.0)
    cluster = ClusterSpec(name="c", gpus_per_node=8, price_per_gpu_hour=2.0, intra_node=link, inter_node=link,
                          node_groups=(NodeGroup(gpu=gpu, num_nodes=1),))
    model = ModelSpec(name="m", num_layers=16, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
                      ffn_hidden_size=14336, vocab_size=128256, seq_length=4096)
    options = SearchOptions(per_stage_recompute=True, micro_batch_sizes=(1, 2))
    ev = Evaluator(model=model, cluster=cluster, options=options)
    space = enumerate_candidates(model=model, cluster=cluster, train=TrainSpec(global_batch_size=32, seq_length=4096),
                                 options=options)
    checked = infeasible = 0
    for cand in (c for c in space.candidates if c.per_stage_recompute and c.schedule in ("1f1b", "zb_h1")):
        bound = ev.bounds.bound(cand)
        try:
            plan = ev.evaluate(cand)
        except InfeasibleError:
            infeasible += 1
            continue
        assert ev.bounds.split_can_fit(cand)
        assert bound.step_ms <= plan.step_time_s * 1e3 * (1 + 1e-9)
        assert bound.memory_bytes <= max(stage.total_bytes for stage in plan.stages) * (1 + 1e-9)
        checked += 1
    assert checked > 10 and infeasible > 0
