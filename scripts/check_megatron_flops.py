"""Megatron-LM's own FLOPs count against megapipe's, for every MoE / MLA / MTP preset (opt-in).

Megatron-LM reports throughput with ``num_floating_point_operations(args, batch_size)`` in
``megatron/training/training.py``; megapipe's MFU numerator is
:func:`megapipe.cost.model_flops_per_token`. This script builds Megatron's ``args`` for each preset
(the fields that function reads, named as Megatron's parser names them), calls Megatron's function
from a Megatron-LM checkout, and prints both per token and their ratio. Exit 0 when every preset
agrees to 1e-9.

    python scripts/check_megatron_flops.py --megatron /path/to/Megatron-LM [PRESET ...]

Needs a Python with torch and a Megatron-LM checkout (``megatron.training`` is not part of the
megatron-core wheel). CI does not run it; tests/test_moe.py holds the figures it printed.
"""

from __future__ import annotations

import argparse
import os
import sys
import types

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megapipe.config import compose, to_scenario  # noqa: E402
from megapipe.cost import model_flops_per_token  # noqa: E402
from megapipe.cost.shapes import padded_vocab_size  # noqa: E402

PRESETS = ("deepseek_v3", "qwen3_30b_a3b", "qwen3_235b_a22b", "gpt_oss_120b", "mixtral_8x7b", "mixtral_8x22b",
           "llama4_scout")


class _Args(types.SimpleNamespace):
    """Fields this script does not set read as None: the parser's default for the optional features
    (hybrid and linear-attention models, latent MoE) that newer versions look up."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return None


def megatron_args(model, seq_length: int) -> types.SimpleNamespace:
    """The fields ``num_floating_point_operations`` reads, as Megatron-LM's parser sets them."""
    return _Args(
        num_layers=model.num_layers, hidden_size=model.hidden_size, ffn_hidden_size=model.ffn_hidden_size,
        num_attention_heads=model.num_attention_heads, num_query_groups=model.num_query_groups,
        group_query_attention=model.num_query_groups != model.num_attention_heads and not model.multi_latent_attention,
        kv_channels=model.head_dim, swiglu=model.activation == "swiglu", seq_length=seq_length,
        padded_vocab_size=padded_vocab_size(model.vocab_size, 1),
        num_experts=model.num_moe_experts or None, moe_router_topk=model.moe_router_topk,
        moe_ffn_hidden_size=model.expert_ffn_hidden_size if model.is_moe else None,
        moe_shared_expert_intermediate_size=model.moe_shared_expert_intermediate_size or None,
        moe_layer_freq=[int(v) for v in model.moe_layers] if model.is_moe else 1,
        multi_latent_attention=model.multi_latent_attention, q_lora_rank=model.q_lora_rank,
        kv_lora_rank=model.kv_lora_rank, qk_head_dim=model.qk_head_dim,
        qk_pos_emb_head_dim=model.qk_pos_emb_head_dim, v_head_dim=model.v_head_dim,
        mtp_num_layers=model.mtp_num_layers or None,
        is_hybrid_model=False, hybrid_override_pattern=None, attention_output_gate=False,
        experimental_attention_variant=None, moe_latent_size=None, linear_attention_freq=None,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megatron", required=True, help="a Megatron-LM checkout")
    parser.add_argument("presets", nargs="*", default=PRESETS)
    args = parser.parse_args(argv)
    sys.path.insert(0, os.path.abspath(args.megatron))
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    import typing

    if not hasattr(typing, "override"):  # newer Megatron-LM imports typing.override (Python 3.12)
        typing.override = lambda function: function
    from megatron.training.training import num_floating_point_operations

    ok = True
    print(f"{'preset':18s} {'seq':>6s} {'Megatron GFLOP/token':>21s} {'megapipe':>10s} {'ratio':>8s}")
    for name in args.presets:
        model = to_scenario(compose([f"model={name}"])).model
        seq = model.seq_length
        theirs = num_floating_point_operations(megatron_args(model, seq), 1) / seq
        ours = model_flops_per_token(model, seq)
        ok &= abs(ours / theirs - 1) <= 1e-9
        print(f"{name:18s} {seq:6d} {theirs / 1e9:21.4f} {ours / 1e9:10.4f} {ours / theirs:10.8f}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
