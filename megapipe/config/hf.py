"""Read a Hugging Face ``config.json`` from disk into Megatron-named model fields.

The mapping follows Megatron-Bridge's (``CONFIG_MAPPING`` in ``models/conversion/model_bridge.py`` and each
family's bridge): shape (num_hidden_layers, hidden_size, intermediate_size, heads, num_key_value_heads,
head_dim, vocab_size), tied embeddings, rope_theta, RMSNorm epsilon, attention_bias -> add_qkv_bias (Qwen2 and
Qwen2.5 always: their bridge sets it), mlp_bias -> add_bias_linear, query/key norms (Qwen3, Gemma 3),
Llama 3.1 style rope_scaling -> --use-rope-scaling and --rope-scaling-factor, and GPT-2 style files (n_layer,
n_embd, n_head, n_inner, n_positions, learned absolute positions). Families covered: Llama 2/3/3.1, Qwen2/2.5/3,
Mistral, Mixtral, Gemma 2/3, Phi-3, DeepSeek-V3, Qwen3-MoE, GPT-OSS and Llama 4.

What megapipe neither costs nor emits goes to ``not_modelled``, and every plan of the model warns about it on
the console and in plan.yaml: sliding-window attention, logit soft-capping, other rope scalings (YaRN, linear,
LongRoPE), partial rotary embeddings, GeGLU (costed and emitted as SwiGLU: the same GEMM shapes), attention
sinks, clamped SwiGLU, chunked attention and NoPE layers. The model's name is its ``model_type``, not the
folder's. No network access: only the file given is read.

``max_position_embeddings`` is the longest context the model supports, not a training
sequence length, so it fills ``max_position_embeddings`` only; the training length comes
from ``train.seq_length``.

Mixture-of-experts families, with Megatron-Bridge's HF-to-Megatron mapping
(``megatron/bridge/models/conversion`` and each family's bridge):

- DeepSeek-V3 (``deepseek_v3``): n_routed_experts, num_experts_per_tok, moe_intermediate_size,
  n_shared_experts x moe_intermediate_size shared, the first ``first_k_dense_replace`` layers
  dense, sigmoid routing with the expert bias (``noaux_tc``), n_group / topk_group,
  routed_scaling_factor; MLA (q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim,
  v_head_dim) with latent norms; num_nextn_predict_layers MTP blocks;
- Qwen3-MoE (``qwen3_moe``): num_experts, moe_intermediate_size, decoder_sparse_step and
  mlp_only_layers for the dense layers, query/key norms, pre-softmax when not norm_topk_prob;
- Mixtral (``mixtral``) and GPT-OSS (``gpt_oss``): num_local_experts of intermediate_size each;
  GPT-OSS with biases on every linear layer;
- Llama 4 (``llama4``, fields under ``text_config``): num_local_experts of intermediate_size plus
  one shared expert of the same width, intermediate_size_mlp for dense layers, MoE on every
  ``interleave_moe_layer_step``-th layer, sigmoid routing.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

from megapipe.errors import ConfigError

__all__ = ["read_hf_config"]

_EXPERT_COUNT_KEYS = ("n_routed_experts", "num_local_experts", "num_experts", "moe_num_experts")


def _first(data: Mapping, *keys: str):
    for key in keys:
        if data.get(key) is not None:
            return data[key]
    return None


def read_hf_config(path: str) -> dict:
    """Return ModelConfig fields read from a Hugging Face config.json at ``path``."""
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except OSError as exc:
        raise ConfigError(f"model.config_path={path!r}: cannot read it ({exc.strerror}); give a local config.json") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"model.config_path={path!r} is not valid JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(data, Mapping):
        raise ConfigError(f"model.config_path={path!r} does not hold a JSON object")
    if "text_config" in data and isinstance(data["text_config"], Mapping):
        data = {**data, **data["text_config"], "model_type": data.get("model_type") or data["text_config"].get("model_type")}
    gpt2_style = "n_layer" in data
    hidden = _first(data, "hidden_size", "n_embd", "d_model")
    heads = _first(data, "num_attention_heads", "n_head")
    architectures = data.get("architectures") or []
    named = str(architectures[0]) if architectures else ""
    for suffix in ("ForCausalLM", "ForConditionalGeneration", "LMHeadModel", "Model"):
        named = named.removesuffix(suffix)
    model_type = str(data.get("model_type") or named or "hf")
    fields = {
        "name": model_type.lower().removesuffix("_text"),
        "num_layers": _first(data, "num_hidden_layers", "n_layer", "num_layers"),
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_query_groups": _first(data, "num_key_value_heads") or heads,
        "ffn_hidden_size": _first(data, "intermediate_size", "n_inner", "ffn_dim") or (4 * hidden if hidden else None),
        "vocab_size": data.get("vocab_size"),
        "max_position_embeddings": _first(data, "max_position_embeddings", "n_positions"),
        "kv_channels": data.get("head_dim"),
        # each family's config class default when the file omits the key: Gemma's and GPT-2's tie, the rest do not
        "untie_embeddings_and_output_weights": not bool(data.get("tie_word_embeddings",
                                                                 gpt2_style or model_type.startswith("gemma"))),
        "position_embedding_type": "learned_absolute" if gpt2_style else "rope",
        "rotary_base": data.get("rope_theta"),
        "norm_epsilon": _first(data, "rms_norm_eps", "layer_norm_epsilon", "layer_norm_eps", "norm_epsilon"),
    }
    act = str(_first(data, "hidden_activation", "hidden_act", "activation_function") or "").lower()
    gated_gelu = model_type.startswith("gemma") and act.startswith("gelu")
    fields["activation"] = "swiglu" if act in ("silu", "swish", "swiglu") or gated_gelu else "gelu"
    missing = [key for key in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size") if not fields[key]]
    if missing:
        raise ConfigError(f"model.config_path={path!r} lacks {', '.join(missing)}; is it a decoder-only LM config.json?")
    if model_type.startswith(("qwen3", "gemma3")) or data.get("use_qk_norm") and not model_type.startswith("llama4"):
        fields["qk_layernorm"] = True
    if model_type in ("qwen2", "qwen2_moe") or (data.get("attention_bias") and model_type != "gpt_oss"):
        fields["add_qkv_bias"] = True  # Qwen2's bridge sets it whatever the file says
    if data.get("mlp_bias"):
        fields["add_bias_linear"] = True
    fields.update(_rope_scaling(data))
    fields["not_modelled"] = _not_modelled(data, model_type, gated_gelu)
    if data.get("q_lora_rank") is not None or data.get("kv_lora_rank") is not None:
        fields.update(_mla_fields(data))
    if data.get("num_nextn_predict_layers"):
        fields["mtp_num_layers"] = int(data["num_nextn_predict_layers"])
    if _first(data, *_EXPERT_COUNT_KEYS):
        fields.update(_moe_fields(data, path, int(fields["num_layers"])))
    return {key: value for key, value in fields.items() if value is not None}


def _rope_scaling(data: Mapping) -> dict:
    """Llama 3.1's frequency scaling as Megatron's --use-rope-scaling (its low/high factors and original length
    are Megatron's fixed 1, 4 and 8192); other types are left to :func:`_not_modelled`."""
    scaling = data.get("rope_scaling")
    if not isinstance(scaling, Mapping) or (scaling.get("rope_type") or scaling.get("type")) != "llama3":
        return {}
    return {"use_rope_scaling": True, "rope_scaling_factor": float(scaling.get("factor", 8.0))}


def _windowed_layers(data: Mapping, model_type: str) -> str:
    """Which layers attend within the window, in each family's convention."""
    layers = data.get("layer_types")
    if isinstance(layers, list) and layers.count("sliding_attention") * 2 == len(layers):  # GPT-OSS
        return "every other layer"
    pattern = data.get("sliding_window_pattern")
    if pattern:  # Gemma 3: every pattern-th layer is global
        return f"{pattern - 1} of every {pattern} layers"
    return "every other layer" if model_type == "gemma2" else "every layer"


def _not_modelled(data: Mapping, model_type: str, gated_gelu: bool) -> list[str]:
    """The file's architecture features megapipe neither costs nor emits, in words a plan warns with."""
    found = []
    window = data.get("sliding_window")
    if window and data.get("use_sliding_window", True) and model_type not in ("qwen2", "qwen2_moe", "qwen3",
                                                                               "qwen3_moe"):
        found.append(f"sliding-window attention ({window} tokens, {_windowed_layers(data, model_type)})")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if data.get(key):
            found.append(f"{key.replace('_', ' ')} ({data[key]})")
    scaling = data.get("rope_scaling")
    if isinstance(scaling, Mapping) and scaling:
        kind = scaling.get("rope_type") or scaling.get("type")
        if kind != "llama3":
            found.append(f"rope_scaling {kind} (factor {scaling.get('factor')}): positions beyond the original "
                         f"{scaling.get('original_max_position_embeddings') or 'context'} are not emitted")
    if data.get("partial_rotary_factor") not in (None, 1, 1.0):
        found.append(f"partial rotary embeddings (partial_rotary_factor {data['partial_rotary_factor']})")
    if gated_gelu:
        found.append("GeGLU activation (tanh-approximated GELU, gated; the arguments build SwiGLU in its place, of the same "
                     "shapes)")
    if model_type == "gpt_oss":
        found.append("attention sinks (learned per-head softmax offsets)")
        if data.get("swiglu_limit"):
            found.append(f"clamped SwiGLU (swiglu_limit {data['swiglu_limit']})")
    if model_type.startswith("llama4"):
        interval = data.get("no_rope_layer_interval") or 4  # transformers' default when no_rope_layers is empty
        found.append(f"NoPE layers (every {interval}th layer has no rotary embedding)")
        if data.get("attention_chunk_size"):
            found.append(f"chunked attention ({data['attention_chunk_size']}-token chunks)")
        if data.get("use_qk_norm"):
            found.append("query/key L2 norm")
    if data.get("vision_config"):
        found.append("vision encoder")
    return found


def _mla_fields(data: Mapping) -> dict:
    return {"multi_latent_attention": True, "q_lora_rank": data.get("q_lora_rank"),
            "kv_lora_rank": data.get("kv_lora_rank"), "qk_head_dim": data.get("qk_nope_head_dim"),
            "qk_pos_emb_head_dim": data.get("qk_rope_head_dim"), "v_head_dim": data.get("v_head_dim"),
            "qk_layernorm": True, "kv_channels": data.get("v_head_dim")}


def _moe_pattern(data: Mapping, num_layers: int) -> list[int]:
    """Which layers are MoE, in each family's own convention, as Megatron's 0/1 list."""
    if data.get("first_k_dense_replace") is not None:  # DeepSeek
        dense = int(data["first_k_dense_replace"])
        step = int(data.get("moe_layer_freq") or 1)
        return [1 if i >= dense and i % step == 0 else 0 for i in range(num_layers)]
    if data.get("decoder_sparse_step") is not None or data.get("mlp_only_layers"):  # Qwen2/3-MoE
        step, dense = int(data.get("decoder_sparse_step") or 1), set(data.get("mlp_only_layers") or ())
        return [1 if i not in dense and (i + 1) % step == 0 else 0 for i in range(num_layers)]
    if data.get("interleave_moe_layer_step") is not None:  # Llama 4
        step = int(data["interleave_moe_layer_step"])
        return [1 if (i + 1) % step == 0 else 0 for i in range(num_layers)]
    return [1] * num_layers


def _moe_fields(data: Mapping, path: str, num_layers: int) -> dict:
    experts = int(_first(data, *_EXPERT_COUNT_KEYS))
    topk = _first(data, "num_experts_per_tok", "experts_per_token", "moe_topk")
    if topk is None:
        raise ConfigError(f"model.config_path={path!r} has {experts} experts but no num_experts_per_tok; "
                          "set model.moe_router_topk")
    model_type = str(data.get("model_type", ""))
    expert_width = _first(data, "moe_intermediate_size") or data.get("intermediate_size")
    fields: dict = {"num_moe_experts": experts, "moe_router_topk": int(topk), "moe_ffn_hidden_size": expert_width,
                    "moe_layer_freq": _moe_pattern(data, num_layers)}
    if data.get("n_shared_experts"):
        fields["moe_shared_expert_intermediate_size"] = int(data["n_shared_experts"]) * int(expert_width)
    elif data.get("shared_expert_intermediate_size"):
        fields["moe_shared_expert_intermediate_size"] = int(data["shared_expert_intermediate_size"])
    if model_type.startswith("llama4"):
        fields["moe_shared_expert_intermediate_size"] = int(data["intermediate_size"])
        fields["ffn_hidden_size"] = data.get("intermediate_size_mlp") or data["intermediate_size"]
    if str(data.get("scoring_func", "")) == "sigmoid" or model_type.startswith("llama4"):
        fields["moe_router_score_function"] = "sigmoid"
    if data.get("topk_method") == "noaux_tc":
        fields.update(moe_router_enable_expert_bias=True, moe_router_load_balancing_type="seq_aux_loss")
    if data.get("n_group"):
        fields.update(moe_router_num_groups=int(data["n_group"]), moe_router_group_topk=data.get("topk_group"))
    if data.get("routed_scaling_factor") not in (None, 1, 1.0):
        fields["moe_router_topk_scaling_factor"] = float(data["routed_scaling_factor"])
    if "norm_topk_prob" in data and fields.get("moe_router_score_function", "softmax") == "softmax":
        fields["moe_router_pre_softmax"] = not bool(data["norm_topk_prob"])
    coeff = _first(data, "router_aux_loss_coef", "aux_loss_alpha")
    if coeff is not None:
        fields["moe_aux_loss_coeff"] = float(coeff)
    if model_type == "gpt_oss":
        fields.update(add_bias_linear=True, moe_router_load_balancing_type="none")
    return fields
