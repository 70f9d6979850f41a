"""Hugging Face config.json files, written from the published ones, import to the published architectures.

Each fixture under tests/fixtures/hf/ is the model's config.json as published on the Hugging Face hub
(Llama 4 Scout's vision_config trimmed to its size fields). The import follows Megatron-Bridge's mapping;
what megapipe does not model lands in not_modelled, which every plan prints as a warning.
"""

from __future__ import annotations

import pathlib

import pytest

from megapipe.config import compose, to_scenario
from megapipe.emit.megatron import megatron_args
from megapipe.records import Activation, ParallelSpec, TrainSpec

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "hf"

# name: (layers, hidden, heads, groups, ffn, vocab, head_dim, tied, rope theta, qkv bias, qk norm, experts, topk)
EXPECTED = {
    "llama2_7b": ("llama", 32, 4096, 32, 32, 11008, 32000, 128, False, 10000.0, False, False, 0, None),
    "llama3_8b": ("llama", 32, 4096, 32, 8, 14336, 128256, 128, False, 500000.0, False, False, 0, None),
    "llama3_1_8b": ("llama", 32, 4096, 32, 8, 14336, 128256, 128, False, 500000.0, False, False, 0, None),
    "qwen2_7b": ("qwen2", 28, 3584, 28, 4, 18944, 152064, 128, False, 1e6, True, False, 0, None),
    "qwen2.5-7b": ("qwen2", 28, 3584, 28, 4, 18944, 152064, 128, False, 1e6, True, False, 0, None),
    "qwen2.5-0.5b": ("qwen2", 24, 896, 14, 2, 4864, 151936, 64, True, 1e6, True, False, 0, None),
    "qwen3_8b": ("qwen3", 36, 4096, 32, 8, 12288, 151936, 128, False, 1e6, False, True, 0, None),
    "mistral_7b_v0_1": ("mistral", 32, 4096, 32, 8, 14336, 32000, 128, False, 10000.0, False, False, 0, None),
    "mixtral_8x7b": ("mixtral", 32, 4096, 32, 8, 14336, 32000, 128, False, 1e6, False, False, 8, 2),
    "gemma2_9b": ("gemma2", 42, 3584, 16, 8, 14336, 256000, 256, True, 10000.0, False, False, 0, None),
    "gemma3_1b": ("gemma3", 26, 1152, 4, 1, 6912, 262144, 256, True, 1e6, False, True, 0, None),
    "phi3_mini_4k": ("phi3", 32, 3072, 32, 32, 8192, 32064, 96, False, 10000.0, False, False, 0, None),
    "deepseek_v3": ("deepseek_v3", 61, 7168, 128, 128, 18432, 129280, 128, False, 10000.0, False, True, 256, 8),
    "qwen3_30b_a3b": ("qwen3_moe", 48, 2048, 32, 4, 6144, 151936, 128, False, 1e6, False, True, 128, 8),
    "gpt_oss_120b": ("gpt_oss", 36, 2880, 64, 8, 2880, 201088, 64, False, 150000.0, False, False, 128, 4),
    "llama4_scout": ("llama4", 48, 5120, 40, 8, 16384, 202048, 128, False, 500000.0, False, False, 16, 1),
}

NOT_MODELLED = {
    "mistral_7b_v0_1": ["sliding-window attention (4096 tokens, every layer)"],
    "phi3_mini_4k": ["sliding-window attention (2047 tokens, every layer)"],
    "gemma2_9b": ["sliding-window attention (4096 tokens, every other layer)", "attn logit softcapping",
                  "final logit softcapping", "GeGLU activation"],
    "gemma3_1b": ["sliding-window attention (512 tokens, 5 of every 6 layers)", "GeGLU activation"],
    "deepseek_v3": ["rope_scaling yarn (factor 40)"],
    "gpt_oss_120b": ["sliding-window attention (128 tokens, every other layer)", "rope_scaling yarn (factor 32.0)",
                     "attention sinks", "clamped SwiGLU (swiglu_limit 7.0)"],
    "llama4_scout": ["NoPE layers", "chunked attention (8192-token chunks)", "query/key L2 norm", "vision encoder"],
}


def _model(name: str):
    return to_scenario(compose(["model=hf", f"model.config_path={FIXTURES / name / 'config.json'}",
                                "train.seq_length=4096"])).model


def test_every_fixture_is_checked():
    assert sorted(path.name for path in FIXTURES.iterdir()) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_fixture_imports_to_the_published_architecture(name):
    model = _model(name)
    (model_type, layers, hidden, heads, groups, ffn, vocab, head_dim, tied, theta, qkv_bias, qk_norm, experts,
     topk) = EXPECTED[name]
    assert model.name == model_type  # from model_type, never from the folder (qwen2.5-7b is no "qwen2")
    assert (model.num_layers, model.hidden_size, model.num_attention_heads) == (layers, hidden, heads)
    assert (model.num_query_groups, model.ffn_hidden_size, model.vocab_size) == (groups, ffn, vocab)
    assert model.head_dim == head_dim and model.untie_embeddings_and_output_weights is not tied
    assert model.rotary_base == theta and model.add_qkv_bias is qkv_bias and model.qk_layernorm is qk_norm
    assert model.num_moe_experts == experts and (topk is None or model.moe_router_topk == topk)
    assert model.activation is Activation.swiglu
    expected = NOT_MODELLED.get(name, [])
    assert len(model.not_modelled) == len(expected), model.not_modelled
    for fragment, feature in zip(expected, model.not_modelled):
        assert feature.startswith(fragment), (fragment, feature)


def test_norm_epsilon_and_llama31_rope_scaling():
    assert _model("qwen2.5-7b").norm_epsilon == 1e-6 and _model("llama3_8b").norm_epsilon == 1e-5
    scaled, plain = _model("llama3_1_8b"), _model("llama3_8b")
    assert scaled.use_rope_scaling and scaled.rope_scaling_factor == 8.0 and not plain.use_rope_scaling
    assert _model("llama4_scout").use_rope_scaling and _model("llama4_scout").moe_layers == (True,) * 48
    assert _model("deepseek_v3").moe_layers == (False,) * 3 + (True,) * 58
    assert _model("deepseek_v3").multi_latent_attention and _model("deepseek_v3").mtp_num_layers == 1


def _args(model) -> list[str]:
    return list(megatron_args(layout="Et*" + str(model.num_layers) + "L", parallel=ParallelSpec(),
                              train=TrainSpec(seq_length=4096, global_batch_size=8), model=model))


def test_qwen25_7b_arguments_carry_qkv_bias_and_llama31_its_rope_scaling():
    args = _args(_model("qwen2.5-7b"))
    assert "--add-qkv-bias" in args and "--disable-bias-linear" in args
    args = _args(_model("llama3_1_8b"))
    at = args.index("--rope-scaling-factor")
    assert "--use-rope-scaling" in args and args[at + 1] == "8" and "--add-qkv-bias" not in args
    assert "--use-rope-scaling" not in _args(_model("llama3_8b"))


def test_a_plan_of_an_imported_model_says_on_the_console_what_it_does_not_emit(capsys, tmp_path):
    from megapipe.cli import main

    assert main(["plan", "model=hf", f"model.config_path={FIXTURES / 'gemma2_9b' / 'config.json'}",
                 "train.seq_length=4096", "cluster.num_nodes=2", "output.pictures=false",
                 f"output.dir={tmp_path}"]) == 0
    out = capsys.readouterr().out
    assert "warning: NOT EMITTED: gemma2 has sliding-window attention (4096 tokens, every other layer)" in out
    assert "warning: NOT EMITTED: gemma2 has final logit softcapping (30.0)" in out
    nemo2 = (tmp_path / "nemo2_overrides.txt").read_text()
    assert "trainer.num_nodes=2" in nemo2 and "trainer.devices=8" in nemo2
