"""HBM bytes moved by the memory-bound kernels of each unit, per microbatch, on one GPU.

First-order counts (each kernel reads its inputs and writes its output once; e =
bytes per element); backward kernels read the saved input and the incoming gradient
and write a gradient, so backward traffic is taken as twice the forward's:

- norm: read + write ``2 e`` per element of the hidden state;
- Megatron's fused bias-dropout-add: read input and residual, write output ``3 e``,
  plus a 1-byte mask with dropout;
- bias-GELU ``2 e`` per FFN element; SwiGLU reads the ``2f``-wide input, writes ``f``: ``3 e``;
- RoPE on Q and K: read + write ``2 e``;
- unfused attention's scale-mask-softmax ``2 e`` per score, and with dropout ``2 e + 1``;
- embedding lookup: read rows and write ``2 e`` per hidden element on every TP rank;
  learned positions add ``3 e``; backward scatter-adds into the fp32 main gradient
  (read gradient ``e``, read + write fp32 ``8``);
- vocab-parallel cross-entropy: read bf16 logits, write fp32, max/exp/sum/normalise
  passes: about ``e + 20`` per logit forward; backward rewrites the fp32 softmax as the
  gradient and casts it back: about ``e + 12``.

FP8 casts (Transformer Engine): the inputs of linear_proj and linear_fc2 are quantized by a
cast(-transpose) kernel that reads ``e`` and writes the FP8 copy and its transpose (``2`` bytes;
MXFP8's row- and column-wise copies are the same size plus a scale per 32); the norms before
linear_qkv and linear_fc1 write FP8 directly, which moves no more bytes than their bf16 output.
In the backward each linear layer's output gradient is cast the same way. Per-tensor *current*
scaling (``tensorwise``) first reads each tensor once more for its amax.

Kernel counts (launches per decoder layer, forward / backward, without GEMMs and attention):
two norms, RoPE, two residual adds (bias-dropout-add), the activation: 6 / 12; FP8 adds its casts.
"""

from __future__ import annotations

from megapipe.cost.flops import decoder_gemms
from megapipe.cost.moe import padding_rows
from megapipe.cost.shapes import Shapes

__all__ = [
    "decoder_traffic_bytes",
    "decoder_kernels",
    "fp8_cast_traffic_bytes",
    "recompute_traffic_bytes",
    "fp8_cast_kernels",
    "attention_core_traffic_bytes",
    "embedding_traffic_bytes",
    "output_traffic_bytes",
]


def decoder_traffic_bytes(shapes: Shapes, *, moe: bool = False) -> float:
    """Forward bytes of a decoder layer's memory-bound kernels, excluding the attention core."""
    e, t = shapes.element_bytes, shapes.tensor_model_parallel_size
    hidden = shapes.norm_tokens * shapes.hidden_size
    norms = 2 * 2 * e * hidden
    dropout_add = 2 * (3 * e + (1 if shapes.dropout else 0)) * hidden
    per_ffn = (3 if shapes.gated else 2) * e
    if shapes.learned_positions:
        rope = 0.0
    elif shapes.mla:  # RoPE on the rope slices only: per head for queries, one shared key head
        rope = 2 * e * shapes.tokens * shapes.rope_head_dim * (shapes.num_attention_heads / t + 1)
    else:
        rope = 2 * e * shapes.tokens * (shapes.query_size + shapes.kv_size) / t
    latents = 2 * 2 * e * shapes.tokens * (shapes.q_lora_rank + shapes.kv_lora_rank) if shapes.qk_layernorm else 0.0
    if not moe:
        activation = per_ffn * shapes.tokens * shapes.ffn_hidden_size / t
        return norms + dropout_add + activation + rope + latents
    return norms + dropout_add + rope + latents + _moe_traffic_bytes(shapes, per_ffn)


def _moe_traffic_bytes(shapes: Shapes, per_ffn: float) -> float:
    """A MoE layer's activation traffic over the shared and the routed experts' widths (the routed ones on the
    busiest rank, with FP8's padding rows); the router, permute and dispatch are :mod:`megapipe.cost.moe`'s."""
    m = shapes.expert_tokens * shapes.moe_load_imbalance + padding_rows(shapes) * shapes.local_experts
    shared = per_ffn * shapes.tokens * shapes.shared_ffn_hidden_size / shapes.tensor_model_parallel_size
    routed = per_ffn * m * shapes.expert_ffn_hidden_size / shapes.expert_tensor_parallel_size
    return shared + routed


def recompute_traffic_bytes(shapes: Shapes, module: str, *, moe: bool) -> float:
    """Forward bytes of the memory-bound part a selective ``recompute_modules`` entry re-runs in the backward:
    ``layernorm`` the two norms (and MLA's latent norms), ``moe_act`` the routed experts' activation, ``mlp`` /
    ``shared_experts`` / ``moe`` their activations; 0 for modules without memory-bound work of their own."""
    e, t = shapes.element_bytes, shapes.tensor_model_parallel_size
    per_ffn = (3 if shapes.gated else 2) * e
    if module == "layernorm":
        latents = 2 * 2 * e * shapes.tokens * (shapes.q_lora_rank + shapes.kv_lora_rank) if shapes.qk_layernorm else 0.0
        return 2 * 2 * e * shapes.norm_tokens * shapes.hidden_size + latents
    if module == "mlp" and not moe:
        return per_ffn * shapes.tokens * shapes.ffn_hidden_size / t
    if module == "moe_act" and moe:
        m = shapes.expert_tokens * shapes.moe_load_imbalance + padding_rows(shapes) * shapes.local_experts
        return per_ffn * m * shapes.expert_ffn_hidden_size / shapes.expert_tensor_parallel_size
    if module == "shared_experts" and moe:
        return per_ffn * shapes.tokens * shapes.shared_ffn_hidden_size / t
    if module == "moe" and moe:
        return _moe_traffic_bytes(shapes, per_ffn)
    return 0.0


def decoder_kernels(shapes: Shapes, *, moe: bool = False) -> tuple[int, int]:
    """Memory-bound kernel launches of a decoder layer, (forward, backward): norms, RoPE, residual adds, the
    activation (a MoE layer's router and permute kernels are :mod:`megapipe.cost.moe`'s)."""
    forward = 6 - (1 if shapes.learned_positions else 0) + (2 if moe and shapes.shared_ffn_hidden_size else 0)
    return forward, 2 * forward


_NORM_FED = frozenset({"linear_qkv", "linear_fc1", "linear_q_proj", "linear_q_down_proj", "linear_kv_down_proj"})
"""Linear layers whose input a norm writes, in FP8 directly (Transformer Engine's LayerNormLinear)."""


def _fp8_casts(shapes: Shapes, moe: bool) -> tuple[tuple[float, float], tuple[int, int]]:
    """((forward, backward) elements, (forward, backward) kernels) of a decoder layer's FP8 casts: the
    input of every FP8 linear layer not fed by a norm, and in the backward every output gradient."""
    fed = _NORM_FED | ({"linear_q_up_proj", "linear_kv_up_proj"} if shapes.qk_layernorm else frozenset())
    forward = backward = 0.0
    forward_kernels = backward_kernels = 0
    for gemm in decoder_gemms(shapes, moe=moe):
        if not gemm.quantized:
            continue
        tokens = gemm.tokens * (shapes.moe_load_imbalance if gemm.groups > 1 else 1.0)
        # a grouped GEMM's input is quantized per expert (Transformer Engine splits it by m_splits first)
        if gemm.name not in fed:
            forward += tokens * gemm.k
            forward_kernels += gemm.groups
        backward += tokens * gemm.n
        backward_kernels += gemm.groups
    return (forward, backward), (forward_kernels, backward_kernels)


def fp8_cast_kernels(shapes: Shapes, *, moe: bool = False) -> tuple[int, int]:
    """FP8 cast kernels of a decoder layer, (forward, backward); none outside fp8."""
    if shapes.gemm_dtype != "fp8":
        return 0, 0
    per_cast = 2 if shapes.fp8_recipe == "tensorwise" else 1
    forward, backward = _fp8_casts(shapes, moe)[1]
    return forward * per_cast, backward * per_cast


def fp8_cast_traffic_bytes(shapes: Shapes, *, moe: bool = False) -> tuple[float, float]:
    """(forward, backward) bytes of a decoder layer's FP8 casts; 0 outside fp8."""
    if shapes.gemm_dtype != "fp8":
        return 0.0, 0.0
    e = shapes.element_bytes
    written = 2.0 * (1 + 1 / 32) if shapes.fp8_recipe == "mxfp8" else 2.0
    per_element = e + written + (e if shapes.fp8_recipe == "tensorwise" else 0.0)
    forward, backward = _fp8_casts(shapes, moe)[0]
    return per_element * forward, per_element * backward


def attention_core_traffic_bytes(shapes: Shapes) -> float:
    """Forward bytes of unfused attention's softmax (and dropout) over the ``s x s`` scores; 0 for flash/fused."""
    if not shapes.unfused_attention:
        return 0.0
    scores = (
        shapes.micro_batch_size * shapes.num_attention_heads / shapes.tensor_model_parallel_size
        * shapes.local_seq_length * shapes.seq_length
    )
    per_score = 2 * shapes.element_bytes + ((2 * shapes.element_bytes + 1) if shapes.dropout else 0)
    return per_score * scores


def embedding_traffic_bytes(shapes: Shapes) -> tuple[float, float]:
    """(forward, backward) bytes of the vocab-parallel lookup, position add and dropout."""
    e = shapes.element_bytes
    lookup = shapes.tokens * shapes.hidden_size
    hidden = shapes.norm_tokens * shapes.hidden_size
    forward = 2 * e * lookup + (3 * e * hidden if shapes.learned_positions else 0.0)
    forward += (2 * e + 1) * hidden if shapes.dropout else 0.0
    backward = (e + 8) * lookup + (2 * e * hidden if shapes.dropout else 0.0)
    return forward, backward


def output_traffic_bytes(shapes: Shapes) -> tuple[float, float]:
    """(forward, backward) bytes of the final norm and the vocab-parallel cross-entropy."""
    e = shapes.element_bytes
    norm = 2 * e * shapes.norm_tokens * shapes.hidden_size
    logits = shapes.tokens * shapes.vocab_size / shapes.tensor_model_parallel_size
    return norm + (e + 20) * logits, 2 * norm + (e + 12) * logits
