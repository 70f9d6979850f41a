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
"""

from __future__ import annotations

from dataclasses import replace

from megapipe.cost.precision import element_bytes, fp8_weight_copy_bytes
from megapipe.cost.shapes import Shapes, shapes_of
from megapipe.records import Activation, LayerKind, ModelSpec, ParallelSpec, TrainSpec

__all__ = [
    "decoder_params",
    "embedding_params",
    "output_params",
    "mtp_params",
    "parameter_count",
    "matmul_parameter_count",
    "bytes_per_parameter",
    "unit_static_bytes",
]


def _matrices_per_layer(*, hidden: int, query: int, kv: int, ffn: int, gated: bool) -> int:
    """Weight-matrix elements of one decoder layer (what the GEMMs multiply)."""
    return hidden * (query + 2 * kv) + query * hidden + hidden * ffn * (2 if gated else 1) + ffn * hidden


def _decoder_matrices(shapes: Shapes) -> float:
    """Weight-matrix elements of one decoder layer on one tensor-parallel rank."""
    return _matrices_per_layer(hidden=shapes.hidden_size, query=shapes.query_size, kv=shapes.kv_size,
                               ffn=shapes.ffn_hidden_size, gated=shapes.gated) / shapes.tensor_model_parallel_size


def decoder_params(shapes: Shapes) -> float:
    """Parameters of one decoder layer held by one tensor-parallel rank."""
    h, t = shapes.hidden_size, shapes.tensor_model_parallel_size
    if not shapes.gpt_style:
        return _decoder_matrices(shapes) + 2 * h
    column_biases = shapes.query_size + 2 * shapes.kv_size + shapes.ffn_hidden_size
    row_biases = 2 * h
    layer_norms = 2 * 2 * h
    return _decoder_matrices(shapes) + column_biases / t + row_biases + layer_norms


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
    norm = (2 if shapes.gpt_style else 1) * shapes.hidden_size
    head = shapes.vocab_size * shapes.hidden_size / shapes.tensor_model_parallel_size
    return norm + (head if holds_output_weight else 0.0)


def mtp_params(shapes: Shapes) -> float:
    """One multi-token-prediction block: enorm, hnorm, eh_proj (``2h x h``), a decoder layer, a final norm.

    Its embedding and output head are shared with the main model (DeepSeek-V3, Sec. 2.2).
    """
    h, t = shapes.hidden_size, shapes.tensor_model_parallel_size
    norms = 3 * (2 if shapes.gpt_style else 1) * h
    return norms + 2 * h * h / t + decoder_params(shapes)


def parameter_count(model: ModelSpec) -> int:
    """Total parameters of the whole model (unsharded, vocab as given, tied weights counted once)."""
    shapes = shapes_of(model=model, parallel=ParallelSpec(), train=TrainSpec(seq_length=model.seq_length))
    shapes = replace(shapes, vocab_size=model.vocab_size)
    total = model.num_layers * decoder_params(shapes) + model.mtp_num_layers * mtp_params(shapes)
    total += embedding_params(shapes, max_position_embeddings=model.max_position_embeddings or model.seq_length)
    total += output_params(shapes, holds_output_weight=model.untie_embeddings_and_output_weights)
    return int(round(total))


def matmul_parameter_count(model: ModelSpec) -> int:
    """Weight elements that take part in a GEMM once per token: the ``N`` of the ``6 N`` rule.

    Decoder and MTP weight matrices plus the output head ``V x h`` (counted once per use:
    the main head and each MTP block's shared head). Excludes the embedding lookup,
    learned positions, norms and biases, which do no matrix multiply.
    """
    h = model.hidden_size
    per_layer = _matrices_per_layer(
        hidden=h,
        query=model.num_attention_heads * model.head_dim,
        kv=model.num_query_groups * model.head_dim,
        ffn=model.ffn_hidden_size,
        gated=Activation(model.activation) == Activation.swiglu,
    )
    head = model.vocab_size * h
    return model.num_layers * per_layer + head + model.mtp_num_layers * (per_layer + 2 * h * h + head)


def bytes_per_parameter(*, precision: str, parallel: ParallelSpec) -> float:
    """Weights + main grads + fp32 master weights + Adam m, v per parameter, as Megatron allocates them.

    Megatron-LM ``docs/source/api-guide/dist_optimizer.md`` (d = data-parallel shards):

    ======================  ====================  =================
    params / main grads     non-distributed       distributed
    ======================  ====================  =================
    bf16 / fp32             18                    6 + 12 / d
    fp16 / fp16             20                    4 + 16 / d
    fp32 / fp32             16                    8 + 8 / d
    ======================  ====================  =================

    The distributed optimizer shards over the data-parallel group *with* context
    parallelism (``intra_dp_cp`` in ``megatron/core/distributed``), so d = dp * cp.
    """
    element_bytes(precision)  # validates the name
    # fp8 training keeps bf16 weights and fp32 main grads; its FP8 weight copies are unit_static_bytes'.
    replicated, sharded = {"bf16": (6.0, 12.0), "fp8": (6.0, 12.0), "fp16": (4.0, 16.0), "fp32": (8.0, 8.0)}[precision]
    if not parallel.use_distributed_optimizer:
        return replicated + sharded
    return replicated + sharded / (parallel.data_parallel_size * parallel.context_parallel_size)



def _fp8_weights(shapes: Shapes, kind: LayerKind) -> float:
    """GEMM weights Transformer Engine runs in FP8: the decoder's four linear layers (and an MTP block's,
    with its eh_proj); the embedding and the output layer stay bf16."""
    if kind == LayerKind.decoder:
        return _decoder_matrices(shapes)
    if kind == LayerKind.mtp:
        return _decoder_matrices(shapes) + 2 * shapes.hidden_size * shapes.hidden_size / shapes.tensor_model_parallel_size
    return 0.0


def unit_static_bytes(*, kind: LayerKind, params: float, shapes: Shapes, parallel: ParallelSpec,
                      train: TrainSpec) -> float:
    """Weights, main grads and optimizer state of one unit on one GPU, plus FP8 training's weight copies."""
    per_param = bytes_per_parameter(precision=train.precision, parallel=parallel)
    return params * per_param + _fp8_weights(shapes, kind) * fp8_weight_copy_bytes(train)
