"""Parameter counts per pipeline unit, and the bytes of weights, gradients and optimizer state.

Weights per decoder layer (Megatron's GPTModel layer spec; ``q = heads * kv_channels``,
``kv = query_groups * kv_channels``, ``f = ffn_hidden_size``):

- linear_qkv ``h x (q + 2 kv)``, linear_proj ``q x h``;
- linear_fc1 ``h x f`` (GELU) or ``h x 2f`` (SwiGLU: gate and up fused), linear_fc2 ``f x h``;
- two norms: ``2h`` each for LayerNorm, ``h`` for RMSNorm; biases on every linear for the
  gelu family (see :mod:`megapipe.cost.shapes` for the family convention).

For GPT-3 (MHA, f = 4h) this is the familiar ``12 h^2 + 13 h`` (Narayanan et al. 2021, eq. 2).
Under tensor parallelism the weight matrices and the column-parallel biases are divided
by t; norms and row-parallel biases are replicated on every tensor-parallel rank.

The weights are those of the layer's GEMMs (:mod:`megapipe.cost.flops`), so multi-latent attention
(its replicated down-projections and latent norms), a MoE layer's router, shared experts and routed
experts (E/EP per GPU, each split ETP ways) follow from the same list. Checked against the published
totals and active counts of DeepSeek-V3, Qwen3, Mixtral, GPT-OSS and Llama 4 Scout in
``tests/test_moe.py`` and ``docs/cost_model.md``.
"""

from __future__ import annotations

from dataclasses import replace

from megapipe.cost.flops import Gemm, decoder_gemms, eh_proj_gemm
from megapipe.cost.model_state import bytes_per_parameter as state_bytes_per_parameter
from megapipe.cost.model_state import fp8_copies_persist
from megapipe.cost.precision import element_bytes, fp8_weight_copy_bytes
from megapipe.cost.shapes import Shapes, shapes_of
from megapipe.records import LayerKind, ModelSpec, ParallelSpec, TrainSpec

__all__ = [
    "decoder_params",
    "expert_params",
    "embedding_params",
    "output_params",
    "mtp_params",
    "parameter_count",
    "active_parameter_count",
    "bytes_per_parameter",
    "unit_static_bytes",
    "fp8_weights",
]


def _norm(shapes: Shapes, width: float) -> float:
    """A LayerNorm (weight and bias) for the gelu family, an RMSNorm (weight) otherwise."""
    return (2 if shapes.gpt_style else 1) * width


def _gemm_params(gemm: Gemm, shapes: Shapes) -> float:
    """A linear layer's weights and, with biases, one per output column on this GPU (a row-parallel
    layer's bias is replicated, a column-parallel one sharded like its weight)."""
    return gemm.weights + (gemm.groups * gemm.n if shapes.biases else 0.0)


def _layer_norms(shapes: Shapes) -> float:
    """Input and pre-MLP norms, and the query/key norms: per head (``2 d``) with GQA, the q and kv
    latents (``r_q + r_kv``) with MLA."""
    norms = 2 * _norm(shapes, shapes.hidden_size)
    if shapes.mla:
        norms += _norm(shapes, shapes.q_lora_rank + shapes.kv_lora_rank) if shapes.qk_layernorm else 0.0
    elif shapes.qk_layernorm:
        norms += 2 * _norm(shapes, shapes.head_dim)
    return norms


def decoder_params(shapes: Shapes, *, moe: bool = False) -> float:
    """Parameters of one decoder layer held by one GPU (its experts' share: :func:`expert_params`)."""
    return _layer_norms(shapes) + sum(_gemm_params(gemm, shapes) for gemm in decoder_gemms(shapes, moe=moe))


def expert_params(shapes: Shapes, *, moe: bool = True) -> float:
    """The routed experts' parameters of one MoE layer on one GPU: E/EP experts, each split ETP ways."""
    if not moe or not shapes.num_experts:
        return 0.0
    return sum(_gemm_params(gemm, shapes) for gemm in decoder_gemms(shapes, moe=True)
               if gemm.name.startswith("experts."))


def embedding_params(shapes: Shapes, *, max_position_embeddings: int) -> float:
    """Vocab-parallel word embedding (``V/t x h``) plus replicated learned positions (``s_max x h``)."""
    word = shapes.vocab_size * shapes.hidden_size / shapes.tensor_model_parallel_size
    positions = max_position_embeddings * shapes.hidden_size if shapes.learned_positions else 0
    return word + positions


def output_params(shapes: Shapes, *, holds_output_weight: bool) -> float:
    """Final norm plus, when this stage owns a copy, the column-parallel output projection ``h x V/t``.

    Megatron keeps a copy of a tied word embedding on the last pipeline stage
    (``setup_embeddings_and_output_layer``), so the output unit owns weights
    unless the model is tied and everything sits on one stage.
    """
    head = shapes.vocab_size * shapes.hidden_size / shapes.tensor_model_parallel_size
    return _norm(shapes, shapes.hidden_size) + (head if holds_output_weight else 0.0)


def mtp_params(shapes: Shapes, *, moe: bool = False) -> float:
    """One multi-token-prediction block: enorm, hnorm, eh_proj (``2h x h``), a decoder layer of the last
    decoder layer's kind, a final norm. Its embedding and output head are shared with the main model
    (DeepSeek-V3, Sec. 2.2)."""
    return 3 * _norm(shapes, shapes.hidden_size) + _gemm_params(eh_proj_gemm(shapes), shapes) + decoder_params(
        shapes, moe=moe)


def _whole(model: ModelSpec) -> Shapes:
    shapes = shapes_of(model=model, parallel=ParallelSpec(), train=TrainSpec(seq_length=model.seq_length))
    return replace(shapes, vocab_size=model.vocab_size)


def parameter_count(model: ModelSpec, *, mtp: bool = True) -> int:
    """Total parameters of the whole model (unsharded, vocab as given, tied weights counted once);
    ``mtp=False`` leaves out the MTP blocks, as published totals of the main model do (DeepSeek-V3)."""
    shapes = _whole(model)
    pattern = model.moe_layers
    total = sum(decoder_params(shapes, moe=is_moe) for is_moe in pattern)
    if mtp:
        total += model.mtp_num_layers * mtp_params(shapes, moe=bool(pattern and pattern[-1]))
    total += embedding_params(shapes, max_position_embeddings=model.max_position_embeddings or model.seq_length)
    total += output_params(shapes, holds_output_weight=model.untie_embeddings_and_output_weights)
    return int(round(total))


def active_parameter_count(model: ModelSpec, *, embedding: bool = True, output: bool = True,
                           mtp: bool = False) -> int:
    """Parameters one token uses: the routed experts' top-k of E (router and shared experts in full).

    Publishers differ on the vocabulary tables: Mixtral, Qwen3 and Llama 4 count the embedding and the
    output head, GPT-OSS the head only (its embedding is a lookup), DeepSeek-V3's 36.7B the same way
    (its README_WEIGHTS); pass ``embedding``/``output`` to match. MTP blocks are left out by default.
    """
    shapes = _whole(model)
    total = parameter_count(model, mtp=mtp)
    if model.is_moe:
        unused = expert_params(shapes) * (1 - model.moe_router_topk / model.num_moe_experts)
        layers = sum(model.moe_layers) + (model.mtp_num_layers if mtp and model.moe_layers[-1] else 0)
        total -= layers * unused
    tables = (not embedding) + (not output)
    if not model.untie_embeddings_and_output_weights:  # one table serves both
        tables = 1 if tables == 2 else 0
    return int(round(total - tables * shapes.vocab_size * shapes.hidden_size))


def bytes_per_parameter(*, precision: str, parallel: ParallelSpec, expert: bool = False,
                        grad_reduce_in_fp32: bool = True, train: TrainSpec | None = None) -> float:
    """Weights + main grads + master weights + Adam moments per parameter, as Megatron allocates them (the table,
    its sharding, the precision-aware optimizer, offloading and Megatron FSDP: :mod:`megapipe.cost.model_state`).

    ``train`` states the optimizer settings; without it, Megatron's defaults at ``precision`` and
    ``grad_reduce_in_fp32``. Routed-expert parameters (``expert=True``) shard over the expert data-parallel group.
    """
    element_bytes(precision)  # validates the name
    if train is None:
        train = TrainSpec(precision=precision, grad_reduce_in_fp32=grad_reduce_in_fp32)
    return state_bytes_per_parameter(train=train, parallel=parallel, expert=expert)


def fp8_weights(shapes: Shapes, kind: LayerKind, *, moe: bool = False) -> float:
    """GEMM weights Transformer Engine runs in FP8: the decoder's linear layers but the router (and an MTP
    block's, with its eh_proj); the embedding and the output layer stay bf16."""
    if kind not in (LayerKind.decoder, LayerKind.mtp):
        return 0.0
    gemms = decoder_gemms(shapes, moe=moe) + ((eh_proj_gemm(shapes),) if kind == LayerKind.mtp else ())
    return sum(gemm.weights for gemm in gemms if gemm.quantized)


def unit_static_bytes(*, kind: LayerKind, params: float, shapes: Shapes, parallel: ParallelSpec,
                      train: TrainSpec, expert_params: float = 0.0) -> float:
    """Weights, main grads and optimizer state of one unit on one GPU, plus FP8 training's weight copies.

    ``params`` includes the unit's routed-expert parameters ``expert_params``, whose optimizer state
    shards over expert data parallelism instead.
    """
    dense = bytes_per_parameter(precision=train.precision, parallel=parallel, train=train)
    expert = bytes_per_parameter(precision=train.precision, parallel=parallel, expert=True, train=train) \
        if expert_params else 0.0
    copies = fp8_weight_copy_bytes(train) if fp8_copies_persist(parallel) else 0.0
    fp8 = fp8_weights(shapes, kind, moe=expert_params > 0) * copies if copies else 0.0
    return (params - expert_params) * dense + expert_params * expert + fp8
