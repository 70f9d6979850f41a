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
1 byte. linear_proj saves an extra FP8 copy of the attention output only under delayed scaling: for the other
recipes megatron-core (0.14 and later) has it save the attention kernel's bf16 output, which the kernel keeps anyway.

Megatron's layer spec (``gpt_layer_specs.py``) decides which norm is its own module: with grouped-query attention
the input norm is fused into linear_qkv and a dense layer's pre-MLP norm into linear_fc1 (Transformer Engine's
LayerNormLinear keeps the norm's input and its output); multi-latent attention and MoE layers have separate norms,
the only ones recompute_modules ``layernorm`` re-runs. Each saved tensor is listed with the module whose forward
saves it (:func:`decoder_activation_bytes`), so fine-grained activation offloading subtracts what the offload
modules save; a tensor two modules save (the attention output, kept by the kernel and linear_proj) leaves the GPU
only when both are offloaded.
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
    "offloaded",
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


def offloaded(shapes: Shapes) -> frozenset[str]:
    """The ``offload_modules`` whose saved tensors fine-grained activation offloading moves to the host."""
    if not shapes.features.fine_grained_activation_offloading:
        return frozenset()
    return frozenset(shapes.features.offload_modules)


def _proj_keeps_own_copy(shapes: Shapes) -> bool:
    """Whether linear_proj saves an FP8 copy of the attention output beside the bf16 one the attention kernel keeps:
    only with delayed scaling. For the other FP8 recipes megatron-core (0.14 and later, ``SelfAttention.__init__``
    and ``MLASelfAttention.__init__``: ``set_save_original_input(self.linear_proj)``) has it save the original."""
    return shapes.gemm_dtype == "fp8" and shapes.fp8_recipe == "delayed"


def _attention_saved(shapes: Shapes) -> list[tuple[str, float]]:
    """(owner module, bytes) the attention half of a layer saves.

    GQA: Transformer Engine's fused norm + linear_qkv (``TELayerNormColumnParallelLinear``) keeps its input and
    its normalised (quantised, under FP8) output; with ``qk_layernorm`` the per-head norms keep their inputs; the
    attention kernel keeps q, k, v and its output, which linear_proj shares. MLA: a separate input norm keeps its
    input and each down-projection its own (quantised) copy of the norm's output, and the latents are kept before
    and after their norms.
    """
    e, q, kv, v, h = shapes.element_bytes, shapes.query_size, shapes.kv_size, shapes.value_size, shapes.hidden_size
    linear_in, t, modules = _linear_input_bytes(shapes), shapes.tensor_model_parallel_size, recomputed(shapes)
    out = shapes.attention_out_size
    saved = [("attn_norm" if shapes.mla else "qkv_linear", e * shapes.norm_tokens * h)]
    if shapes.mla:
        copies = 0.0 if "layernorm" in modules else (2 * linear_in if shapes.gemm_dtype == "fp8" else e)
        latents = shapes.q_lora_rank + shapes.kv_lora_rank
        saved += [("qkv_linear", copies * shapes.norm_tokens * h),
                  ("qkv_linear", (2 if shapes.qk_layernorm else 1) * e * shapes.tokens * latents)]
    else:
        saved.append(("qkv_linear", linear_in * shapes.norm_tokens * h))
        if shapes.qk_layernorm:
            saved.append(("qkv_linear", e * shapes.tokens * (q + kv) / t))
    if shapes.unfused_attention and not shapes.mla:
        kv = v = q  # unfused attention repeats K and V to every query head before its batched GEMMs
    # MLA's up-projected q, k, v are recomputed before the attention backward with mla_up_proj
    qkv = 0.0 if shapes.mla and "mla_up_proj" in modules else e * (q + kv + v)
    saved += [("core_attn", shapes.tokens * qkv / t), ("core_attn+attn_proj", e * shapes.tokens * out / t)]
    if _proj_keeps_own_copy(shapes):
        saved.append(("attn_proj", linear_in * shapes.tokens * out / t))
    return saved


def _routed_saved(shapes: Shapes) -> list[tuple[str, float]]:
    """The routed experts' saved tensors: linear_fc1's (permuted) input, the activation's input, linear_fc2's
    input, times the load imbalance on the busiest rank. megatron-core (0.13 and later) multiplies the routing
    probabilities into the activation (``TEGroupedMLP.bias_act_func``: ``weighted_bias_swiglu_impl``) and unpermutes
    without them (``token_dispatcher.py``: ``unpermute`` takes no probs), so no expert output is kept
    ("memory-efficient permutation", arXiv 2603.07685 Sec. 4.1.2)."""
    e, f, modules = shapes.element_bytes, shapes.expert_ffn_hidden_size, recomputed(shapes)
    linear_in, etp = _linear_input_bytes(shapes), shapes.expert_tensor_parallel_size
    scale = shapes.expert_tokens * shapes.moe_load_imbalance
    act_input = (2 if shapes.gated else 1) * e * f / etp
    fc2_input = 0.0 if "moe_act" in modules else linear_in * f / etp  # moe_act discards the activation's output
    return [("expert_fc1", scale * linear_in * shapes.hidden_size), ("moe_act", scale * act_input),
            ("", scale * fc2_input)]


def _mlp_saved(shapes: Shapes, *, moe: bool) -> list[tuple[str, float]]:
    """(owner module, bytes) the MLP half of a layer saves.

    Dense: the norm is fused into linear_fc1, which keeps its input and normalised output; the activation's input
    and linear_fc2's input. A recomputed ``mlp`` keeps only its input (the norm's input). MoE: a separate
    pre-MLP norm keeps its input; the router keeps its bf16 input (``RouterGatingLinearFunction``), which the shared
    experts' linear_fc1 shares under FP8 but delayed scaling (``SharedExpertMLP.__init__``); the router's fp32
    logits and probabilities; the shared and routed experts.
    """
    e, h, t, linear_in = shapes.element_bytes, shapes.hidden_size, shapes.tensor_model_parallel_size, \
        _linear_input_bytes(shapes)
    per_width = (2 if shapes.gated else 1) * e + linear_in
    modules, norm = recomputed(shapes), shapes.norm_tokens * h
    if not moe:
        if "mlp" in modules:
            return [("", e * norm)]
        return [("", (e + linear_in) * norm), ("", shapes.tokens * per_width * shapes.ffn_hidden_size / t)]
    saved = [("mlp_norm", e * norm)]
    if "moe" in modules:
        return saved + [("", 0.0 if "layernorm" in modules else e * norm)]
    saved.append(("", 0.0 if "layernorm" in modules else e * norm))
    saved.append(("", 2 * 4 * shapes.num_experts * shapes.norm_tokens))
    if shapes.shared_ffn_hidden_size and "shared_experts" not in modules:
        own_copy = linear_in * norm if shapes.gemm_dtype == "fp8" and shapes.fp8_recipe == "delayed" else 0.0
        saved.append(("", own_copy + shapes.tokens * per_width * shapes.shared_ffn_hidden_size / t))
    return saved + _routed_saved(shapes)


def _score_bytes(shapes: Shapes) -> float:
    if not shapes.unfused_attention or shapes.recompute != Recompute.none:
        return 0.0
    e = shapes.element_bytes
    per_score = 2 * e + 1 if shapes.dropout else e
    heads = shapes.num_attention_heads / shapes.tensor_model_parallel_size
    return per_score * heads * shapes.micro_batch_size * shapes.local_seq_length * shapes.seq_length


def _kept(owner: str, away: frozenset[str]) -> bool:
    """Whether a tensor saved by ``owner`` (``a+b``: saved by both) stays on the GPU when ``away`` is offloaded."""
    return not owner or not all(module in away for module in owner.split("+"))


def decoder_activation_bytes(shapes: Shapes, *, moe: bool = False) -> float:
    """Bytes one decoder layer (dense, or MoE with ``moe``) keeps on the GPU for its backward, per microbatch.

    Fine-grained activation offloading (megatron-core ``fine_grained_activation_offload.py``) moves what the
    offload modules save to the host in the forward and back before their backward; the last layer's group of
    each module stays, one layer of the many in flight, which is left out.
    """
    if shapes.recompute == Recompute.full:
        return shapes.element_bytes * shapes.norm_tokens * shapes.hidden_size
    away = offloaded(shapes)
    saved = _attention_saved(shapes) + _mlp_saved(shapes, moe=moe)
    dropout = 2 * shapes.norm_tokens * shapes.hidden_size if shapes.dropout else 0.0
    return sum(num_bytes for owner, num_bytes in saved if _kept(owner, away)) + dropout + _score_bytes(shapes)


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
