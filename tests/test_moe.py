"""Mixture-of-experts, MLA and MTP: parameters, FLOPs, memory, config, search, layout and emission."""

from __future__ import annotations

import dataclasses
import json

import pytest

from megapipe.config import compose, to_scenario
from megapipe.cost import active_parameter_count, model_flops_per_token, parameter_count
from megapipe.errors import ConfigError

PRESETS = ("deepseek_v3", "qwen3_30b_a3b", "qwen3_235b_a22b", "gpt_oss_120b", "mixtral_8x7b", "mixtral_8x22b",
           "llama4_scout")


def _model(name: str, *overrides: str):
    return to_scenario(compose([f"model={name}", *overrides])).model


def _within_published(count: float, published_b: float, digits: int) -> bool:
    """Within 1% of a published figure, plus half a unit of its last printed digit (37B is 36.5..37.5B)."""
    tolerance = 0.01 * published_b + 0.5 * 10.0 ** -digits
    return abs(count / 1e9 - published_b) <= tolerance


# (total, digits, active, digits, active counts embedding?) as each model's publisher states them:
# DeepSeek-V3 README (671B total without the 14B MTP module; 37B activated) and README_WEIGHTS (36.7B
# activated, embedding excluded); Qwen3 technical report Table 1 (30.5B/3.3B, 235B/22B); GPT-OSS model card
# (116.83B/5.13B, embedding excluded); Mistral's Mixtral announcements (46.7B/12.9B, 141B/39B); Llama 4
# model card (109B/17B; the 109B includes the ~1B vision encoder megapipe does not plan).
PUBLISHED = {
    "deepseek_v3": (671, 0, 36.7, 1, False),
    "qwen3_30b_a3b": (30.5, 1, 3.3, 1, True),
    "qwen3_235b_a22b": (235, 0, 22, 0, True),
    "gpt_oss_120b": (116.83, 2, 5.13, 2, False),
    "mixtral_8x7b": (46.7, 1, 12.9, 1, True),
    "mixtral_8x22b": (141, 0, 39, 0, True),
    "llama4_scout": (109, 0, 17, 0, True),
}
SCOUT_VISION_B = (34 * (4 * 1408**2 + 2 * 1408 * 5632)  # vision_config: 34 layers of width 1408, MLP 5632
                  + 14 * 14 * 3 * 1408  # 14 x 14 patch embedding
                  + 1408 * 5120) / 1e9  # projector to the text width
"""Llama 4 Scout's vision encoder from its config.json vision_config (weights only, norms and biases aside):
about 0.82B, added to the text count for the 109B total."""


@pytest.mark.parametrize("name", PRESETS)
def test_parameters_match_the_published_totals_and_active_counts(name):
    total_b, total_digits, active_b, active_digits, with_embedding = PUBLISHED[name]
    model = _model(name)
    total = parameter_count(model, mtp=False) + (SCOUT_VISION_B * 1e9 if name == "llama4_scout" else 0.0)
    active = active_parameter_count(model, embedding=with_embedding)
    assert _within_published(total, total_b, total_digits), (name, total / 1e9)
    assert _within_published(active, active_b, active_digits), (name, active / 1e9)


def test_deepseek_v3_counts_exactly():
    """671,026,404,352 = the sum of DeepSeek-V3's safetensors shapes without the MTP module (layer 61)."""
    model = _model("deepseek_v3")
    assert parameter_count(model, mtp=False) == 671_026_404_352
    assert parameter_count(model) > parameter_count(model, mtp=False) + 11e9  # the MTP block: 11.5B own weights


# Megatron-LM's num_floating_point_operations(args, 1) / seq_length, evaluated on Megatron-LM core_v0.16.1,
# core_v0.19.0 and main by scripts/check_megatron_flops.py (identical at all three).
MEGATRON_FLOPS_PER_TOKEN = {
    "deepseek_v3": 259_992_950_784.0,
    "qwen3_30b_a3b": 23_006_281_728.0,
    "qwen3_235b_a22b": 148_034_813_952.0,
    "gpt_oss_120b": 34_330_853_376.0,
    "mixtral_8x7b": 79_706_456_064.0,
    "mixtral_8x22b": 242_167_578_624.0,
    "llama4_scout": 108_885_442_560.0,
}


@pytest.mark.parametrize("name", PRESETS)
def test_flops_are_counted_as_megatron_counts_them(name):
    model = _model(name)
    assert model_flops_per_token(model, model.seq_length) == pytest.approx(MEGATRON_FLOPS_PER_TOKEN[name], rel=1e-12)


def test_flops_follow_the_dense_and_moe_layer_pattern():
    """Each MoE layer made dense changes the count by the two MLPs' GEMMs (Megatron-LM does not count the
    router). DeepSeek-V3 is built so that they match: 8 routed + 1 shared expert of 2048 = one dense 18432."""
    model = _model("qwen3_30b_a3b")
    three_dense = dataclasses.replace(model, moe_layer_freq=(0,) * 3 + (1,) * (model.num_layers - 3))
    h = model.hidden_size
    dense_mlp = 3 * h * model.ffn_hidden_size
    moe_mlp = 3 * h * model.moe_ffn_hidden_size * model.moe_router_topk
    per_layer = 6 * (dense_mlp - moe_mlp)
    assert model_flops_per_token(three_dense, 4096) - model_flops_per_token(model, 4096) == pytest.approx(3 * per_layer)
    dsv3 = _model("deepseek_v3")
    all_moe = dataclasses.replace(dsv3, moe_layer_freq=(1,) * dsv3.num_layers)
    assert model_flops_per_token(all_moe, 4096) == model_flops_per_token(dsv3, 4096)
    h, e = 7168, 2048  # each of the 3 layers: 256 routed experts, a router, and the shared expert for the dense MLP
    per_layer = 256 * 3 * h * e + 256 * h - 3 * h * (18432 - e)
    assert parameter_count(all_moe) - parameter_count(dsv3) == pytest.approx(3 * per_layer, rel=1e-6)


# -- Hugging Face import -------------------------------------------------------------------------------------
HF_CONFIGS = {
    "deepseek_v3": {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
        "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
        "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
        "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4,
        "num_experts_per_tok": 8, "moe_layer_freq": 1, "first_k_dense_replace": 3, "norm_topk_prob": True,
        "scoring_func": "sigmoid", "hidden_act": "silu", "max_position_embeddings": 163840, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False, "rope_theta": 10000, "vocab_size": 129280, "num_nextn_predict_layers": 1,
    },
    "qwen3_235b_a22b": {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 4096,
        "intermediate_size": 12288, "moe_intermediate_size": 1536, "num_hidden_layers": 94,
        "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
        "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True,
        "hidden_act": "silu", "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "tie_word_embeddings": False, "vocab_size": 151936,
    },
    "mixtral_8x7b": {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "num_local_experts": 8, "num_experts_per_tok": 2, "hidden_act": "silu", "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-5, "rope_theta": 1e6, "tie_word_embeddings": False, "vocab_size": 32000,
    },
    "gpt_oss_120b": {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 2880,
        "intermediate_size": 2880, "num_hidden_layers": 36, "num_attention_heads": 64, "num_key_value_heads": 8,
        "head_dim": 64, "num_local_experts": 128, "experts_per_token": 4, "hidden_act": "silu",
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 150000, "sliding_window": 128,
        "tie_word_embeddings": False, "vocab_size": 201088, "attention_bias": True,
    },
    "llama4_scout": {
        "architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4",
        "text_config": {
            "model_type": "llama4_text", "hidden_size": 5120, "intermediate_size": 8192,
            "intermediate_size_mlp": 16384, "num_hidden_layers": 48, "num_attention_heads": 40,
            "num_key_value_heads": 8, "head_dim": 128, "num_local_experts": 16, "num_experts_per_tok": 1,
            "interleave_moe_layer_step": 1, "hidden_act": "silu", "max_position_embeddings": 10485760,
            "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False, "vocab_size": 202048,
        },
    },
}


@pytest.mark.parametrize("name", sorted(HF_CONFIGS))
def test_hugging_face_import_gives_the_presets_parameters(name, tmp_path):
    """config.json of each family (DeepseekV3, Qwen3Moe, Mixtral, GptOss, Llama4 keys) imports to the same
    parameters, FLOPs and layer pattern as the hand-written preset."""
    path = tmp_path / name / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(HF_CONFIGS[name]))
    imported = _model("hf", f"model.config_path={path}", "train.seq_length=4096")
    preset = _model(name)
    assert imported.moe_layers == preset.moe_layers
    assert (imported.num_moe_experts, imported.moe_router_topk) == (preset.num_moe_experts, preset.moe_router_topk)
    assert parameter_count(imported) == parameter_count(preset)
    assert active_parameter_count(imported) == active_parameter_count(preset)
    assert model_flops_per_token(imported, 4096) == model_flops_per_token(preset, 4096)


def test_first_k_dense_and_int_moe_layer_freq():
    """Megatron's int moe_layer_freq N makes layer i MoE where i % N == 0; a list is taken as written."""
    assert _model("deepseek_v3").moe_layers == (False,) * 3 + (True,) * 58
    every_other = _model("mixtral_8x7b", "model.moe_layer_freq=2").moe_layers
    assert every_other == tuple(i % 2 == 0 for i in range(32))
    with pytest.raises(ConfigError, match="moe_layer_freq"):
        _model("mixtral_8x7b", "model.moe_layer_freq=[1,0,1]")  # 3 entries for 32 layers


# -- parallel sizes -------------------------------------------------------------------------------------------
def _scenario(*overrides: str):
    return to_scenario(compose(list(overrides)))


def test_expert_parallel_divisibility_is_refused_with_the_fix():
    with pytest.raises(ConfigError, match=r"expert_model_parallel_size=3 does not divide .*use one of \[1, 2, 4, 8\]"):
        _scenario("model=mixtral_8x7b", "parallel.expert_model_parallel_size=3", "parallel.tensor_model_parallel_size=1",
                  "parallel.pipeline_model_parallel_size=1")
    with pytest.raises(ConfigError, match="expert_model_parallel_size"):  # dense model
        _scenario("model=llama3_8b", "parallel.expert_model_parallel_size=2")


def test_expert_parameters_shard_over_ep_etp_and_their_optimizer_over_expert_dp():
    from megapipe.cost.params import bytes_per_parameter
    from megapipe.records import ParallelSpec

    par = ParallelSpec(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, data_parallel_size=8,
                       expert_model_parallel_size=4, expert_tensor_parallel_size=1)
    assert par.expert_data_parallel_size == 2 * 8 // (4 * 1)  # the TP x DP ranks of a stage, over EP x ETP
    dense = bytes_per_parameter(precision="bf16", parallel=par)
    expert = bytes_per_parameter(precision="bf16", parallel=par, expert=True)
    # bf16 weight + fp32 grad (6 bytes) everywhere; 12 bytes of fp32 master and Adam moments over the DP group
    assert dense == pytest.approx(6 + 12 / 8)
    assert expert == pytest.approx(6 + 12 / 4)


def test_all_to_all_is_cheaper_inside_the_nvlink_domain():
    from megapipe.cost.comm import all_to_all_ms

    cluster = _scenario("cluster=h100_80gb").cluster
    num_bytes = 256 * 2**20
    inside = all_to_all_ms(num_bytes=num_bytes, group_size=8, cluster=cluster)
    across = all_to_all_ms(num_bytes=num_bytes, group_size=16, cluster=cluster)
    strided = all_to_all_ms(num_bytes=num_bytes, group_size=8, cluster=cluster, stride=2)  # 8 ranks on 2 nodes
    share = num_bytes / 8
    assert inside >= 7 * share / (cluster.intra_node.bandwidth_gbytes_per_s * 1e6)  # 7 peers' shares over NVLink
    assert across > 3 * inside and strided > 3 * inside
    assert all_to_all_ms(num_bytes=num_bytes, group_size=1, cluster=cluster) == 0.0


def test_search_enumerates_expert_parallel_with_sequence_parallel_forced():
    from megapipe.plan.space import enumerate_candidates

    scenario = _scenario("model=mixtral_8x7b", "cluster.num_nodes=4", "train.global_batch_size=256")
    space = enumerate_candidates(model=scenario.model, cluster=scenario.cluster, train=scenario.train,
                                 fixed=dict(scenario.fixed), template=scenario.parallel)
    candidates = [space.candidate(point) for point in space.points]
    eps = {c.parallel.expert_model_parallel_size for c in candidates}
    assert {1, 2, 4, 8} <= eps and max(eps) <= scenario.model.num_moe_experts
    for cand in candidates:
        par = cand.parallel
        assert scenario.model.num_moe_experts % par.expert_model_parallel_size == 0
        stage = par.tensor_model_parallel_size * par.data_parallel_size * par.context_parallel_size
        assert stage % (par.expert_model_parallel_size * par.expert_tp) == 0  # EP folds into the stage's ranks
        if par.tensor_model_parallel_size > 1:
            assert par.sequence_parallel  # megatron-core MoE with TP > 1 needs SP


def test_dispatcher_buffers_scale_with_tokens_and_warn_past_the_reserve():
    from megapipe.cost.memory import dispatcher_transient_bytes
    from megapipe.plan.warnings import plan_warnings
    from megapipe.records import ParallelSpec, TrainSpec

    scenario = _scenario("model=deepseek_v3")
    par = ParallelSpec(tensor_model_parallel_size=1, pipeline_model_parallel_size=16, data_parallel_size=8,
                       expert_model_parallel_size=8)
    one = dispatcher_transient_bytes(model=scenario.model, parallel=par, train=TrainSpec(micro_batch_size=1, seq_length=4096))
    four = dispatcher_transient_bytes(model=scenario.model, parallel=par, train=TrainSpec(micro_batch_size=4, seq_length=4096))
    from megapipe.cost.shapes import forced_balance_imbalance

    spread = forced_balance_imbalance(assignments=4096 * 8, ranks=8)  # random routing's busiest of 8 ranks
    assert one == pytest.approx(2 * 4096 * 8 * 7168 * 2 * spread)  # send + receive of 4096 tokens x top-8, bf16
    assert four == pytest.approx(4 * one * forced_balance_imbalance(assignments=4 * 4096 * 8, ranks=8) / spread)
    assert dispatcher_transient_bytes(model=_model("llama3_8b"), parallel=ParallelSpec(), train=TrainSpec()) == 0.0
    quiet = plan_warnings(parallel=par, train=TrainSpec(), cluster=scenario.cluster, bubble_fraction=0.1,
                          num_microbatches=8, dispatcher_bytes=one)
    loud = plan_warnings(parallel=par, train=TrainSpec(), cluster=scenario.cluster, bubble_fraction=0.1,
                         num_microbatches=8, dispatcher_bytes=four * 4)
    assert not any("dispatch" in w for w in quiet) and any("MoE token dispatch" in w for w in loud)


def test_load_imbalance_is_stated_and_slows_the_experts():
    from megapipe.cost.layers import layer_costs
    from megapipe.records import ParallelSpec

    scenario = _scenario("model=qwen3_30b_a3b")
    par = ParallelSpec(tensor_model_parallel_size=1, pipeline_model_parallel_size=4, data_parallel_size=8,
                       expert_model_parallel_size=8)

    def moe_layer(imbalance: float):
        train = dataclasses.replace(scenario.train, moe_load_imbalance=imbalance)
        return layer_costs(model=scenario.model, gpu=scenario.cluster.gpu, cluster=scenario.cluster, parallel=par,
                           train=train).layers[1]

    from megapipe.records import TIME_PARTS

    balanced, skewed = moe_layer(1.0), moe_layer(1.5)
    gemm = TIME_PARTS.index("gemm")  # a layer this small may wait on the host; its GEMMs do not
    assert skewed.parts[gemm] > balanced.parts[gemm] and skewed.fwd_ms >= balanced.fwd_ms
    assert skewed.act_bytes > balanced.act_bytes
    assert skewed.static_bytes == balanced.static_bytes
    with pytest.raises(ConfigError, match="moe_load_imbalance"):
        _scenario("model=qwen3_30b_a3b", "train.moe_load_imbalance=0.5")


# -- layouts with MTP ----------------------------------------------------------------------------------------
def test_mtp_placement_follows_megatron_rules():
    from megapipe.layout import mtp_problem, mtp_standalone, parse_layout

    def problem(layout: str, pp: int):
        return mtp_problem(parse_layout(layout), pipeline_model_parallel_size=pp)

    assert problem("Et*3|(tt|)*29,m|L".replace("(tt|)*29,", "tt|" * 29), 32) is None  # DeepSeek-V3's own
    assert problem("Et*4|t*4mL", 2) is None
    assert "after" in problem("Et*4|tmt*3L", 2)  # a decoder after m
    assert problem("Et*3|t*3|m|L", 2) is not None  # m on the first rank (vp 1 of rank 0)
    assert mtp_standalone(parse_layout("Et*4|t*4m|L"), pipeline_model_parallel_size=3)
    assert not mtp_standalone(parse_layout("Et*4|t*4mL"), pipeline_model_parallel_size=2)


def test_solver_keeps_mtp_where_megatron_builds_it():
    """The exact solver's layouts for DeepSeek-V3 satisfy the MTP rules at every depth."""
    from megapipe.cost.layers import layer_costs
    from megapipe.layout import mtp_problem, parse_layout
    from megapipe.partition import StageSpec, solve
    from megapipe.records import ParallelSpec

    scenario = _scenario("model=deepseek_v3")
    for pp, vp in ((4, 1), (8, 1), (4, 2), (8, 4)):
        par = ParallelSpec(tensor_model_parallel_size=8, pipeline_model_parallel_size=pp, data_parallel_size=16,
                           sequence_parallel=True, virtual_pipeline_model_parallel_size=vp, expert_model_parallel_size=16)
        profile = layer_costs(model=scenario.model, gpu=scenario.cluster.gpu, cluster=scenario.cluster, parallel=par,
                              train=scenario.train)
        part = solve(profile, [StageSpec()] * pp, num_microbatches=32, check_memory=False,
                     schedule="interleaved_1f1b" if vp > 1 else "1f1b", virtual_pipeline_model_parallel_size=vp)
        assert mtp_problem(parse_layout(part.layout), pipeline_model_parallel_size=pp) is None, part.layout
        assert part.layout.count("m") == 1 and part.layout.endswith("L")


# -- emission -------------------------------------------------------------------------------------------------
def _plan_dir(tmp_path, *overrides: str):
    from megapipe.cli import main

    out = tmp_path / "plan"
    code = main(["plan", *overrides, f"output.dir={out}"])
    assert code in (0, None)
    return out


@pytest.fixture(scope="module")
def dsv3_dir(tmp_path_factory):
    return _plan_dir(tmp_path_factory.mktemp("dsv3"), "model=deepseek_v3", "cluster.num_nodes=32",
                     "train.global_batch_size=1024", "parallel.tensor_model_parallel_size=1",
                     "parallel.pipeline_model_parallel_size=16", "parallel.expert_model_parallel_size=16",
                     "parallel.moe_token_dispatcher_type=alltoall")  # a pinned feature stays as given


def test_megatron_arguments_carry_the_experts_mla_and_mtp(dsv3_dir):
    args = (dsv3_dir / "megatron_args.txt").read_text()
    for flag in ("--num-experts 256", "--moe-router-topk 8", "--moe-ffn-hidden-size 2048",
                 "--moe-shared-expert-intermediate-size 2048", "--moe-layer-freq '([0]*3+[1]*58)'",
                 "--expert-model-parallel-size 16", "--expert-tensor-parallel-size 1",
                 "--moe-token-dispatcher-type alltoall", "--multi-latent-attention", "--q-lora-rank 1536",
                 "--kv-lora-rank 512", "--qk-head-dim 128", "--qk-pos-emb-head-dim 64", "--v-head-dim 128",
                 "--mtp-num-layers 1", "--moe-router-enable-expert-bias", "--moe-grouped-gemm"):
        assert flag in args, flag
    assert "--group-query-attention" not in args
    layout = args.split("--pipeline-model-parallel-layout ")[1].split()[0].strip("'")
    assert "m" in layout and layout.endswith("L")


def test_bridge_and_nemo_keys_carry_the_experts(dsv3_dir):
    bridge = (dsv3_dir / "bridge_overrides.txt").read_text()
    nemo2 = (dsv3_dir / "nemo2_overrides.txt").read_text()
    nemo1 = (dsv3_dir / "nemo1_overrides.txt").read_text()
    freq = "[" + ",".join(["0"] * 3 + ["1"] * 58) + "]"
    for key in ("model.num_moe_experts=256", "model.expert_model_parallel_size=16", "model.mtp_num_layers=1",
                "model.multi_latent_attention=true", f"model.moe_layer_freq={freq}"):
        assert key in bridge, key
    for key in ("trainer.strategy.expert_model_parallel_size=16", "model.config.num_moe_experts=256",
                "model.config.mtp_num_layers=1", f"model.config.moe_layer_freq={freq}"):
        assert key in nemo2, key
    assert "++model.num_moe_experts=256" in nemo1 and "mtp_num_layers" not in nemo1


def test_plan_yaml_records_the_expert_sizes(dsv3_dir):
    import yaml

    doc = yaml.safe_load((dsv3_dir / "plan.yaml").read_text())
    par = doc["best"]["parallel"]
    assert par["expert_model_parallel_size"] == 16 and par["expert_tensor_parallel_size"] == 1
    assert par["expert_data_parallel_size"] == 32 * 8 // 16 // 16 * 1  # stage ranks (DP 16) over EP 16: 1
    assert par["moe_token_dispatcher_type"] == "alltoall"
    from megapipe.records import MLA_MODEL_FIELDS, MOE_MODEL_FIELDS

    for section in (doc["model"], doc["inputs"]["model"]):  # a MoE model with MLA keeps both groups of fields
        assert set(MOE_MODEL_FIELDS) | set(MLA_MODEL_FIELDS) <= set(section)
    assert doc["model"]["num_moe_experts"] == 256 and doc["model"]["q_lora_rank"] == 1536


def test_features_not_modelled_are_warned_about_loudly(tmp_path):
    import yaml

    out = _plan_dir(tmp_path, "model=gpt_oss_120b", "cluster.num_nodes=8", "train.global_batch_size=256")
    warnings = yaml.safe_load((out / "plan.yaml").read_text())["emitted"]["warnings"]
    assert any(w.startswith("NOT EMITTED") and "sliding-window" in w for w in warnings)
    assert any("attention sinks" in w for w in warnings)
