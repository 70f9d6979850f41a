"""Bytes per parameter as megatron-core shards and offloads them (megapipe.cost.model_state), and the activation
bytes each module saves (megapipe.cost.memory), against the sources the modules cite."""

from __future__ import annotations

from dataclasses import replace

import pytest

from megapipe.cost.memory import decoder_activation_bytes
from megapipe.cost.model_state import bytes_per_parameter, state_problem
from megapipe.cost.params import unit_static_bytes
from megapipe.cost.shapes import shapes_of
from megapipe.records import LayerKind, ModelSpec, ParallelSpec, Recompute, RuntimeFeatures, TrainSpec

D = 8
PARALLEL = ParallelSpec(data_parallel_size=D)
BF16_MOMENTS = dict(use_precision_aware_optimizer=True, exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16")


@pytest.mark.parametrize("precision, replicated, sharded", [("bf16", 6, 12), ("fp16", 4, 16), ("fp32", 8, 8)])
def test_defaults_are_megatrons_distributed_optimizer_table(precision, replicated, sharded):
    train = TrainSpec(precision=precision)
    assert bytes_per_parameter(train=train, parallel=PARALLEL) == replicated + sharded / D
    assert bytes_per_parameter(train=train, parallel=replace(PARALLEL, use_distributed_optimizer=False)) == \
        replicated + sharded


def test_precision_aware_optimizer_moments_and_master_weights():
    # bf16 training: TE's FusedAdam holds the master weights and keeps only their 16-bit remainders
    assert bytes_per_parameter(train=TrainSpec(**BF16_MOMENTS), parallel=PARALLEL) == 6 + (2 + 4) / D
    # FP8 but delayed scaling: megatron-core keeps fp32 master weights itself ("6 + 8/d", arXiv 2603.07685 4.1.6)
    mxfp8 = TrainSpec(precision="fp8", fp8_recipe="mxfp8", **BF16_MOMENTS)
    assert bytes_per_parameter(train=mxfp8, parallel=PARALLEL) == 6 + 8 / D
    fp8_moments = replace(mxfp8, exp_avg_dtype="fp8", exp_avg_sq_dtype="fp8")
    assert bytes_per_parameter(train=fp8_moments, parallel=PARALLEL) == 6 + 6 / D
    nemo1 = TrainSpec(precision="fp8", fp8_recipe="delayed", main_params_dtype="bf16", **BF16_MOMENTS)
    assert bytes_per_parameter(train=nemo1, parallel=PARALLEL) == 6 + 6 / D


def test_offloading_takes_the_optimizer_state_off_the_gpu():
    states = TrainSpec(offload_optimizer_states=True)
    assert bytes_per_parameter(train=states, parallel=PARALLEL) == 6
    hybrid = TrainSpec(optimizer_cpu_offload=True, optimizer_offload_fraction=0.75, **BF16_MOMENTS)
    assert bytes_per_parameter(train=hybrid, parallel=PARALLEL) == pytest.approx(6 + 0.25 * (2 + 4) / D)


def test_megatron_fsdp_strategies_shard_more_and_free_fp8_copies():
    train = TrainSpec()
    fsdp = replace(PARALLEL, use_megatron_fsdp=True)
    for strategy, expected in (("no_shard", 18), ("optim", 6 + 12 / D), ("optim_grads", 2 + 16 / D),
                               ("optim_grads_params", 18 / D)):
        parallel = replace(fsdp, data_parallel_sharding_strategy=strategy)
        assert bytes_per_parameter(train=train, parallel=parallel) == pytest.approx(expected)
    model = ModelSpec(name="m", num_layers=2, hidden_size=256, num_attention_heads=8, num_query_groups=2,
                      ffn_hidden_size=704, vocab_size=1024, seq_length=128)
    fp8 = TrainSpec(seq_length=128, precision="fp8", fp8_recipe="tensorwise")
    shapes = shapes_of(model=model, parallel=PARALLEL, train=fp8)

    def static(parallel):
        return unit_static_bytes(kind=LayerKind.decoder, params=1e6, shapes=shapes, parallel=parallel, train=fp8)
    zero3 = replace(fsdp, data_parallel_sharding_strategy="optim_grads_params")
    assert static(zero3) == pytest.approx(1e6 * 18 / D)  # README: the FP8 transpose cache is released per layer
    assert static(PARALLEL) > 1e6 * (6 + 12 / D)  # the FP8 copies persist beside the distributed optimizer


def test_expert_state_shards_over_expert_data_parallelism():
    parallel = ParallelSpec(data_parallel_size=8, expert_model_parallel_size=4, use_megatron_fsdp=True,
                            data_parallel_sharding_strategy="optim_grads_params")
    assert bytes_per_parameter(train=TrainSpec(), parallel=parallel, expert=True) == 18 / 2


@pytest.mark.parametrize("parallel, train, match", [
    (PARALLEL, TrainSpec(exp_avg_dtype="bf16"), "use_precision_aware_optimizer"),
    (PARALLEL, TrainSpec(use_precision_aware_optimizer=True, exp_avg_dtype="int8"), "exp_avg_dtype"),
    (PARALLEL, TrainSpec(optimizer_cpu_offload=True), "use_precision_aware_optimizer"),
    (replace(PARALLEL, use_distributed_optimizer=False), TrainSpec(offload_optimizer_states=True), "distributed"),
    (replace(PARALLEL, use_megatron_fsdp=True, data_parallel_sharding_strategy="zero3"), TrainSpec(), "strategy"),
    (replace(PARALLEL, use_megatron_fsdp=True, use_distributed_optimizer=False), TrainSpec(), "distributed_optimizer"),
])
def test_settings_megatron_refuses_are_named(parallel, train, match):
    assert match in state_problem(parallel, train)


# --- what each module saves (megatron-core 0.16.1) ---------------------------------------------------------------

MOE = ModelSpec(name="moe", num_layers=2, hidden_size=1024, num_attention_heads=16, num_query_groups=4,
                ffn_hidden_size=2048, vocab_size=1024, seq_length=512, num_moe_experts=8, moe_ffn_hidden_size=512,
                moe_router_topk=2)


def _bytes(model=MOE, *, features=RuntimeFeatures(), moe=True, **train_fields):
    train = TrainSpec(seq_length=model.seq_length, moe_load_imbalance=1.0, **train_fields)
    parallel = ParallelSpec(expert_model_parallel_size=1, features=features)
    shapes = shapes_of(model=model, parallel=parallel, train=train)
    return shapes, decoder_activation_bytes(shapes, moe=moe)


def test_routed_experts_keep_no_output_for_the_unpermute():
    """Memory-efficient permutation: per token-expert pair linear_fc1's input (h), the SwiGLU input (2f) and
    linear_fc2's input (f), nothing h-wide after the experts."""
    shapes, with_experts = _bytes()
    e, h, f = 2, 1024, 512
    routed = shapes.expert_tokens * (e * h + 2 * e * f + e * f)
    _, dense_mlp = _bytes(replace(MOE, num_moe_experts=0, moe_router_topk=2), moe=False)
    attention_and_norms = with_experts - routed - 2 * 4 * 8 * shapes.tokens - 2 * e * h * shapes.tokens
    assert attention_and_norms == pytest.approx(dense_mlp - (2 * e * h + 3 * e * 2048) * shapes.tokens)


def test_linear_proj_keeps_its_own_fp8_copy_only_under_delayed_scaling():
    shapes, delayed = _bytes(precision="fp8", fp8_recipe="delayed")
    _, tensorwise = _bytes(precision="fp8", fp8_recipe="tensorwise")
    assert delayed - tensorwise == pytest.approx(shapes.tokens * shapes.attention_out_size)


def test_qk_layernorm_keeps_the_pre_norm_queries_and_keys():
    shapes, plain = _bytes()
    _, normed = _bytes(replace(MOE, qk_layernorm=True))
    assert normed - plain == pytest.approx(2 * shapes.tokens * (shapes.query_size + shapes.kv_size))


def test_offloaded_modules_leave_the_gpu():
    shapes, kept = _bytes()
    e, h, q = 2, 1024, shapes.query_size

    def offloaded(*modules):
        return kept - _bytes(features=RuntimeFeatures(fine_grained_activation_offloading=True,
                                                      offload_modules=modules))[1]
    assert offloaded("expert_fc1") == pytest.approx(shapes.expert_tokens * e * h)
    assert offloaded("moe_act") == pytest.approx(shapes.expert_tokens * 2 * e * 512)
    qkv = shapes.tokens * e * (q + 2 * shapes.kv_size)
    assert offloaded("core_attn") == pytest.approx(qkv)  # linear_proj still holds the attention output
    assert offloaded("core_attn", "attn_proj") == pytest.approx(qkv + shapes.tokens * e * q)
    assert offloaded("attn_norm") == 0  # fused into linear_qkv with grouped-query attention
    assert offloaded("qkv_linear") == pytest.approx(2 * shapes.tokens * e * h)
    assert offloaded("mlp_norm") == pytest.approx(shapes.tokens * e * h)


def test_layernorm_recompute_reruns_only_separate_norms():
    """With grouped-query attention the input norm is fused into linear_qkv (megatron-core's TE layer spec), so
    recompute_modules layernorm drops only the MoE layer's pre-MLP norm output (the router's input)."""
    shapes, kept = _bytes(recompute_granularity=Recompute.selective)
    features = RuntimeFeatures(recompute_modules=("layernorm",))
    _, recomputed = _bytes(features=features, recompute_granularity=Recompute.selective)
    assert kept - recomputed == pytest.approx(shapes.tokens * 2 * 1024)
