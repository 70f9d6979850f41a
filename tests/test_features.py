"""MoE runtime features: requirements, the MoE layer's parts, the search over free features, and emission."""

from __future__ import annotations

import dataclasses
import math

import pytest

from megapipe.config import compose, to_scenario
from megapipe.cost import layer_costs
from megapipe.cost.kernels import grouped_gemm_ms
from megapipe.cost.moe import dispatch_ms, expected_reach
from megapipe.cost.shapes import forced_balance_imbalance, shapes_of
from megapipe.cost.timing import Device
from megapipe.cost.comm import p2p_link, tensor_parallel_link
from megapipe.emit.moe import feature_config, megatron_moe_args
from megapipe.features import feature_problem, feature_variants
from megapipe.records import TIME_PARTS, ParallelSpec, Recompute, RuntimeFeatures, RuntimeSpec, TrainSpec


def _scenario(*overrides):
    return to_scenario(compose(list(overrides)))


@pytest.fixture(scope="module")
def qwen():
    return _scenario("model=qwen3_235b_a22b", "cluster.num_nodes=32", "parallel.tensor_model_parallel_size=2",
                     "parallel.pipeline_model_parallel_size=8", "parallel.virtual_pipeline_model_parallel_size=4",
                     "parallel.expert_model_parallel_size=32", "parallel.expert_tensor_parallel_size=1",
                     "train.seq_length=4096", "train.micro_batch_size=1", "train.global_batch_size=2048",
                     "train.moe_load_imbalance=1.0")


def _layer(scenario, **features):
    parallel = dataclasses.replace(scenario.parallel,
                                   features=dataclasses.replace(scenario.parallel.features, **features))
    profile = layer_costs(model=scenario.model, gpu=scenario.cluster.gpu, cluster=scenario.cluster, parallel=parallel,
                          train=scenario.train)
    return profile.layers[1]


def _part(layer, name):
    return layer.parts[TIME_PARTS.index(name)]


# -- requirements ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("features, parallel, fragment", [
    (dict(overlap_moe_expert_parallel_comm=True), dict(pipeline_model_parallel_size=4,
                                                       expert_model_parallel_size=8), "interleaving"),
    (dict(overlap_moe_expert_parallel_comm=True), dict(expert_model_parallel_size=1), "expert_model_parallel_size > 1"),
    (dict(overlap_moe_expert_parallel_comm=True, moe_shared_expert_overlap=True),
     dict(expert_model_parallel_size=8, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2),
     "exclude each other"),
    (dict(delay_wgrad_compute=True), dict(expert_model_parallel_size=8), "needs overlap_moe_expert_parallel_comm"),
    (dict(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="nccl"), dict(expert_model_parallel_size=8),
     "deepep or hybridep"),
    (dict(moe_token_dispatcher_type="flex"), dict(expert_model_parallel_size=1), "TP x EP > 1"),
    (dict(cuda_graph_impl="transformer_engine", cuda_graph_scope=("moe",)), dict(expert_model_parallel_size=8),
     "drop-and-pad"),
    (dict(cuda_graph_impl="transformer_engine", cuda_graph_scope=("moe_preprocess",)),
     dict(expert_model_parallel_size=8), "needs moe_router"),
    (dict(cuda_graph_impl="transformer_engine"), dict(expert_model_parallel_size=8), "cuda_graph_scope=[attn"),
    (dict(cuda_graph_impl="local", cuda_graph_scope=("full_iteration",)), dict(expert_model_parallel_size=8),
     "dropless"),
    (dict(moe_router_padding_for_quantization=True), dict(expert_model_parallel_size=8), "needs FP8"),
    (dict(recompute_modules=("mla_up_proj",)), dict(expert_model_parallel_size=8), "multi-latent attention"),
    (dict(recompute_modules=("everything",)), dict(expert_model_parallel_size=8), "recompute_modules holds"),
])
def test_each_requirement_is_one_line_naming_the_fix(features, parallel, fragment):
    model = _scenario("model=deepseek_v3" if features.get("moe_shared_expert_overlap") else "model=mixtral_8x7b").model
    train = TrainSpec(recompute_granularity=Recompute.selective)
    problem = feature_problem(RuntimeFeatures(**features), model=model, parallel=ParallelSpec(**parallel), train=train)
    assert problem is not None and fragment in problem and "\n" not in problem


def test_dense_models_refuse_moe_features_and_accept_the_defaults():
    model = _scenario("model=llama3_8b").model
    assert feature_problem(RuntimeFeatures(), model=model, parallel=ParallelSpec(), train=TrainSpec()) is None
    problem = feature_problem(RuntimeFeatures(moe_permute_fusion=True), model=model, parallel=ParallelSpec(),
                              train=TrainSpec())
    assert "need a MoE model" in problem


def test_fast_public_combinations_are_accepted():
    """What Megatron-Bridge's performance recipes run (DeepSeek-V3 on GB200, Qwen3-30B on H100)."""
    model = _scenario("model=deepseek_v3").model
    features = RuntimeFeatures(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="hybridep",
                               overlap_moe_expert_parallel_comm=True, delay_wgrad_compute=True, moe_permute_fusion=True,
                               moe_router_fusion=True, cuda_graph_impl="transformer_engine",
                               cuda_graph_scope=("attn", "moe_router", "moe_preprocess"),
                               recompute_modules=("mla_up_proj",), moe_router_force_load_balancing=True)
    parallel = ParallelSpec(pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=4,
                            expert_model_parallel_size=64)
    train = TrainSpec(recompute_granularity=Recompute.selective, precision="fp8", fp8_recipe="mxfp8")
    assert feature_problem(features, model=model, parallel=parallel, train=train) is None


def test_the_cli_refuses_an_impossible_feature_in_one_line(tmp_path, capsys):
    from megapipe.cli import main

    code = main(["plan", "model=mixtral_8x7b", "parallel.overlap_moe_expert_parallel_comm=true",
                 "parallel.pipeline_model_parallel_size=4", "parallel.virtual_pipeline_model_parallel_size=1",
                 "parallel.expert_model_parallel_size=8", "schedule=1f1b", f"output.dir={tmp_path}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "interleaving" in err


# -- the MoE layer's parts --------------------------------------------------------------------------------------

def test_expected_reach_bounds_and_group_limited_routing():
    assert expected_reach(bins=8, experts=64, topk=1) == pytest.approx(1.0)
    for bins in (2, 4, 8, 16, 32):
        reach = expected_reach(bins=bins, experts=256, topk=8)
        assert 1.0 <= reach <= min(bins, 8)
    # DeepSeek-V3 over 8 nodes: 8 groups, 4 chosen, so a token reaches at most 4 nodes (random top-8: about 5.3)
    limited = expected_reach(bins=8, experts=256, topk=8, groups=8, group_topk=4)
    assert limited == pytest.approx(4.0) and expected_reach(bins=8, experts=256, topk=8) > 5.0


def _device(scenario):
    parallel = scenario.parallel
    return Device(gpu=scenario.cluster.gpu, runtime=scenario.cluster.runtime, tp_comm_overlap=False,
                  cluster=scenario.cluster,
                  link=tensor_parallel_link(cluster=scenario.cluster,
                                            tensor_model_parallel_size=parallel.tensor_model_parallel_size),
                  cp_link=p2p_link(cluster=scenario.cluster, span=2))


def test_deepep_sends_one_copy_per_node_so_it_beats_alltoall_across_nodes(qwen):
    device = _device(qwen)

    def comm(dispatcher, backend="deepep"):
        parallel = dataclasses.replace(qwen.parallel, features=RuntimeFeatures(
            moe_token_dispatcher_type=dispatcher, moe_flex_dispatcher_backend=backend))
        shapes = shapes_of(model=qwen.model, parallel=parallel, train=qwen.train)
        one = dispatch_ms(shapes, device)
        return one.dispatch_ms + one.combine_ms

    # EP32 spans 4 nodes: NCCL sends each of the 8 copies, DeepEP one per destination node (about 3.3)
    assert comm("flex") < 0.6 * comm("alltoall")
    assert comm("flex", "hybridep") < 0.6 * comm("alltoall")


def test_each_feature_moves_time_the_way_its_mechanism_says(qwen):
    base = _layer(qwen, moe_token_dispatcher_type="alltoall")
    fused = _layer(qwen, moe_token_dispatcher_type="alltoall", moe_permute_fusion=True, moe_router_fusion=True)
    assert _part(fused, "memory_bound") < _part(base, "memory_bound")
    overlap = _layer(qwen, moe_token_dispatcher_type="alltoall", overlap_moe_expert_parallel_comm=True)
    assert 0 < _part(overlap, "ep_comm") < _part(base, "ep_comm")  # hidden under the other microbatch, not below 0
    delayed = _layer(qwen, moe_token_dispatcher_type="alltoall", overlap_moe_expert_parallel_comm=True,
                     delay_wgrad_compute=True)
    assert _part(delayed, "ep_comm") <= _part(overlap, "ep_comm")
    # CUDA graphs remove launches, never GPU work
    slow_host = dataclasses.replace(qwen, cluster=dataclasses.replace(
        qwen.cluster, runtime=dataclasses.replace(qwen.cluster.runtime, host_kernel_us=200.0)))
    eager = _layer(slow_host)
    graphed = _layer(slow_host, cuda_graph_impl="transformer_engine",
                     cuda_graph_scope=("attn", "moe_router", "moe_preprocess"))
    assert _part(graphed, "host") < _part(eager, "host")
    assert _part(graphed, "gemm") == _part(eager, "gemm")


def test_forced_balance_is_near_one_and_dropless_routing_costs_more(qwen):
    assert forced_balance_imbalance(assignments=16384, ranks=32) == pytest.approx(1 + math.sqrt(2 * math.log(32) / 16384))
    assert forced_balance_imbalance(assignments=16384, ranks=1) == 1.0
    balanced = _layer(qwen, moe_router_force_load_balancing=True)
    skewed = _layer(dataclasses.replace(qwen, train=dataclasses.replace(qwen.train, moe_load_imbalance=1.4)))
    assert skewed.fwd_ms > balanced.fwd_ms


def test_grouped_gemm_reproduces_deepgemm_small_m_roll_off():
    """DeepGEMM's published H800 FP8 table (README at 327ec92f): the grouped-GEMM model within 15% on each row."""
    gpu = _scenario("cluster=h100_80gb").cluster.gpu
    gpu = dataclasses.replace(gpu, fp8_matmul_efficiency=0.7)
    table = [(4, 256, 4096, 7168, 932), (2, 512, 4096, 7168, 1040), (4, 8192, 4096, 7168, 1346),
             (8, 4096, 7168, 2048, 1214), (4, 256, 7168, 2048, 815)]
    for groups, m, n, k, tflops in table:
        ms = grouped_gemm_ms(m=m, n=n, k=k, groups=groups, dtype="fp8", gpu=gpu)
        achieved = 2 * groups * m * n * k / (ms * 1e-3) / 1e12
        assert achieved == pytest.approx(tflops, rel=0.15)
    # the rate climbs with the tokens each expert gets
    rates = [2 * 8 * m * 4096 * 7168 / grouped_gemm_ms(m=m, n=4096, k=7168, groups=8, dtype="fp8", gpu=gpu)
             for m in (64, 256, 1024, 4096)]
    assert rates == sorted(rates)


def test_recompute_modules_trade_memory_for_time(qwen):
    selective = dataclasses.replace(qwen, train=dataclasses.replace(qwen.train,
                                                                  recompute_granularity=Recompute.selective))
    plain = _layer(selective, recompute_modules=("core_attn",))
    act = _layer(selective, recompute_modules=("moe_act", "layernorm"))
    assert act.act_bytes < plain.act_bytes and _part(act, "recompute") > 0


# -- search and emission ----------------------------------------------------------------------------------------

def test_free_features_are_searched_and_given_ones_kept():
    model = _scenario("model=mixtral_8x7b").model
    free = feature_variants(RuntimeFeatures(), model=model, free=frozenset(
        ("moe_token_dispatcher_type", "overlap_moe_expert_parallel_comm", "cuda_graph_scope")))
    assert {f.dispatcher for f in free} == {"alltoall", "deepep", "hybridep"}
    assert {f.overlap_moe_expert_parallel_comm for f in free} == {False, True}
    assert {f.cuda_graphs for f in free} == {False, True}
    pinned = feature_variants(RuntimeFeatures(moe_token_dispatcher_type="alltoall"), model=model,
                              free=frozenset(("cuda_graph_scope",)))
    assert {f.dispatcher for f in pinned} == {"alltoall"} and len(pinned) == 2
    dense = _scenario("model=llama3_8b").model
    assert feature_variants(RuntimeFeatures(), model=dense, free=frozenset(("cuda_graph_scope",))) == (RuntimeFeatures(),)


def test_plan_prints_the_moe_runtime_it_chose(tmp_path, capsys):
    from megapipe.cli import main

    code = main(["plan", "model=qwen3_30b_a3b", "cluster.num_nodes=2", f"output.dir={tmp_path}",
                 "output.pictures=false"])
    out = capsys.readouterr().out
    assert code == 0
    assert "MoE runtime: dispatcher" in out and "routing:" in out and "not modelled:" in out
    assert "--moe-token-dispatcher-type" in (tmp_path / "megatron_args.txt").read_text()


def test_emission_spells_every_feature_in_megatron_names():
    model = _scenario("model=deepseek_v3").model
    features = RuntimeFeatures(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="deepep",
                               overlap_moe_expert_parallel_comm=True, delay_wgrad_compute=True, moe_permute_fusion=True,
                               moe_router_fusion=True, cuda_graph_impl="transformer_engine",
                               cuda_graph_scope=("attn", "moe_router", "moe_preprocess"),
                               recompute_modules=("mla_up_proj", "moe_act"), moe_router_force_load_balancing=True)
    parallel = ParallelSpec(pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=4,
                            expert_model_parallel_size=64, features=features)
    train = TrainSpec(recompute_granularity=Recompute.selective)
    args = " ".join(megatron_moe_args(model, parallel, train))
    for flag in ("--moe-token-dispatcher-type flex", "--moe-flex-dispatcher-backend deepep", "--moe-router-dtype fp32",
                 "--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute", "--moe-permute-fusion",
                 "--moe-router-fusion", "--cuda-graph-impl transformer_engine",
                 "--cuda-graph-scope attn moe_router moe_preprocess", "--te-rng-tracker",
                 "--recompute-modules mla_up_proj moe_act", "--moe-router-force-load-balancing"):
        assert flag in args
    assert feature_config(model, parallel, train)["recompute_modules"] == ["mla_up_proj", "moe_act"]


def test_feature_keys_are_transformer_config_fields_of_megatron_core():
    """Every TransformerConfig key emit writes for the features is a field of megatron-core's own config."""
    pytest.importorskip("megatron.core")
    import dataclasses as dc

    from megatron.core.transformer.transformer_config import TransformerConfig

    names = {field.name for field in dc.fields(TransformerConfig)}
    model = _scenario("model=deepseek_v3").model
    features = RuntimeFeatures(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="hybridep",
                               moe_permute_fusion=True, moe_router_fusion=True, cuda_graph_impl="transformer_engine",
                               cuda_graph_scope=("attn",), moe_router_force_load_balancing=True,
                               moe_router_padding_for_quantization=True, moe_shared_expert_overlap=True)
    parallel = ParallelSpec(expert_model_parallel_size=8, features=features)
    keys = feature_config(model, parallel, TrainSpec(recompute_granularity=Recompute.selective))
    assert set(keys) - names == set()
    for key in ("overlap_moe_expert_parallel_comm", "delay_wgrad_compute"):
        assert key in names


@pytest.mark.parametrize("overrides, match", [
    (["train.fine_grained_activation_offloading=true"], "go together"),
    (["train.offload_modules=[expert_fc1]"], "go together"),
    (["train.fine_grained_activation_offloading=true", "train.offload_modules=[attn_proj]"], "core_attn too"),
    (["train.fine_grained_activation_offloading=true", "train.offload_modules=[rope]"], "offload_modules holds"),
    (["model=llama3_8b", "train.fine_grained_activation_offloading=true", "train.offload_modules=[moe_act]"],
     "no experts"),
])
def test_fine_grained_activation_offloading_as_megatron_core_checks_it(overrides, match):
    from megapipe.errors import ConfigError

    with pytest.raises(ConfigError, match=match):
        _scenario("model=mixtral_8x7b", "parallel.tensor_model_parallel_size=1",
                  "parallel.pipeline_model_parallel_size=1", *overrides)


def test_offload_modules_reach_the_features_and_the_emitted_config():
    scenario = _scenario("model=mixtral_8x7b", "parallel.tensor_model_parallel_size=1",
                         "parallel.pipeline_model_parallel_size=1", "train.fine_grained_activation_offloading=true",
                         "train.offload_modules=[expert_fc1,moe_act]")
    features = scenario.parallel.features
    assert features.fine_grained_activation_offloading and features.offload_modules == ("expert_fc1", "moe_act")
    settings = feature_config(scenario.model, scenario.parallel, scenario.train)
    assert settings["offload_modules"] == ["expert_fc1", "moe_act"]


def test_feature_verdicts_read_only_the_problem_sizes():
    """feature_problem refuses or accepts every searched feature set alike at all parallel sizes that agree on
    problem_sizes (what the search decides once per), with and without MTP, at each recompute setting."""
    import itertools

    from megapipe.features import problem_sizes

    for name in ("deepseek_v3", "qwen3_30b_a3b"):
        model = _scenario(f"model={name}").model
        template = dataclasses.replace(RuntimeFeatures(), moe_permute_fusion=True, moe_router_fusion=True)
        variants = feature_variants(template, model=model, free=frozenset(("moe_token_dispatcher_type",
                                                                          "overlap_moe_expert_parallel_comm",
                                                                          "cuda_graph_scope")))
        assert len(variants) > 6
        verdicts: dict[tuple, tuple] = {}
        for tp, pp, vp, ep, recompute in itertools.product((1, 2, 8), (1, 2, 3, 16), (1, 2, 3, 7), (1, 2, 8, 64),
                                                           tuple(Recompute)):
            parallel = ParallelSpec(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                    virtual_pipeline_model_parallel_size=vp, expert_model_parallel_size=ep)
            train = TrainSpec(recompute_granularity=recompute)
            verdict = tuple(feature_problem(features, model=model, parallel=parallel, train=train) is None
                            for features in variants)
            key = problem_sizes(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                virtual_pipeline_model_parallel_size=vp, expert_model_parallel_size=ep) + (recompute,)
            assert verdicts.setdefault(key, verdict) == verdict, (name, tp, pp, vp, ep, recompute)
        assert len(set(verdicts.values())) > 3
