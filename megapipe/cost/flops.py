"""Matmul FLOPs per pipeline unit, per microbatch, per GPU; and the planner's MFU convention.

Conventions (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on
GPU Clusters Using Megatron-LM", Appendix: Floating-Point Operations):

- a GEMM of an ``m x k`` by ``k x n`` matrix costs ``2 m n k`` FLOPs;
- each GEMM's backward is two GEMMs of the same size (input gradient ``dgrad`` and
  weight gradient ``wgrad``), so backward = 2 x forward and wgrad = forward;
- attention scores ``Q K^T`` and context ``P V`` count the *full* ``s x s`` square:
  ``2 * 2 * b * s * s * (heads * kv_channels)`` forward FLOPs per layer. The causal
  mask makes half of it useless work; fused/flash kernels skip it, which the time
  model in :mod:`megapipe.cost.layers` accounts for, but FLOP counts here do not;
- Megatron's fused GEMMs are kept as single GEMMs (linear_qkv, and linear_fc1 of
  width ``2 f`` for SwiGLU), because the efficiency curve depends on GEMM size.

Under tensor parallelism every GEMM here is split by t (column/row parallel);
under context parallelism a GPU owns ``s/cp`` queries against all ``s`` keys.
"""

from __future__ import annotations

from typing import NamedTuple

from megapipe.cost.shapes import Shapes, padded_vocab_size, shapes_of
from megapipe.records import ModelSpec

__all__ = [
    "Gemm",
    "decoder_gemms",
    "output_gemms",
    "mtp_gemms",
    "attention_gemms",
    "mlp_gemms",
    "eh_proj_gemm",
    "matmul_parameter_count",
    "decoder_gemm_flops",
    "attention_flops",
    "output_gemm_flops",
    "mtp_gemm_flops",
    "model_flops_per_token",
]


class Gemm(NamedTuple):
    """One forward GEMM on one GPU: ``tokens x k`` activations by a ``k x n`` weight.

    Its backward is the input gradient (``tokens x n`` by ``n x k``: output ``tokens x k``) and the
    weight gradient (``k x tokens`` by ``tokens x n``: output ``k x n``, reducing over tokens).
    A grouped GEMM (the routed experts) is ``groups`` weights of ``k x n`` that share the ``tokens``.
    """

    name: str
    tokens: float
    n: float
    k: float
    column_parallel: bool
    """Column-parallel (input all-gathered under SP, output sharded) or row-parallel (input sharded,
    output all-reduced, or reduce-scattered under SP): what its TP collective overlaps with."""
    comm_width: float = 0.0
    """Per-token width of the activation its TP collective moves (the hidden size, or MLA's latent);
    0 when the GEMM has no TP collective of its own (replicated weights, or experts, whose tokens the
    dispatcher moves)."""
    groups: int = 1
    quantized: bool = True
    """Runs in FP8 under FP8 training (Transformer Engine's linear layers; the router does not)."""

    @property
    def flops(self) -> float:
        return 2.0 * self.tokens * self.n * self.k

    @property
    def weights(self) -> float:
        """Weight elements on this GPU."""
        return self.groups * self.n * self.k


def attention_gemms(shapes: Shapes) -> tuple[Gemm, ...]:
    """The attention block's linear layers on one GPU.

    GQA: linear_qkv (``h -> q + 2 kv``, column-parallel) and linear_proj (row-parallel).
    Multi-latent attention (megatron-core ``MLASelfAttention``; DeepSeek-V2 Sec. 2.1): the down-projections
    ``linear_q_down_proj`` (``h -> r_q``) and ``linear_kv_down_proj`` (``h -> r_kv + d_rope``) are replicated
    on every TP rank and run on the sequence-parallel share of tokens, whose latents are then all-gathered;
    the up-projections ``linear_q_up_proj`` (``r_q -> heads (d_qk + d_rope)``) and ``linear_kv_up_proj``
    (``r_kv -> heads (d_qk + d_v)``) are column-parallel; without a q latent ``linear_q_proj`` maps
    ``h -> heads (d_qk + d_rope)`` directly.
    """
    tokens, h, t = shapes.tokens, shapes.hidden_size, shapes.tensor_model_parallel_size
    proj = Gemm("linear_proj", tokens, h, shapes.attention_out_size / t, False, h)
    if not shapes.mla:
        qkv = (shapes.query_size + shapes.kv_size + shapes.value_size) / t
        return Gemm("linear_qkv", tokens, qkv, h, True, h), proj
    r_q, r_kv, rope = shapes.q_lora_rank, shapes.kv_lora_rank, shapes.rope_head_dim
    kv_up = (shapes.query_size - shapes.num_attention_heads * rope + shapes.value_size) / t
    if r_q:
        query = (Gemm("linear_q_down_proj", shapes.norm_tokens, r_q, h, True),
                 Gemm("linear_q_up_proj", tokens, shapes.query_size / t, r_q, True, r_q))
    else:
        query = (Gemm("linear_q_proj", tokens, shapes.query_size / t, h, True, h),)
    return (*query, Gemm("linear_kv_down_proj", shapes.norm_tokens, r_kv + rope, h, True),
            Gemm("linear_kv_up_proj", tokens, kv_up, r_kv, True, r_kv + rope), proj)


def mlp_gemms(shapes: Shapes, *, moe: bool = False) -> tuple[Gemm, ...]:
    """The MLP's linear layers on one GPU.

    Dense: linear_fc1 (``2f`` wide for SwiGLU), linear_fc2. MoE (megatron-core ``MoELayer``): the router
    (``h -> E``, replicated, on the sequence-parallel share of tokens), the shared experts (a dense MLP of
    ``moe_shared_expert_intermediate_size``, tensor-parallel) and the grouped routed experts: E/EP local
    experts, each ``h -> f_e / ETP`` (``2 f_e / ETP`` for SwiGLU) and back, over
    :attr:`Shapes.expert_tokens` assignments.
    """
    tokens, h, t = shapes.tokens, shapes.hidden_size, shapes.tensor_model_parallel_size
    width = 2 if shapes.gated else 1
    if not moe:
        f = shapes.ffn_hidden_size
        return (Gemm("linear_fc1", tokens, f * width / t, h, True, h),
                Gemm("linear_fc2", tokens, h, f / t, False, h))
    gemms = [Gemm("router", shapes.norm_tokens, shapes.num_experts, h, True, quantized=False)]
    if shapes.shared_ffn_hidden_size:
        f = shapes.shared_ffn_hidden_size
        gemms += [Gemm("shared_experts.linear_fc1", tokens, f * width / t, h, True, h),
                  Gemm("shared_experts.linear_fc2", tokens, h, f / t, False, h)]
    f, etp, groups = shapes.expert_ffn_hidden_size, shapes.expert_tensor_parallel_size, shapes.local_experts
    m = shapes.expert_tokens
    return (*gemms, Gemm("experts.linear_fc1", m, f * width / etp, h, True, groups=groups),
            Gemm("experts.linear_fc2", m, h, f / etp, False, groups=groups))


def decoder_gemms(shapes: Shapes, *, moe: bool = False) -> tuple[Gemm, ...]:
    """A decoder layer's linear layers on one GPU: attention, then a dense or a MoE MLP."""
    return (*attention_gemms(shapes), *mlp_gemms(shapes, moe=moe))


def output_gemms(shapes: Shapes) -> tuple[Gemm, ...]:
    """The output projection to the (padded, vocab-parallel) vocabulary."""
    return (Gemm("output_layer", shapes.tokens, shapes.vocab_size / shapes.tensor_model_parallel_size,
                 shapes.hidden_size, True, shapes.hidden_size),)


def eh_proj_gemm(shapes: Shapes) -> Gemm:
    """An MTP block's ``eh_proj``: the concatenated ``[embedding, hidden]`` (``2h``) back to ``h``."""
    h = shapes.hidden_size
    return Gemm("eh_proj", shapes.tokens, h / shapes.tensor_model_parallel_size, 2 * h, True, h)


def mtp_gemms(shapes: Shapes, *, moe: bool = False) -> tuple[Gemm, ...]:
    """One MTP block: eh_proj (``2h -> h``), its decoder layer (the last decoder layer's kind), the shared head."""
    return (eh_proj_gemm(shapes), *decoder_gemms(shapes, moe=moe), *output_gemms(shapes))


def decoder_gemm_flops(shapes: Shapes, *, moe: bool = False) -> tuple[float, ...]:
    """Forward FLOPs of each of a decoder layer's linear layers on one GPU."""
    return tuple(gemm.flops for gemm in decoder_gemms(shapes, moe=moe))


def attention_flops(shapes: Shapes) -> float:
    """Forward FLOPs of ``Q K^T`` plus ``P V`` on one GPU, full square: ``2 b (s/cp) s (q + v) / t``
    (``q`` the query-key width, ``v`` the value width: both heads x kv_channels without MLA)."""
    return (
        2.0 * shapes.micro_batch_size * shapes.local_seq_length * shapes.seq_length
        * (shapes.query_size + shapes.attention_out_size) / shapes.tensor_model_parallel_size
    )


def output_gemm_flops(shapes: Shapes) -> tuple[float, ...]:
    """Forward FLOPs of the output projection to the (padded, vocab-parallel) vocabulary: ``2 T h V / t``."""
    return tuple(gemm.flops for gemm in output_gemms(shapes))


def mtp_gemm_flops(shapes: Shapes, *, moe: bool = False) -> tuple[float, ...]:
    """One MTP block: eh_proj (``2h -> h``), its decoder layer, and the shared output head."""
    return tuple(gemm.flops for gemm in mtp_gemms(shapes, moe=moe))


def _active_weights(gemms: tuple[Gemm, ...], shapes: Shapes) -> float:
    """Weights one token multiplies by: the routed experts' top-k of E, no router (Megatron's count)."""
    total = 0.0
    for gemm in gemms:
        if gemm.name == "router":
            continue
        total += gemm.weights * (shapes.topk / gemm.groups if gemm.name.startswith("experts.") else 1.0)
    return total


def _whole_model_shapes(model: ModelSpec, seq_length: int) -> Shapes:
    from megapipe.records import ParallelSpec, TrainSpec

    return shapes_of(model=model, parallel=ParallelSpec(), train=TrainSpec(seq_length=seq_length))


def matmul_parameter_count(model: ModelSpec) -> int:
    """Weight elements that take part in a GEMM once per token: the ``N`` of the ``6 N`` rule.

    Per decoder layer its attention and MLP matrices, with a MoE layer's routed experts counted top-k
    times (and its router not at all, as Megatron-LM's ``num_floating_point_operations`` counts them);
    each MTP block its ``eh_proj`` and a decoder layer of the last decoder layer's kind; and the output
    head ``V x h`` once per use (the main head and each MTP block's shared head). Excludes the embedding
    lookup, learned positions, norms and biases, which do no matrix multiply.
    """
    shapes = _whole_model_shapes(model, model.seq_length)
    dense = _active_weights(decoder_gemms(shapes), shapes)
    moe = _active_weights(decoder_gemms(shapes, moe=True), shapes) if model.is_moe else dense
    pattern = model.moe_layers
    layers = sum(moe if is_moe else dense for is_moe in pattern)
    h, head = model.hidden_size, padded_vocab_size(model.vocab_size, 1) * model.hidden_size
    last = moe if pattern and pattern[-1] else dense
    return int(round(layers + head + model.mtp_num_layers * (last + 2 * h * h + head)))


def model_flops_per_token(model: ModelSpec, seq_length: int, *, causal: bool = True) -> float:
    """Training FLOPs per token (forward + backward), the planner's MFU numerator.

    Megatron-LM's ``num_floating_point_operations`` (megatron/training/training.py, core_v0.16.1):
    ``6 N`` for N = :func:`matmul_parameter_count` plus, per decoder and MTP layer, the attention core
    ``3 s (q + v)`` with ``q`` the query-key width and ``v`` the value width (heads x kv_channels each
    without MLA; MLA's ``heads (d_qk + d_rope)`` and ``heads d_v``). With ``causal=True`` only the lower
    triangle of the score matrix is counted, as Megatron-LM does and a causal flash kernel works;
    ``causal=False`` counts the full square (PaLM, Chowdhery et al. 2022, App. B; Narayanan et al. 2021).
    Sliding-window or chunked attention is charged in full, as Megatron-LM charges it. With MLA,
    Megatron-LM adds ``6 (r_q + r_kv)`` per layer for the latent norms, and ``6 x 3 h`` per MTP block
    for its norms; so does this.
    """
    shapes = _whole_model_shapes(model, seq_length)
    layers = model.num_layers + model.mtp_num_layers
    attention = (3.0 if causal else 6.0) * layers * seq_length * (shapes.query_size + shapes.attention_out_size)
    # Megatron-LM also counts some norms as one multiply-add per element: MLA's q and kv latent norms,
    # and each MTP block's three (its hidden and embedding norms and its final norm)
    norms = 6.0 * layers * ((shapes.q_lora_rank or 0) + shapes.kv_lora_rank) if shapes.mla else 0.0
    norms += 6.0 * model.mtp_num_layers * 3 * model.hidden_size
    return 6.0 * matmul_parameter_count(model) + attention + norms
