"""Properties of every plan megapipe ranks first: Megatron runs it, and nothing it shows is faster."""

from __future__ import annotations

import dataclasses

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

from megapipe.emit import emit
from megapipe.errors import InfeasibleError
from megapipe.options import Reference, SearchOptions
from megapipe.plan.search import search
from megapipe.records import ClusterSpec, GpuSpec, LinkSpec, ModelSpec, NodeGroup, TrainSpec
from megapipe.schedules import spec

H100 = GpuSpec(name="h100", bf16_tflops=989.0, hbm_gbytes_per_s=3350.0, memory_gib=80.0, architecture="hopper")
A100 = GpuSpec(name="a100", bf16_tflops=312.0, hbm_gbytes_per_s=2039.0, memory_gib=80.0, architecture="ampere")
NVLINK = LinkSpec(kind="nvlink", bandwidth_gbytes_per_s=450.0, latency_us=3.0)
IB = LinkSpec(kind="infiniband", bandwidth_gbytes_per_s=50.0, latency_us=5.0)


@st.composite
def scenarios(draw):
    heads = draw(st.sampled_from((8, 16, 32)))
    model = ModelSpec(name="m", num_layers=draw(st.integers(4, 40)), hidden_size=heads * 128, num_attention_heads=heads,
                      num_query_groups=draw(st.sampled_from((heads // 8, heads // 4, heads))),
                      ffn_hidden_size=heads * 128 * 3, vocab_size=draw(st.sampled_from((32000, 128256))),
                      seq_length=draw(st.sampled_from((2048, 4096, 8192))))
    nodes = draw(st.sampled_from((1, 2, 4)))
    if draw(st.booleans()) and nodes > 1:
        groups = (NodeGroup(gpu=H100, num_nodes=nodes // 2), NodeGroup(gpu=A100, num_nodes=nodes // 2))
    else:
        groups = (NodeGroup(gpu=H100, num_nodes=nodes),)
    cluster = ClusterSpec(name="c", gpus_per_node=4, price_per_gpu_hour=2.0, intra_node=NVLINK, inter_node=IB,
                          node_groups=groups)
    train = TrainSpec(global_batch_size=4 * nodes * draw(st.sampled_from((4, 8, 16))), seq_length=model.seq_length)
    options = SearchOptions(micro_batch_sizes=(1, 2), max_virtual_pipeline_model_parallel_size=3, top_k=4,
                            what_if_schedules=draw(st.booleans()),
                            reference=Reference(label="ref", tensor_model_parallel_size=2,
                                                pipeline_model_parallel_size=2))
    return model, cluster, train, options


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_the_first_plan_runs_and_nothing_shown_is_faster(case):
    model, cluster, train, options = case
    try:
        result = search(model=model, cluster=cluster, train=train, options=options)
    except InfeasibleError:
        return
    best = result.best
    # megatron-core runs the plan to run (unless the pipeline is off, when any schedule is plain 1F1B).
    assert best.parallel.pipeline_model_parallel_size == 1 or spec(best.schedule).megatron_runs
    assert not best.what_if
    gpus = tuple({g.gpu.name: g.gpu for g in cluster.node_groups}[name] for name in best.stage_gpus) or \
        (cluster.gpu,) * best.parallel.pipeline_model_parallel_size
    emitted = emit(partition=best.partition, parallel=best.parallel, train=best.train, model=model, gpus=gpus)
    parsed = PipelineParallelLayerLayout.from_str(emitted.layout, best.parallel.pipeline_model_parallel_size)
    assert parsed.virtual_pipeline_model_parallel_size == best.parallel.virtual_pipeline_model_parallel_size
    # By megapipe's own simulation the plan to run is not slower than any runnable, feasible plan it shows.
    shown = [*result.plans, result.baseline, result.reference]
    for other in shown:
        if other is not None and other.feasible and not other.what_if:
            assert best.tokens_per_s_per_gpu >= other.tokens_per_s_per_gpu * (1 - 1e-12), (best.key, other.key)
    if not options.what_if_schedules:
        assert not any(plan.what_if for plan in result.plans)


def test_what_if_only_when_asked():
    model = ModelSpec(name="m", num_layers=24, hidden_size=2048, num_attention_heads=16, num_query_groups=4,
                      ffn_hidden_size=6144, vocab_size=32000, seq_length=4096)
    cluster = ClusterSpec(name="c", gpus_per_node=4, price_per_gpu_hour=2.0, intra_node=NVLINK, inter_node=IB,
                          node_groups=(NodeGroup(gpu=H100, num_nodes=2),))
    train = TrainSpec(global_batch_size=64, seq_length=4096)
    fixed = {"pipeline_model_parallel_size": 4}
    plain = search(model=model, cluster=cluster, train=train, fixed=fixed, options=SearchOptions())
    wide = search(model=model, cluster=cluster, train=train, fixed=fixed,
                  options=dataclasses.replace(SearchOptions(), what_if_schedules=True))
    assert not any(plan.what_if for plan in plain.plans) and any(plan.what_if for plan in wide.plans)
    assert wide.best.key == plain.best.key  # the plan to run is the same either way
