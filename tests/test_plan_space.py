"""Search-space enumeration, closed-form pruning, ranking, money, warnings, DP sync."""

from __future__ import annotations

import dataclasses

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megapipe.layout import max_stages
from megapipe.errors import ConfigError
from megapipe.plan.money import cost_per_million_tokens, gpu_hours, training_cost
from megapipe.plan.rank import rank_plans
from megapipe.plan.plans import Plan, StageUsage
from megapipe.options import SearchOptions
from megapipe.plan.space import divisors, enumerate_candidates
from megapipe.cost.data_parallel import dp_link, dp_sync_ms, optimizer_step_ms
from megapipe.plan.warnings import plan_warnings
from megapipe.records import (
    ClusterSpec, GpuSpec, LinkSpec, ModelSpec, NodeGroup, ParallelSpec, Recompute, TrainSpec,
)

H100 = GpuSpec(name="h100", bf16_tflops=989.0, hbm_gbytes_per_s=3350.0, memory_gib=80.0)
NVLINK = LinkSpec(kind="nvlink", bandwidth_gbytes_per_s=450.0, latency_us=3.0)
IB = LinkSpec(kind="infiniband", bandwidth_gbytes_per_s=50.0, latency_us=5.0)
LLAMA70 = ModelSpec(name="llama3_70b", num_layers=80, hidden_size=8192, num_attention_heads=64,
                    num_query_groups=8, ffn_hidden_size=28672, vocab_size=128256, seq_length=8192)


def cluster(num_nodes: int = 16, gpus_per_node: int = 8, price: float = 3.5) -> ClusterSpec:
    return ClusterSpec(name="c", gpus_per_node=gpus_per_node, price_per_gpu_hour=price, intra_node=NVLINK,
                       inter_node=IB, node_groups=(NodeGroup(gpu=H100, num_nodes=num_nodes),))


TRAIN = TrainSpec(global_batch_size=256, seq_length=8192)


def test_writeup_500b_cost():
    """920,000 tok/s on 2,048 GPUs at $3.50/GPU-h: 2T tokens cost 2e12/920000*2048*3.5/3600 = $4.33M."""
    total = training_cost(total_tokens=2e12, tokens_per_s=920_000, num_gpus=2048, price_per_gpu_hour=3.5)
    assert total == pytest.approx(4.3285e6, rel=1e-3)
    assert 4.3e6 < total < 4.35e6
    per_million = cost_per_million_tokens(tokens_per_s=920_000, num_gpus=2048, price_per_gpu_hour=3.5)
    assert per_million * 2e12 / 1e6 == pytest.approx(total)
    assert gpu_hours(total_tokens=2e12, tokens_per_s=920_000, num_gpus=2048) == pytest.approx(total / 3.5)


def test_money_rejects_bad_input():
    with pytest.raises(ConfigError, match="tokens_per_s=0"):
        cost_per_million_tokens(tokens_per_s=0, num_gpus=8, price_per_gpu_hour=1.0)
    with pytest.raises(ConfigError, match="price_per_gpu_hour=-1"):
        training_cost(total_tokens=1, tokens_per_s=1, num_gpus=8, price_per_gpu_hour=-1)


def test_space_uses_all_gpus_and_counts_pruning():
    space = enumerate_candidates(model=LLAMA70, cluster=cluster(), train=TRAIN)
    assert space.candidates
    assert space.enumerated == len(space.candidates) + sum(space.pruned.values())
    for cand in space.candidates:
        par = cand.parallel
        assert par.world_size == 128
        assert 8 % par.tensor_model_parallel_size == 0
        assert 256 % (cand.train.micro_batch_size * par.data_parallel_size) == 0
        assert cand.num_microbatches * cand.train.micro_batch_size * par.data_parallel_size == 256
        if cand.schedule == "interleaved_1f1b":
            assert par.virtual_pipeline_model_parallel_size >= 2
            assert cand.num_microbatches % par.pipeline_model_parallel_size == 0
        if cand.schedule in ("zb_v", "dualpipe_v"):
            assert par.virtual_pipeline_model_parallel_size == 2
            assert cand.num_microbatches >= 2 * par.pipeline_model_parallel_size
        if par.tensor_model_parallel_size == 1:
            assert not par.sequence_parallel
    assert space.pruned["microbatches"] > 0
    assert len({(c.parallel, c.train, c.schedule) for c in space.candidates}) == len(space.candidates)


def test_space_fixed_dimensions_and_everything_fixed():
    fixed = {"tensor_model_parallel_size": 4, "pipeline_model_parallel_size": 8, "virtual_pipeline_model_parallel_size": 1,
             "context_parallel_size": 1, "sequence_parallel": True, "micro_batch_size": 1,
             "recompute_granularity": Recompute.none, "schedule": "1f1b"}
    space = enumerate_candidates(model=LLAMA70, cluster=cluster(), train=TRAIN, fixed=fixed)
    assert len(space.candidates) == 1
    only = space.candidates[0]
    assert only.parallel.data_parallel_size == 4 and only.num_microbatches == 64
    partial = enumerate_candidates(model=LLAMA70, cluster=cluster(), train=TRAIN, fixed={"schedule": "zb_h1"})
    assert {c.schedule for c in partial.candidates} == {"zb_h1"}


def test_space_errors_name_the_value():
    with pytest.raises(ConfigError, match=r"tensor_model_parallel_size=3 does not divide .*use one of \[1, 2, 4, 8\]"):
        enumerate_candidates(model=LLAMA70, cluster=cluster(), train=TRAIN,
                             fixed={"tensor_model_parallel_size": 3})
    with pytest.raises(ConfigError, match="schedule='bogus'"):
        enumerate_candidates(model=LLAMA70, cluster=cluster(), train=TRAIN, fixed={"schedule": "bogus"})


def test_space_cross_node_tp_only_when_allowed():
    mha = ModelSpec(name="mha", num_layers=80, hidden_size=8192, num_attention_heads=64, num_query_groups=64,
                    ffn_hidden_size=28672, vocab_size=128256, seq_length=8192)
    base = enumerate_candidates(model=mha, cluster=cluster(), train=TRAIN)
    wide = enumerate_candidates(model=mha, cluster=cluster(), train=TRAIN,
                                options=SearchOptions(allow_cross_node_tp=True))
    assert max(c.parallel.tensor_model_parallel_size for c in base.candidates) == 8
    assert max(c.parallel.tensor_model_parallel_size for c in wide.candidates) == 64
    gqa = enumerate_candidates(model=LLAMA70, cluster=cluster(), train=TRAIN,
                               options=SearchOptions(allow_cross_node_tp=True))
    assert max(c.parallel.tensor_model_parallel_size for c in gqa.candidates) == 8  # num_query_groups=8


@given(st.integers(1, 64), st.integers(1, 8))
@settings(max_examples=40, deadline=None)
def test_space_property_divisibility(num_nodes, gpus_per_node):
    model = ModelSpec(name="m", num_layers=12, hidden_size=256, num_attention_heads=8, num_query_groups=4,
                      ffn_hidden_size=1024, vocab_size=1000, seq_length=1024)
    train = TrainSpec(global_batch_size=64, seq_length=1024)
    space = enumerate_candidates(model=model, cluster=cluster(num_nodes, gpus_per_node), train=train)
    for cand in space.candidates:
        par = cand.parallel
        assert par.world_size == num_nodes * gpus_per_node
        assert 4 % par.tensor_model_parallel_size == 0
        assert par.pipeline_model_parallel_size * par.virtual_pipeline_model_parallel_size <= max_stages(12)  # E|t*12|L
        assert 64 % (cand.train.micro_batch_size * par.data_parallel_size) == 0
    assert space.enumerated == len(space.candidates) + sum(space.pruned.values())


def test_divisors():
    assert divisors(12) == (1, 2, 3, 4, 6, 12)


def _plan(tps: float, *, mbs: int = 1, bubble: float = 0.1, feasible: bool = True, pp: int = 2) -> Plan:
    par = ParallelSpec(pipeline_model_parallel_size=pp, data_parallel_size=8 // pp)
    stage = StageUsage(time_ms=1.0, static_bytes=1.0, activation_bytes=1.0, total_bytes=2.0)
    return Plan(parallel=par, train=TrainSpec(micro_batch_size=mbs, global_batch_size=64), schedule="1f1b",
                num_microbatches=4, decoder_layers_per_stage=(1, 1), layout="Et|tL", method="optimal", pipeline_ms=1.0,
                dp_sync_ms=0.0, optimizer_ms=0.0, step_time_s=1.0, tokens_per_s=8 * tps, tokens_per_s_per_gpu=tps,
                mfu=0.5, bubble_fraction=bubble, stages=(stage, stage), memory_spread=0.0, memory_cv=0.0,
                cost_per_million_tokens=1e6 / tps, total_cost=1.0, feasible=feasible,
                memory_over_gib=0.0 if feasible else 3.0)


def test_rank_orders_and_bubble_target():
    plans = [_plan(100, mbs=1, bubble=0.05), _plan(120, mbs=2, bubble=0.2), _plan(500, feasible=False, pp=4)]
    ranked = rank_plans(plans, objective="throughput")
    assert [p.tokens_per_s_per_gpu for p in ranked] == [120, 100, 500]
    assert rank_plans(plans, objective="cost")[0].tokens_per_s_per_gpu == 120
    picked = rank_plans(plans, objective="throughput", bubble_target=(0.0, 0.1))
    assert [p.tokens_per_s_per_gpu for p in picked] == [100, 500]
    assert len(rank_plans(plans, top_k=1)) == 1
    with pytest.raises(ConfigError, match="objective='speed'"):
        rank_plans(plans, objective="speed")


def test_warnings():
    c = cluster()
    deep = ParallelSpec(tensor_model_parallel_size=16, pipeline_model_parallel_size=16, data_parallel_size=1)
    long = TrainSpec(seq_length=131072, global_batch_size=8)
    got = plan_warnings(parallel=deep, train=long, cluster=c, bubble_fraction=0.3, num_microbatches=8,
                        bubble_warning_range=(0.12, 0.15))
    text = " ".join(got)
    for needle in ("pipeline_model_parallel_size=16 > 8", "bubble 30.0% outside search.bubble_warning_range [12%, 15%]",
                   "tensor_model_parallel_size=16 spans NVLink domains", "seq_length=131072", "num_microbatches=8 < "):
        assert needle in text
    calm = ParallelSpec(tensor_model_parallel_size=8, pipeline_model_parallel_size=4, data_parallel_size=4)
    assert plan_warnings(parallel=calm, train=TRAIN, cluster=c, bubble_fraction=0.13, num_microbatches=64) == ()
    # no range set (the default), or no pipeline: no bubble warning at all
    assert not any("bubble" in w for w in plan_warnings(parallel=deep, train=long, cluster=c, bubble_fraction=0.3,
                                                         num_microbatches=8))
    flat = ParallelSpec(tensor_model_parallel_size=8, pipeline_model_parallel_size=1, data_parallel_size=16)
    assert plan_warnings(parallel=flat, train=TRAIN, cluster=c, bubble_fraction=0.0, num_microbatches=64,
                         bubble_warning_range=(0.12, 0.15)) == ()


def test_dp_sync_closed_form_and_overlap():
    """Ring collectives on fp32 gradients (bf16 parameters gathered); overlap hides all but the last bucket."""
    c = cluster()
    eff = IB.bandwidth_efficiency
    par = ParallelSpec(tensor_model_parallel_size=8, pipeline_model_parallel_size=4, data_parallel_size=4,
                       use_distributed_optimizer=False, overlap_grad_reduce=False)
    assert dp_link(cluster=c, parallel=par) is IB
    params = 1e9
    bf16 = TrainSpec(precision="bf16")

    def sync(parallel, backward_ms=0.0, forward_ms=0.0, train=bf16):
        return dp_sync_ms(params_per_gpu=params, train=train, cluster=c, parallel=parallel, backward_ms=backward_ms,
                          forward_ms=forward_ms)

    all_reduce = 2 * 3 / 4 * params * 4 / (50e9 * eff) * 1e3 + 2 * 3 * 5e-3
    assert sync(par) == pytest.approx(all_reduce)
    assert sync(par, backward_ms=1e6) == pytest.approx(all_reduce)  # no overlap flag: all of it shows
    overlapped = dataclasses.replace(par, overlap_grad_reduce=True)
    bucket = 2 * 3 / 4 * 4e7 * 4 / (50e9 * eff) * 1e3 + 2 * 3 * 5e-3
    assert sync(overlapped, backward_ms=10.0) == pytest.approx(all_reduce - 10.0)
    assert sync(overlapped, backward_ms=1e6) == pytest.approx(bucket)  # the last bucket runs after the backward
    dist = ParallelSpec(tensor_model_parallel_size=8, pipeline_model_parallel_size=4, data_parallel_size=4,
                        overlap_grad_reduce=False, overlap_param_gather=False)
    scatter = 3 / 4 * params * 4 / (50e9 * eff) * 1e3 + 3 * 5e-3
    gather = 3 / 4 * params * 2 / (50e9 * eff) * 1e3 + 3 * 5e-3
    assert sync(dist) == pytest.approx(scatter + gather)
    fp8 = TrainSpec(precision="fp8", fp8_recipe="tensorwise", fp8_param_gather=True)
    assert sync(dist, train=fp8) == pytest.approx(scatter + gather - 3 / 4 * params * 1 / (50e9 * eff) * 1e3)
    assert sync(dist, train=TrainSpec(precision="fp16")) == pytest.approx(scatter / 2 + gather + 3 * 5e-3 / 2)
    single = ParallelSpec(tensor_model_parallel_size=8, pipeline_model_parallel_size=16)
    assert sync(single) == 0.0
    small = ParallelSpec(tensor_model_parallel_size=2, pipeline_model_parallel_size=32, data_parallel_size=2)
    assert dp_link(cluster=c, parallel=small) is NVLINK


def test_optimizer_step_memory_bound():
    """38 bytes per shard parameter (norm, Adam, copy into the bf16 buffer) plus zeroing 4 bytes per parameter."""
    par = ParallelSpec(data_parallel_size=4)
    ms = optimizer_step_ms(params_per_gpu=1e9, gpu=H100, parallel=par)
    assert ms == pytest.approx(1e3 * (1e9 / 4 * 38 + 1e9 * 4) / (3350e9 * 0.8))
    plain = ParallelSpec(data_parallel_size=4, use_distributed_optimizer=False)
    assert optimizer_step_ms(params_per_gpu=1e9, gpu=H100, parallel=plain) == pytest.approx(
        1e3 * 1e9 * 42 / (3350e9 * 0.8))
    assert math.isfinite(ms)
