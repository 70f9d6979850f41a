"""Activation bytes kept per in-flight microbatch, and pipeline p2p message size.

Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", Sec. 4 (16-bit activations, 1-byte dropout masks), per decoder layer:

    no parallelism      s b h (34 + 5 a s / h)
    TP                  s b h (10 + 24/t + 5 a s / (h t))
    TP + SP             s b h (34/t + 5 a s / (h t))
    selective recompute drops the 5 a s / h term
    full recompute      2 s b h (the layer input; / t with SP)

Derivation from first principles, so it extends to GQA and SwiGLU (e = bytes per
element, q = a d, kv = g d for g query groups, f = ffn_hidden_size):

- *replicated* across TP ranks (divided by t only under SP): two norm inputs
  ``2 e sbh``, linear_qkv input ``e sbh``, linear_fc1 input ``e sbh``, and with
  dropout two 1-byte masks ``2 sbh``; e = 2 gives Korthikanti's 10;
- *sharded* by t: Q and K for ``Q K^T`` ``e sb (q + kv)``, V ``e sb kv`` (unfused attention
  repeats K and V to all heads first, so kv counts as q there), linear_proj
  input ``e sb q``; MLP: GELU input and linear_fc2 input ``2 e sb f``, or for SwiGLU
  the ``2f``-wide linear_fc1 output plus linear_fc2 input ``3 e sb f``; with q = kv = h
  and f = 4h this is Korthikanti's 24;
- *score* term, unfused attention only: softmax output ``e a s^2 b`` and, with dropout,
  its mask ``a s^2 b`` and output ``e a s^2 b``: Korthikanti's 5 a s^2 b. Flash and
  fused kernels keep no ``s x s`` tensor, and selective recompute (core attention)
  drops it too.

Context parallelism divides the local sequence by cp (keys still span s).
Llama-style models (swiglu family) have no dropout, so no masks.

FP8 training (Transformer Engine): each linear layer saves its *quantized* input for the
weight-gradient GEMM (TE ``module/layernorm_linear.py`` and ``module/linear.py`` keep the FP8
input, 1 byte, plus one scale per 32 elements under MXFP8) instead of the bf16 one. So the
linear_qkv and linear_fc1 inputs (the norms' outputs) and the linear_fc2 input shrink to
1 byte, while linear_proj's FP8 input is an extra copy: the attention kernel still keeps its
bf16 output for its own backward.
"""

from __future__ import annotations

from megapipe.cost.shapes import Shapes, shapes_of
from megapipe.records import ModelSpec, ParallelSpec, Recompute, TrainSpec

__all__ = [
    "decoder_activation_bytes",
    "embedding_activation_bytes",
    "output_activation_bytes",
    "mtp_activation_bytes",
    "activation_bytes_per_layer",
    "p2p_bytes",
    "dispatcher_transient_bytes",
    "recomputed",
]

_INDEX_BYTES = 8
"""int64 token and position ids."""
_LOGITS_BYTES = 4
"""Megatron's vocab-parallel cross-entropy casts logits to fp32 and saves exp(logits)."""


def _linear_input_bytes(shapes: Shapes) -> float:
    """Bytes per element of the input a linear layer saves for its weight gradient."""
    if shapes.gemm_dtype != "fp8":
        return shapes.element_bytes
    return 1.0 + (1.0 / 32 if shapes.fp8_recipe == "mxfp8" else 0.0)


def recomputed(shapes: Shapes) -> frozenset[str]:
    """The ``recompute_modules`` a selective recompute re-runs (none without it)."""
    if shapes.recompute != Recompute.selective:
        return frozenset()
    return frozenset(shapes.features.recompute_modules)


def _replicated_bytes(shapes: Shapes) -> float:
    """Norm inputs, the linear layers' norm-written inputs (discarded and recomputed with ``layernorm`` in
    recompute_modules: megatron-core's CheckpointWithoutOutput), dropout masks."""
    e, linear_in = shapes.element_bytes, _linear_input_bytes(shapes)
    norm_outputs = 0.0 if "layernorm" in recomputed(shapes) else 2 * linear_in
    per_token = shapes.hidden_size * (2 * e + norm_outputs + (2 if shapes.dropout else 0))
    return shapes.norm_tokens * per_token


def _attention_bytes(shapes: Shapes) -> float:
    e, q, kv, v = shapes.element_bytes, shapes.query_size, shapes.kv_size, shapes.value_size
    linear_in = _linear_input_bytes(shapes)
    # Unfused attention repeats K and V to every query head before the batched GEMMs (GQA), so
    # what those GEMMs keep is q wide; flash/fused kernels take the grouped K and V as they are.
    if shapes.unfused_attention and not shapes.mla:
        kv = v = q
    out = shapes.attention_out_size
    proj_input = e * out + (linear_in * out if shapes.gemm_dtype == "fp8" else 0.0)
    # MLA's up-projected q, k, v are recomputed before the attention backward with mla_up_proj
    qkv = 0.0 if shapes.mla and "mla_up_proj" in recomputed(shapes) else e * (q + kv + v)
    sharded = shapes.tokens * (qkv + proj_input) / shapes.tensor_model_parallel_size
    if not shapes.mla:
        return sharded
    # MLA's gathered latents, each kept before and after its norm for the up-projection's backward.
    latents = shapes.q_lora_rank + shapes.kv_lora_rank
    return sharded + (2 if shapes.qk_layernorm else 1) * e * shapes.tokens * latents


def _mlp_bytes(shapes: Shapes, *, moe: bool) -> float:
    """The MLP's saved tensors: activation input and fc2 input (dense, shared experts, routed experts);
    with MoE also the router's fp32 logits and probabilities, and the routed experts' inputs and outputs
    (the permuted tokens, and what unpermute weighs by the routing probabilities), times the stated load
    imbalance on the busiest rank."""
    e, t, linear_in = shapes.element_bytes, shapes.tensor_model_parallel_size, _linear_input_bytes(shapes)
    per_width = (2 if shapes.gated else 1) * e + linear_in
    modules = recomputed(shapes)
    if not moe:  # recompute "mlp" keeps only the MLP's input (the norm output, counted with the norms)
        return 0.0 if "mlp" in modules else shapes.tokens * per_width * shapes.ffn_hidden_size / t
    if "moe" in modules:
        return 0.0
    router = 2 * 4 * shapes.num_experts * shapes.norm_tokens
    shared = 0.0 if "shared_experts" in modules else shapes.tokens * per_width * shapes.shared_ffn_hidden_size / t
    # moe_act discards the activation's output (linear_fc2's input) and recomputes it from linear_fc1's output
    routed_width = per_width - (linear_in if "moe_act" in modules else 0.0)
    routed = shapes.expert_tokens * (
        routed_width * shapes.expert_ffn_hidden_size / shapes.expert_tensor_parallel_size
        + (linear_in + e) * shapes.hidden_size)
    return router + shared + routed * shapes.moe_load_imbalance


def _score_bytes(shapes: Shapes) -> float:
    if not shapes.unfused_attention or shapes.recompute != Recompute.none:
        return 0.0
    e = shapes.element_bytes
    per_score = 2 * e + 1 if shapes.dropout else e
    heads = shapes.num_attention_heads / shapes.tensor_model_parallel_size
    return per_score * heads * shapes.micro_batch_size * shapes.local_seq_length * shapes.seq_length


def decoder_activation_bytes(shapes: Shapes, *, moe: bool = False) -> float:
    """Bytes one decoder layer (dense, or MoE with ``moe``) keeps for its backward, per microbatch, on one GPU."""
    if shapes.recompute == Recompute.full:
        return shapes.element_bytes * shapes.norm_tokens * shapes.hidden_size
    return _replicated_bytes(shapes) + _attention_bytes(shapes) + _mlp_bytes(shapes, moe=moe) + _score_bytes(shapes)


def embedding_activation_bytes(shapes: Shapes) -> float:
    """Token ids (int64, for the lookup's backward), learned-position ids, and the embedding-dropout
    mask (Korthikanti Sec. 4.3: ``s b h / t`` with SP; none without dropout).

    The embedding's output is stored by the first decoder layer's norm, counted there.
    """
    ids = _INDEX_BYTES * shapes.tokens + (_INDEX_BYTES * shapes.local_seq_length if shapes.learned_positions else 0)
    return float(ids + (shapes.norm_tokens * shapes.hidden_size if shapes.dropout else 0))


def output_activation_bytes(shapes: Shapes) -> float:
    """Final norm input, output-projection input and fp32 logits (Korthikanti Sec. 4.3: 4sbh/t + 4sbV/t)."""
    inputs = 2 * shapes.element_bytes * shapes.norm_tokens * shapes.hidden_size
    logits = _LOGITS_BYTES * shapes.tokens * shapes.vocab_size / shapes.tensor_model_parallel_size
    return inputs + logits


def mtp_activation_bytes(shapes: Shapes, *, moe: bool = False) -> float:
    """An MTP block: enorm/hnorm inputs and the ``2h``-wide eh_proj input, a decoder layer, its own logits."""
    extra = 4 * shapes.element_bytes * shapes.norm_tokens * shapes.hidden_size
    return extra + decoder_activation_bytes(shapes, moe=moe) + output_activation_bytes(shapes)


def activation_bytes_per_layer(*, model: ModelSpec, parallel: ParallelSpec, train: TrainSpec) -> float:
    """Bytes a decoder layer keeps per in-flight microbatch on one GPU (see the module docstring)."""
    return decoder_activation_bytes(shapes_of(model=model, parallel=parallel, train=train))


def p2p_bytes(*, model: ModelSpec, parallel: ParallelSpec, train: TrainSpec) -> float:
    """Bytes of the hidden-state tensor sent between neighbouring pipeline stages per microbatch.

    ``s b h e``, divided by t under sequence parallelism (Megatron sends the
    ``[s/t, b, h]`` shard) and by cp. Forward sends activations, backward their gradients
    of the same size.
    """
    shapes = shapes_of(model=model, parallel=parallel, train=train)
    return float(shapes.element_bytes * shapes.norm_tokens * shapes.hidden_size)


def dispatcher_transient_bytes(*, model: ModelSpec, parallel: ParallelSpec, train: TrainSpec) -> float:
    """Bytes one MoE layer's token dispatch holds only while it runs, beyond the saved activations.

    alltoall: the permuted tokens' send buffer and the receive buffer of one all-to-all (megatron-core
    ``MoEAlltoAllTokenDispatcher``: ``permute`` then ``all_to_all``), ``2 x expert_tokens x h x e`` times
    the load imbalance. allgather: the hidden states gathered from every rank of the EP x ETP group
    before the local permute (``MoEAllGatherTokenDispatcher``), ``tokens x EP x ETP / t x h x e``.
    0 for a dense model. Megatron frees them after the layer, so they are a transient peak, compared
    with the memory megapipe leaves free rather than added to every in-flight microbatch.
    """
    if not model.is_moe:
        return 0.0
    shapes = shapes_of(model=model, parallel=parallel, train=train)
    e, h = shapes.element_bytes, shapes.hidden_size
    if parallel.features.moe_token_dispatcher_type == "allgather":
        group = parallel.expert_model_parallel_size * parallel.expert_tp
        return shapes.tokens * group / parallel.tensor_model_parallel_size * h * e
    return 2 * shapes.expert_tokens * h * e * shapes.moe_load_imbalance
