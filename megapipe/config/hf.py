"""Read a Hugging Face ``config.json`` from disk into Megatron-named model fields.

Covers the Llama / Mistral / Qwen family (num_hidden_layers, num_key_value_heads,
intermediate_size, hidden_act=silu -> SwiGLU, rope) and GPT-2 style files
(n_layer, n_embd, n_head, n_inner, n_positions, learned absolute positions).
No network access: only the file given is read.

``max_position_embeddings`` is the longest context the model supports, not a training
sequence length, so it fills ``max_position_embeddings`` only; the training length comes
from ``train.seq_length``. Mixture-of-experts configs are refused until megapipe plans them:
as dense models they would be costed as a fraction of their real size.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

from megapipe.errors import ConfigError

__all__ = ["read_hf_config"]

_EXPERT_KEYS = ("num_local_experts", "n_routed_experts", "num_experts", "moe_num_experts", "num_experts_per_tok",
                "moe_intermediate_size")


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
        data = {**data, **data["text_config"]}
    experts = [key for key in _EXPERT_KEYS if data.get(key)]
    if experts:
        raise ConfigError(
            f"model.config_path={path!r} is a mixture-of-experts model ({experts[0]}={data[experts[0]]}); megapipe "
            "does not plan expert parallelism yet and would cost it as a dense model: plan a dense model")
    gpt2_style = "n_layer" in data
    hidden = _first(data, "hidden_size", "n_embd", "d_model")
    heads = _first(data, "num_attention_heads", "n_head")
    fields = {
        "name": os.path.splitext(os.path.basename(os.path.dirname(os.path.abspath(path))))[0] or "hf",
        "num_layers": _first(data, "num_hidden_layers", "n_layer", "num_layers"),
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_query_groups": _first(data, "num_key_value_heads") or heads,
        "ffn_hidden_size": _first(data, "intermediate_size", "n_inner", "ffn_dim") or (4 * hidden if hidden else None),
        "vocab_size": data.get("vocab_size"),
        "max_position_embeddings": _first(data, "max_position_embeddings", "n_positions"),
        "kv_channels": data.get("head_dim"),
        "untie_embeddings_and_output_weights": not bool(data.get("tie_word_embeddings", gpt2_style)),
        "position_embedding_type": "learned_absolute" if gpt2_style else "rope",
        "rotary_base": data.get("rope_theta"),
        "norm_epsilon": _first(data, "rms_norm_eps", "layer_norm_epsilon", "layer_norm_eps", "norm_epsilon"),
    }
    act = str(_first(data, "hidden_act", "activation_function") or "").lower()
    fields["activation"] = "swiglu" if act in ("silu", "swish", "swiglu") else "gelu"
    missing = [key for key in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size") if not fields[key]]
    if missing:
        raise ConfigError(f"model.config_path={path!r} lacks {', '.join(missing)}; is it a decoder-only LM config.json?")
    return {key: value for key, value in fields.items() if value is not None}
