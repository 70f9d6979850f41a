"""The analytical cost model against closed forms from the papers, published counts, and invariants."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megapipe.config import compose, to_scenario
from megapipe.cost import (
    Collective,
    activation_bytes_per_layer,
    attention_flops,
    bytes_per_parameter,
    collective_ms,
    decoder_gemm_flops,
    layer_costs,
    matmul_parameter_count,
    model_flops_per_token,
    output_gemm_flops,
    p2p_bytes,
    parameter_count,
    shapes_of,
)
from megapipe.cost.flops import mtp_gemm_flops
from megapipe.errors import ConfigError
from megapipe.profile.format import profile_from_dict, profile_to_dict
from megapipe.records import (
    TIME_PARTS,
    Activation,
    AttentionBackend,
    ClusterSpec,
    GpuSpec,
    LayerKind,
    LinkSpec,
    ModelSpec,
    NodeGroup,
    ParallelSpec,
    Recompute,
    TrainSpec,
)

H100 = GpuSpec(name="h100", bf16_tflops=989.4, hbm_gbytes_per_s=3350, memory_gib=79.6)
NVLINK = LinkSpec(kind="nvlink", bandwidth_gbytes_per_s=450, latency_us=5)
IB = LinkSpec(kind="infiniband", bandwidth_gbytes_per_s=50, latency_us=10)
CLUSTER = ClusterSpec(name="test", gpus_per_node=8, price_per_gpu_hour=3.5, intra_node=NVLINK, inter_node=IB,
                      node_groups=(NodeGroup(gpu=H100, num_nodes=16),))

# Korthikanti et al. 2022's setting: GELU, ffn = 4h, multi-head attention, dropout, unfused attention.
S, B, H, A, T = 2048, 2, 1024, 16, 4
KORTHIKANTI = ModelSpec(name="k", num_layers=4, hidden_size=H, num_attention_heads=A, num_query_groups=A,
                        ffn_hidden_size=4 * H, vocab_size=32768, seq_length=S, activation=Activation.gelu,
                        attention_backend=AttentionBackend.unfused, position_embedding_type="learned_absolute")
SWIGLU_GQA = ModelSpec(name="g", num_layers=3, hidden_size=256, num_attention_heads=8, num_query_groups=2,
                       ffn_hidden_size=704, vocab_size=1024, seq_length=128, kv_channels=48, mtp_num_layers=1)


def _scenario(name: str):
    return to_scenario(compose([f"model={name}", "parallel.tensor_model_parallel_size=1",
                                "parallel.pipeline_model_parallel_size=1"]))


# --- FLOPs -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("model", [KORTHIKANTI, SWIGLU_GQA], ids=["gelu_mha", "swiglu_gqa_mtp"])
def test_training_flops_are_six_n_tokens_plus_attention(model):
    """Sum over units of fwd + bwd GEMM FLOPs = 6 N tokens + 3 x full-square attention (Narayanan 2021)."""
    b, s = 2, model.seq_length
    shapes = shapes_of(model=model, parallel=ParallelSpec(), train=TrainSpec(micro_batch_size=b, seq_length=s))
    h, q, kv, f = model.hidden_size, model.num_attention_heads * model.head_dim, \
        model.num_query_groups * model.head_dim, model.ffn_hidden_size
    gated = model.activation == Activation.swiglu
    per_layer = h * (q + 2 * kv) + q * h + (3 if gated else 2) * h * f  # weight matrices, by hand
    head = model.vocab_size * h
    n_matmul = model.num_layers * per_layer + head + model.mtp_num_layers * (per_layer + 2 * h * h + head)
    layers = model.num_layers + model.mtp_num_layers
    expected = 6 * n_matmul * b * s + 3 * layers * 4 * b * s * s * q
    forward = (model.num_layers * (sum(decoder_gemm_flops(shapes)) + attention_flops(shapes))
               + sum(output_gemm_flops(shapes))
               + model.mtp_num_layers * (sum(mtp_gemm_flops(shapes)) + attention_flops(shapes)))
    assert 3 * forward == pytest.approx(expected, rel=1e-12)
    assert matmul_parameter_count(model) == n_matmul
    megatron_norms = 6 * model.mtp_num_layers * 3 * h  # Megatron-LM counts an MTP block's three norms
    assert model_flops_per_token(model, s, causal=False) * b * s == pytest.approx(expected + megatron_norms * b * s,
                                                                                   rel=1e-12)
    causal_gap = model_flops_per_token(model, s, causal=False) - model_flops_per_token(model, s)
    assert causal_gap == pytest.approx(6 * layers * s * q)


@settings(max_examples=30, deadline=None)
@given(tp=st.sampled_from([1, 2]), cp=st.sampled_from([1, 2, 4]), mbs=st.integers(1, 4))
def test_flops_shard_exactly_over_tensor_and_context_parallel(tp, cp, mbs):
    train = TrainSpec(micro_batch_size=mbs, seq_length=128)
    whole = shapes_of(model=SWIGLU_GQA, parallel=ParallelSpec(), train=train)
    part = shapes_of(model=SWIGLU_GQA, parallel=ParallelSpec(tensor_model_parallel_size=tp, context_parallel_size=cp),
                     train=train)
    assert sum(decoder_gemm_flops(part)) * tp * cp == pytest.approx(sum(decoder_gemm_flops(whole)))
    assert attention_flops(part) * tp * cp == pytest.approx(attention_flops(whole))


# --- parameters and static memory ------------------------------------------------------------------


@pytest.mark.parametrize("name, published", [
    ("llama3_8b", 8.03e9), ("llama3_70b", 70.6e9), ("llama3_405b", 405.8e9), ("gpt3_175b", 175e9),
])
def test_parameter_count_matches_published(name, published):
    assert parameter_count(_scenario(name).model) == pytest.approx(published, rel=0.01)


def test_unit_parameters_add_up_to_the_model():
    for model in (_scenario("llama3_8b").model, SWIGLU_GQA):
        profile = layer_costs(model=model, gpu=H100, cluster=CLUSTER, parallel=ParallelSpec(),
                              train=TrainSpec(seq_length=128))
        assert sum(layer.param_count for layer in profile.layers) == pytest.approx(parameter_count(model))


@pytest.mark.parametrize("precision, replicated, sharded", [("bf16", 6, 12), ("fp16", 4, 16), ("fp32", 8, 8)])
def test_bytes_per_parameter_follow_megatrons_distributed_optimizer_table(precision, replicated, sharded):
    for dp, cp in ((1, 1), (4, 1), (8, 2)):
        parallel = ParallelSpec(data_parallel_size=dp, context_parallel_size=cp)
        assert bytes_per_parameter(precision=precision, parallel=parallel) == replicated + sharded / (dp * cp)
        off = replace(parallel, use_distributed_optimizer=False)
        assert bytes_per_parameter(precision=precision, parallel=off) == replicated + sharded


def test_static_bytes_are_parameters_times_bytes_per_parameter():
    parallel = ParallelSpec(tensor_model_parallel_size=2, data_parallel_size=8)
    profile = layer_costs(model=SWIGLU_GQA, gpu=H100, cluster=CLUSTER, parallel=parallel,
                          train=TrainSpec(seq_length=128))
    for layer in profile.layers:
        assert layer.static_bytes == pytest.approx(layer.param_count * (6 + 12 / 8))


def test_tied_output_weight_is_copied_to_the_last_stage_only_with_pipelining():
    tied = replace(KORTHIKANTI, untie_embeddings_and_output_weights=False)
    train = TrainSpec(seq_length=S)
    one = layer_costs(model=tied, gpu=H100, cluster=CLUSTER, parallel=ParallelSpec(), train=train)
    two = layer_costs(model=tied, gpu=H100, cluster=CLUSTER, parallel=ParallelSpec(pipeline_model_parallel_size=2),
                      train=train)
    assert one.layers[-1].param_count == 2 * H  # final LayerNorm only
    assert two.layers[-1].param_count == 2 * H + tied.vocab_size * H


# --- activation memory: Korthikanti et al. 2022, Table 2 -------------------------------------------


def _act(*, tp=1, sp=False, recompute=Recompute.none, model=KORTHIKANTI):
    parallel = ParallelSpec(tensor_model_parallel_size=tp, sequence_parallel=sp)
    train = TrainSpec(micro_batch_size=B, seq_length=S, recompute_granularity=recompute)
    return activation_bytes_per_layer(model=model, parallel=parallel, train=train)


@pytest.mark.parametrize("tp, sp, recompute, expected", [
    (1, False, Recompute.none, S * B * H * (34 + 5 * A * S / H)),
    (T, False, Recompute.none, S * B * H * (10 + 24 / T + 5 * A * S / (H * T))),
    (T, True, Recompute.none, S * B * H * (34 / T + 5 * A * S / (H * T))),
    (T, False, Recompute.selective, S * B * H * (10 + 24 / T)),
    (T, True, Recompute.selective, S * B * H * 34 / T),
    (1, False, Recompute.full, 2 * S * B * H),
    (T, False, Recompute.full, 2 * S * B * H),
    (T, True, Recompute.full, 2 * S * B * H / T),
], ids=["none", "tp", "tp_sp", "tp_selective", "tp_sp_selective", "full", "tp_full", "tp_sp_full"])
def test_activation_bytes_equal_korthikantis_table(tp, sp, recompute, expected):
    assert _act(tp=tp, sp=sp, recompute=recompute) == expected


@pytest.mark.parametrize("backend", [AttentionBackend.flash, AttentionBackend.fused])
def test_flash_and_fused_attention_drop_only_the_score_term(backend):
    fast = replace(KORTHIKANTI, attention_backend=backend)
    assert _act(model=fast) == S * B * H * 34
    assert _act(model=fast, tp=T) == S * B * H * (10 + 24 / T)
    assert _act(model=fast, tp=T, sp=True) == S * B * H * 34 / T


def test_swiglu_gqa_activation_bytes_from_first_principles():
    """Llama 3 8B, one GPU, flash: no dropout masks, the 2f-wide SwiGLU input is kept."""
    model = _scenario("llama3_8b").model
    s, b, h, q, kv, f = 8192, 1, 4096, 4096, 1024, 14336
    norms_qkv_fc1_inputs = 4 * 2 * s * b * h
    attention = 2 * s * b * (q + kv) + 2 * s * b * kv + 2 * s * b * q
    mlp = 2 * s * b * 2 * f + 2 * s * b * f
    train = TrainSpec(micro_batch_size=b, seq_length=s)
    assert activation_bytes_per_layer(model=model, parallel=ParallelSpec(), train=train) == \
        norms_qkv_fc1_inputs + attention + mlp


def test_output_layer_keeps_fp32_logits():
    parallel = ParallelSpec(tensor_model_parallel_size=T, sequence_parallel=True)
    train = TrainSpec(micro_batch_size=B, seq_length=S)
    output = layer_costs(model=KORTHIKANTI, gpu=H100, cluster=CLUSTER, parallel=parallel, train=train).layers[-1]
    assert output.act_bytes == 4 * S * B * H / T + 4 * S * B * KORTHIKANTI.vocab_size / T  # Korthikanti Sec. 4.3


def test_p2p_bytes():
    train = TrainSpec(micro_batch_size=B, seq_length=S)
    assert p2p_bytes(model=KORTHIKANTI, parallel=ParallelSpec(), train=train) == 2 * S * B * H
    assert p2p_bytes(model=KORTHIKANTI, parallel=ParallelSpec(tensor_model_parallel_size=T), train=train) \
        == 2 * S * B * H
    sp_cp = ParallelSpec(tensor_model_parallel_size=T, sequence_parallel=True, context_parallel_size=2)
    assert p2p_bytes(model=KORTHIKANTI, parallel=sp_cp, train=train) == 2 * S * B * H / T / 2


# --- time model --------------------------------------------------------------------------------------


def test_ring_collectives_closed_form():
    assert collective_ms(kind=Collective.all_reduce, num_bytes=1e9, group_size=1, link=NVLINK) == 0
    achieved = 450e9 * NVLINK.bandwidth_efficiency
    ring = collective_ms(kind=Collective.all_reduce, num_bytes=8e9, group_size=8, link=NVLINK)
    assert ring == pytest.approx(2 * 7 / 8 * 8e9 / achieved * 1e3 + 14 * 5e-3)
    gather = collective_ms(kind=Collective.all_gather, num_bytes=8e9, group_size=8, link=NVLINK)
    scatter = collective_ms(kind=Collective.reduce_scatter, num_bytes=8e9, group_size=8, link=NVLINK)
    assert gather + scatter == pytest.approx(ring)
    slower = collective_ms(kind=Collective.all_gather, num_bytes=8e9, group_size=8, link=NVLINK, efficiency_scale=0.5)
    assert slower == pytest.approx(2 * (gather - 7 * 5e-3) + 7 * 5e-3)


def test_tensor_parallel_beyond_a_node_uses_the_inter_node_link():
    small = replace(CLUSTER, gpus_per_node=2)
    train = TrainSpec(seq_length=128)
    parallel = ParallelSpec(tensor_model_parallel_size=4)
    inside = layer_costs(model=KORTHIKANTI, gpu=H100, cluster=CLUSTER, parallel=parallel, train=train)
    across = layer_costs(model=KORTHIKANTI, gpu=H100, cluster=small, parallel=parallel, train=train)
    assert across.layers[1].fwd_ms > inside.layers[1].fwd_ms


def test_recompute_trades_memory_for_backward_time():
    costs = {}
    for recompute in Recompute:
        train = TrainSpec(micro_batch_size=1, seq_length=S, recompute_granularity=recompute)
        costs[recompute] = layer_costs(model=KORTHIKANTI, gpu=H100, cluster=CLUSTER, parallel=ParallelSpec(),
                                       train=train).layers[1]
    none, selective, full = costs[Recompute.none], costs[Recompute.selective], costs[Recompute.full]
    assert none.act_bytes > selective.act_bytes > full.act_bytes
    assert none.bwd_ms < selective.bwd_ms < full.bwd_ms
    assert full.bwd_ms == pytest.approx(none.bwd_ms + none.fwd_ms)
    assert none.fwd_ms == selective.fwd_ms == full.fwd_ms
    assert none.wgrad_ms == selective.wgrad_ms == full.wgrad_ms


_models = st.sampled_from([KORTHIKANTI, SWIGLU_GQA, replace(SWIGLU_GQA, attention_backend=AttentionBackend.unfused)])


@settings(max_examples=40, deadline=None)
@given(model=_models, mbs=st.integers(1, 4), sp=st.booleans(), recompute=st.sampled_from(list(Recompute)))
def test_more_tensor_parallel_means_fewer_bytes_and_flops_per_gpu(model, mbs, sp, recompute):
    train = TrainSpec(micro_batch_size=mbs, seq_length=128, recompute_granularity=recompute)
    previous = None
    for tp in (1, 2):
        profile = layer_costs(model=model, gpu=H100, cluster=CLUSTER,
                              parallel=ParallelSpec(tensor_model_parallel_size=tp, sequence_parallel=sp), train=train)
        decoder = profile.layers[1]
        if previous is not None:
            assert decoder.act_bytes <= previous.act_bytes
            assert decoder.static_bytes < previous.static_bytes
        previous = decoder


@settings(max_examples=40, deadline=None)
@given(model=_models, tp=st.sampled_from([1, 2]), recompute=st.sampled_from(list(Recompute)),
       mbs=st.integers(1, 3))
def test_more_micro_batch_or_sequence_means_more_time_and_memory(model, tp, recompute, mbs):
    parallel = ParallelSpec(tensor_model_parallel_size=tp)

    def costs(micro_batch_size, seq_length):
        train = TrainSpec(micro_batch_size=micro_batch_size, seq_length=seq_length, recompute_granularity=recompute)
        return layer_costs(model=model, gpu=H100, cluster=CLUSTER, parallel=parallel, train=train).layers

    base, more_batch, longer = costs(mbs, 64), costs(mbs + 1, 64), costs(mbs, 128)
    host = TIME_PARTS.index("host")

    def gpu_ms(layer):  # what the GPU does; a layer this small waits on the host's launches (megapipe.cost.host)
        return sum(value for index, value in enumerate(layer.parts) if index != host)

    for small, big in ((base, more_batch), (base, longer)):
        for before, after in zip(small, big):
            assert after.fwd_ms >= before.fwd_ms and after.bwd_ms >= before.bwd_ms
            assert gpu_ms(after) > gpu_ms(before)
            assert after.act_bytes >= before.act_bytes and after.static_bytes == before.static_bytes
            assert 0 <= after.wgrad_ms <= after.bwd_ms


def test_a_slower_gpu_takes_longer():
    a100 = GpuSpec(name="a100", bf16_tflops=312, hbm_gbytes_per_s=2039, memory_gib=80, matmul_efficiency=0.8,
                   kernel_overhead_us=4.0, bandwidth_efficiency=0.85)
    train = TrainSpec(seq_length=2048)
    fast = layer_costs(model=KORTHIKANTI, gpu=H100, cluster=CLUSTER, parallel=ParallelSpec(), train=train)
    slow = layer_costs(model=KORTHIKANTI, gpu=a100, cluster=CLUSTER, parallel=ParallelSpec(), train=train)
    for f, s in zip(fast.layers, slow.layers):
        assert s.fwd_ms > f.fwd_ms and s.bwd_ms > f.bwd_ms and s.static_bytes == f.static_bytes


# --- the profile record --------------------------------------------------------------------------------


def test_profile_units_in_layout_order_and_round_trip():
    profile = layer_costs(model=SWIGLU_GQA, gpu=H100, cluster=CLUSTER, parallel=ParallelSpec(),
                          train=TrainSpec(seq_length=128))
    names = [layer.name for layer in profile.layers]
    assert names == ["embedding", "decoder.0", "decoder.1", "decoder.2", "mtp.0", "output"]
    assert [layer.kind for layer in profile.layers] == [LayerKind.embedding] + [LayerKind.decoder] * 3 + \
        [LayerKind.mtp, LayerKind.loss]
    assert profile.device == "h100" and dict(profile.meta)["source"] == "cost_model"
    assert profile.layers[0].wgrad_ms == profile.layers[0].bwd_ms  # the embedding's backward is all weight grad
    assert profile_from_dict(profile_to_dict(profile)).layers == profile.layers


@pytest.mark.parametrize("change, seq_length, match", [
    (dict(tensor_model_parallel_size=4), 128, "num_query_groups=2 is not divisible by tensor_model_parallel_size=4"),
    (dict(tensor_model_parallel_size=2, sequence_parallel=True), 129, "as sequence_parallel needs"),
    (dict(context_parallel_size=3), 128, "2 \\* context_parallel_size=6"),
])
def test_shardings_megatron_rejects_raise_config_error(change, seq_length, match):
    with pytest.raises(ConfigError, match=match):
        layer_costs(model=SWIGLU_GQA, gpu=H100, cluster=CLUSTER, parallel=ParallelSpec(**change),
                    train=TrainSpec(seq_length=seq_length))


def test_unknown_precision_is_a_config_error():
    with pytest.raises(ConfigError, match="precision='int4'"):
        layer_costs(model=SWIGLU_GQA, gpu=H100, cluster=CLUSTER, parallel=ParallelSpec(),
                    train=TrainSpec(seq_length=128, precision="int4"))


# --- the write-ups' 48-layer, 128k-vocabulary GPT ----------------------------------------------------------


def test_48_layer_gpt_embedding_is_memory_heavy_and_compute_light():
    """The write-ups claim the embedding has ~2x a decoder layer's memory and ~0.3x its compute.

    With hidden 2048 and vocab 131072 the model says: static memory V h / (12 h^2 + 13 h) = 5.3x,
    compute a few percent of a layer (a lookup). The *output* unit is the heavy one in both: the
    same weights as the embedding, and a head GEMM plus cross-entropy over 128k logits.
    """
    scenario = _scenario("gpt_48l_128k")
    train = TrainSpec(micro_batch_size=1, seq_length=scenario.model.seq_length)
    layers = layer_costs(model=scenario.model, gpu=H100, cluster=CLUSTER, parallel=ParallelSpec(), train=train).layers
    embedding, decoder, output = layers[0], layers[1], layers[-1]
    memory_ratio = embedding.static_bytes / decoder.static_bytes
    h, v, s = 2048, 131072, 4096
    assert memory_ratio == pytest.approx((v * h + s * h) / (12 * h * h + 13 * h))
    assert 5.0 < memory_ratio < 5.6
    compute = (embedding.fwd_ms + embedding.bwd_ms) / (decoder.fwd_ms + decoder.bwd_ms)
    assert compute < 0.05
    assert (output.fwd_ms + output.bwd_ms) / (decoder.fwd_ms + decoder.bwd_ms) > 2
    assert math.isclose(output.static_bytes / decoder.static_bytes, v * h / (12 * h * h + 13 * h), rel_tol=1e-3)


# --- against megatron-core's real layers (CPU) ------------------------------------------------------------


@pytest.mark.engine
def test_parameters_and_activation_bytes_match_megatron_core_on_cpu():
    """Parameters exact; full recompute exact; a GELU layer (fp32, no dropout) within the causal mask + norm stats."""
    pytest.importorskip("megatron.core")
    from megapipe.cost.memory import decoder_activation_bytes
    from megapipe.profile.measure import measure_profile
    from megapipe.options import MeasureOptions

    model = ModelSpec(name="gelu_mha", num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=4,
                      ffn_hidden_size=256, vocab_size=512, seq_length=64, activation=Activation.gelu,
                      attention_backend=AttentionBackend.unfused, position_embedding_type="learned_absolute")
    for recompute in (Recompute.none, Recompute.full):
        train = TrainSpec(micro_batch_size=2, seq_length=64, precision="fp32", recompute_granularity=recompute)
        measured = measure_profile(model=model, train=train, options=MeasureOptions(device="cpu", warmup=0, iters=1))
        predicted = layer_costs(model=model, gpu=H100, cluster=CLUSTER, parallel=ParallelSpec(), train=train)
        by_kind = {layer.kind: layer for layer in measured.layers}
        for layer in (predicted.layers[0], predicted.layers[1], predicted.layers[-1]):
            assert layer.param_count == by_kind[layer.kind].param_count
        # megapipe's profiler builds without dropout; compare with the model's no-dropout figure.
        no_dropout = decoder_activation_bytes(replace(shapes_of(model=model, parallel=ParallelSpec(), train=train),
                                                      gpt_style=False))
        gap = by_kind[LayerKind.decoder].act_bytes - no_dropout
        assert gap == 0 if recompute == Recompute.full else 0 <= gap <= 64 * 64 + 2 * 2 * 128 * 4


_FEATURE_VALUES = {
    "moe_token_dispatcher_type": ("allgather", "flex"),
    "moe_flex_dispatcher_backend": ("hybridep",),
    "overlap_moe_expert_parallel_comm": (True,),
    "delay_wgrad_compute": (True,),
    "moe_shared_expert_overlap": (True,),
    "moe_permute_fusion": (True,),
    "moe_router_fusion": (True,),
    "cuda_graph_impl": ("local", "transformer_engine"),
    "cuda_graph_scope": (("attn", "moe_router", "moe_preprocess"), ("full_iteration",), ("moe",)),
    "recompute_modules": (("moe", "core_attn"), ("moe_act", "mla_up_proj", "mlp")),
    "moe_router_force_load_balancing": (True,),
    "moe_router_padding_for_quantization": (True,),
    "fine_grained_activation_offloading": (True,),
    "offload_modules": (("expert_fc1", "moe_act"),),
}
"""Other values of every runtime feature, for the tests that a cost part reads only the features it names."""


def _reads_only(function, named: tuple[str, ...], shapes, starts) -> None:
    """``function(shapes)`` is unchanged by any change of a feature outside ``named`` (from each feature set of
    ``starts``), the sizes kept; every feature is named or changed."""
    from megapipe.records import RuntimeFeatures

    assert {field.name for field in dataclasses.fields(RuntimeFeatures)} == set(_FEATURE_VALUES)
    for start in starts:
        mine = replace(shapes, features=start)
        expected = function(mine)
        for name, values in _FEATURE_VALUES.items():
            if name in named:
                continue
            for value in values:
                other = replace(mine, features=replace(start, **{name: value}))
                assert function(other) == expected, (name, value)


def _deepseek_shapes(recompute: str):
    from megapipe.cost.comm import p2p_link, tensor_parallel_link
    from megapipe.cost.shapes import shapes_of
    from megapipe.cost.timing import Device

    scenario = to_scenario(compose(["model=deepseek_v3", "cluster.num_nodes=32", "train.global_batch_size=1024",
                                    "parallel.tensor_model_parallel_size=2", "parallel.pipeline_model_parallel_size=8",
                                    "parallel.expert_model_parallel_size=16", "parallel.expert_tensor_parallel_size=2",
                                    "train.precision=fp8", f"train.recompute_granularity={recompute}"]))
    cluster = scenario.cluster
    device = Device(gpu=cluster.gpu, runtime=cluster.runtime, tp_comm_overlap=False, cluster=cluster,
                    link=tensor_parallel_link(cluster=cluster, tensor_model_parallel_size=2),
                    cp_link=p2p_link(cluster=cluster, span=2))
    return shapes_of(model=scenario.model, parallel=scenario.parallel, train=scenario.train), device


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_cost_parts_read_only_the_features_they_name(recompute):
    """The search shares a MoE layer's router, permute and dispatch parts (:data:`MOE_PARTS_FEATURES`) and a dense
    layer's time (:data:`DENSE_FEATURES`) between feature sets that agree on the features named: changing any other
    feature, the sizes kept, changes neither."""
    from megapipe.cost.decoder import DENSE_FEATURES, _decoder_timing
    from megapipe.cost.moe import MOE_PARTS_FEATURES, moe_parts

    shapes, device = _deepseek_shapes(recompute)
    base = shapes.features
    starts = [replace(base, moe_token_dispatcher_type=dispatcher, moe_flex_dispatcher_backend=backend,
                      moe_permute_fusion=fused, moe_router_fusion=fused, moe_router_padding_for_quantization=fused,
                      cuda_graph_impl="transformer_engine" if fused else "none",
                      cuda_graph_scope=("attn",) if fused else ())
              for dispatcher, backend in (("alltoall", "deepep"), ("allgather", "deepep"), ("flex", "deepep"),
                                          ("flex", "hybridep")) for fused in (False, True)]
    _reads_only(lambda shapes: moe_parts(shapes, device), MOE_PARTS_FEATURES, shapes, starts)
    _reads_only(lambda shapes: _decoder_timing(shapes, device, moe=False, fixed=None), DENSE_FEATURES, shapes,
                starts)
