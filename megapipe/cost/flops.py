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

from megapipe.cost.params import matmul_parameter_count
from megapipe.cost.shapes import Shapes
from megapipe.records import ModelSpec

__all__ = [
    "Gemm",
    "decoder_gemms",
    "output_gemms",
    "mtp_gemms",
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
    """

    name: str
    tokens: float
    n: float
    k: float
    column_parallel: bool
    """Column-parallel (input all-gathered under SP, output sharded) or row-parallel (input sharded,
    output all-reduced, or reduce-scattered under SP): what its TP collective overlaps with."""

    @property
    def flops(self) -> float:
        return 2.0 * self.tokens * self.n * self.k


def decoder_gemms(shapes: Shapes) -> tuple[Gemm, ...]:
    """linear_qkv, linear_proj, linear_fc1 (``2f`` wide for SwiGLU), linear_fc2 on one GPU."""
    tokens, h, t = shapes.tokens, shapes.hidden_size, shapes.tensor_model_parallel_size
    q, kv, f = shapes.query_size, shapes.kv_size, shapes.ffn_hidden_size
    return (
        Gemm("linear_qkv", tokens, (q + 2 * kv) / t, h, True),
        Gemm("linear_proj", tokens, h, q / t, False),
        Gemm("linear_fc1", tokens, f * (2 if shapes.gated else 1) / t, h, True),
        Gemm("linear_fc2", tokens, h, f / t, False),
    )


def output_gemms(shapes: Shapes) -> tuple[Gemm, ...]:
    """The output projection to the (padded, vocab-parallel) vocabulary."""
    return (Gemm("output_layer", shapes.tokens, shapes.vocab_size / shapes.tensor_model_parallel_size,
                 shapes.hidden_size, True),)


def mtp_gemms(shapes: Shapes) -> tuple[Gemm, ...]:
    """One MTP block: eh_proj (``2h -> h``), its decoder layer, and the shared output head."""
    t = shapes.tensor_model_parallel_size
    eh_proj = Gemm("eh_proj", shapes.tokens, shapes.hidden_size / t, 2 * shapes.hidden_size, True)
    return (eh_proj, *decoder_gemms(shapes), *output_gemms(shapes))


def decoder_gemm_flops(shapes: Shapes) -> tuple[float, ...]:
    """Forward FLOPs of linear_qkv, linear_proj, linear_fc1, linear_fc2 on one GPU."""
    return tuple(gemm.flops for gemm in decoder_gemms(shapes))


def attention_flops(shapes: Shapes) -> float:
    """Forward FLOPs of ``Q K^T`` plus ``P V`` on one GPU, full square: ``4 b (s/cp) s q / t``."""
    return (
        4.0 * shapes.micro_batch_size * shapes.local_seq_length * shapes.seq_length * shapes.query_size
        / shapes.tensor_model_parallel_size
    )


def output_gemm_flops(shapes: Shapes) -> tuple[float, ...]:
    """Forward FLOPs of the output projection to the (padded, vocab-parallel) vocabulary: ``2 T h V / t``."""
    return tuple(gemm.flops for gemm in output_gemms(shapes))


def mtp_gemm_flops(shapes: Shapes) -> tuple[float, ...]:
    """One MTP block: eh_proj (``2h -> h``), its decoder layer, and the shared output head."""
    return tuple(gemm.flops for gemm in mtp_gemms(shapes))


def model_flops_per_token(model: ModelSpec, seq_length: int, *, causal: bool = True) -> float:
    """Training FLOPs per token (forward + backward), the planner's MFU numerator.

    ``6 N + 6 L s q`` with N = :func:`~megapipe.cost.params.matmul_parameter_count`
    (weight matrices and the output head; no embedding lookup, norms or biases),
    L = decoder plus MTP layers, s = seq_length, q = heads * kv_channels (= hidden for
    most models). The attention term is ``3 (fwd + bwd) x 2 matmuls x 2 s q / 2``:
    with ``causal=True`` only the lower triangle of the score matrix is counted
    (the work a causal flash kernel does; PaLM, Chowdhery et al. 2022, App. B counts
    the full square, ``12 L s q``, as does Megatron-LM's throughput log: pass
    ``causal=False`` to match those).
    """
    layers = model.num_layers + model.mtp_num_layers
    query = model.num_attention_heads * model.head_dim
    attention = (6.0 if causal else 12.0) * layers * seq_length * query
    return 6.0 * matmul_parameter_count(model) + attention
