"""Tensor sizes of one microbatch on one GPU, derived once from the records.

Every cost formula in ``megapipe.cost`` reads these sizes instead of the five
records, so the parallel sharding rules live in one place:

- tensor parallelism (``t``) shards attention heads, query groups, the FFN width
  and the vocabulary (Shoeybi et al. 2019, "Megatron-LM", Sec. 3);
- sequence parallelism shards the sequence of the norm/dropout/residual regions
  by ``t`` (Korthikanti et al. 2022, Sec. 4.2.2);
- context parallelism shards the sequence of everything by ``cp``; attention
  keys and values still span the whole sequence (ring attention).

Model-family convention. ``ModelSpec`` has no bias, norm or dropout fields, so
megapipe follows the two families Megatron's recipes ship:

- ``activation=gelu`` (GPT-2/3 style, Megatron's TransformerConfig defaults):
  LayerNorm (weight + bias), biases on every linear layer, hidden and attention
  dropout 0.1;
- ``activation=swiglu`` (Llama style): RMSNorm (weight only), no biases, no
  dropout (dropout with p=0 keeps no mask);
- ``activation=squared_relu`` (Nemotron): as swiglu but one ``f``-wide fc1, like GELU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megapipe.cost.precision import element_bytes, gemm_dtype
from megapipe.errors import ConfigError
from megapipe.records import (
    Activation,
    AttentionBackend,
    ModelSpec,
    ParallelSpec,
    Recompute,
    RuntimeFeatures,
    TrainSpec,
)

__all__ = ["Shapes", "shapes_of", "padded_vocab_size", "forced_balance_imbalance", "MAKE_VOCAB_SIZE_DIVISIBLE_BY"]

MAKE_VOCAB_SIZE_DIVISIBLE_BY = 128
"""Megatron-LM's default ``--make-vocab-size-divisible-by``."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Shapes:
    """Sizes for one microbatch on one GPU; ``*_size`` fields are whole-model widths."""

    seq_length: int
    """Full sequence s (attention keys span all of it)."""
    local_seq_length: int
    """s / context_parallel_size: the queries and tokens this GPU holds."""
    micro_batch_size: int
    hidden_size: int
    query_size: int
    """num_attention_heads * kv_channels."""
    kv_size: int
    """num_query_groups * kv_channels."""
    ffn_hidden_size: int
    vocab_size: int
    """Padded as Megatron pads it for this tensor-parallel size."""
    num_attention_heads: int
    head_dim: int
    tensor_model_parallel_size: int
    context_parallel_size: int
    sequence_parallel: bool
    element_bytes: int
    """Bytes of one activation/weight element (2 for bf16/fp16/fp8, 4 for fp32)."""
    gemm_dtype: str
    """What the decoder's linear layers multiply in: bf16, fp8 or fp32 (:mod:`megapipe.cost.precision`)."""
    fp8_recipe: str
    gated: bool
    """SwiGLU: linear_fc1 is 2 * ffn_hidden_size wide."""
    gpt_style: bool
    """LayerNorm + biases + dropout (gelu family); RMSNorm, no biases, no dropout otherwise."""
    learned_positions: bool
    unfused_attention: bool
    recompute: Recompute
    value_size: int = 0
    """Width of V (kv_size for GQA; heads x v_head_dim with MLA, whose K and V span every head)."""
    attention_out_size: int = 0
    """Width of the attention output, linear_proj's input (query_size for GQA; heads x v_head_dim with MLA)."""
    mla: bool = False
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    rope_head_dim: int = 0
    """MLA's per-head RoPE width, shared by every head in the kv latent."""
    num_experts: int = 0
    topk: int = 0
    expert_ffn_hidden_size: int = 0
    shared_ffn_hidden_size: int = 0
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int = 1
    moe_load_imbalance: float = 1.0
    """The busiest expert-parallel rank's tokens over the mean: the stated routing assumption, or with forced
    balancing the statistical spread of random routing (:func:`forced_balance_imbalance`)."""
    features: RuntimeFeatures = RuntimeFeatures()
    moe_router_num_groups: int = 0
    moe_router_group_topk: int = 0
    biases: bool = False
    """Biases on every linear layer (the gelu family, or ``add_bias_linear``)."""
    qk_layernorm: bool = False

    @property
    def allgather_dispatcher(self) -> bool:
        return self.features.moe_token_dispatcher_type == "allgather"

    @property
    def dispatcher(self) -> str:
        """alltoall, allgather, deepep or hybridep."""
        return self.features.dispatcher

    @property
    def local_experts(self) -> int:
        """Routed experts per MoE layer on this GPU: num_experts / EP."""
        return self.num_experts // self.expert_model_parallel_size

    @property
    def expert_tokens(self) -> float:
        """Token-expert assignments one GPU's experts process per MoE layer, balanced routing.

        A GPU routes its sequence-parallel share ``tokens / t`` to ``topk`` experts each; the alltoall
        dispatcher sends them over EP and all-gathers them over expert TP, so a GPU of the ETP x EP x EDP
        expert grid processes ``tokens x topk x ETP / t`` of them (each at ``1/ETP`` of the expert width).
        """
        return self.tokens * self.topk * self.expert_tensor_parallel_size / self.tensor_model_parallel_size

    @property
    def tokens(self) -> int:
        """Tokens entering the GEMMs on this GPU: local sequence x micro-batch."""
        return self.local_seq_length * self.micro_batch_size

    @property
    def norm_tokens(self) -> float:
        """Tokens in the norm/dropout/residual regions: divided by t under sequence parallelism."""
        return self.tokens / (self.tensor_model_parallel_size if self.sequence_parallel else 1)

    @property
    def dropout(self) -> bool:
        return self.gpt_style


def padded_vocab_size(vocab_size: int, tensor_model_parallel_size: int) -> int:
    """Megatron-LM's ``_vocab_size_with_padding``: round up to a multiple of 128 * t."""
    multiple = MAKE_VOCAB_SIZE_DIVISIBLE_BY * tensor_model_parallel_size
    return math.ceil(vocab_size / multiple) * multiple


def shapes_of(*, model: ModelSpec, parallel: ParallelSpec, train: TrainSpec) -> Shapes:
    """Validate the sharding against Megatron's divisibility rules and return the per-GPU sizes."""
    _validate(model=model, parallel=parallel, train=train)
    tp = parallel.tensor_model_parallel_size
    heads = model.num_attention_heads
    if model.multi_latent_attention:
        qk = model.qk_head_dim + model.qk_pos_emb_head_dim
        query, key, value, out = heads * qk, heads * qk, heads * model.v_head_dim, heads * model.v_head_dim
    else:
        query, key = heads * model.head_dim, model.num_query_groups * model.head_dim
        value, out = key, query
    return Shapes(
        value_size=value, attention_out_size=out, mla=model.multi_latent_attention,
        q_lora_rank=model.q_lora_rank or 0, kv_lora_rank=model.kv_lora_rank if model.multi_latent_attention else 0,
        rope_head_dim=model.qk_pos_emb_head_dim if model.multi_latent_attention else 0,
        num_experts=model.num_moe_experts, topk=model.moe_router_topk if model.is_moe else 0,
        expert_ffn_hidden_size=model.expert_ffn_hidden_size if model.is_moe else 0,
        shared_ffn_hidden_size=model.moe_shared_expert_intermediate_size,
        expert_model_parallel_size=parallel.expert_model_parallel_size,
        expert_tensor_parallel_size=parallel.expert_tp,
        moe_load_imbalance=_imbalance(model, parallel, train),
        features=parallel.features,
        moe_router_num_groups=model.moe_router_num_groups or 0, moe_router_group_topk=model.moe_router_group_topk or 0,
        biases=(model.add_bias_linear if model.add_bias_linear is not None
                else Activation(model.activation) == Activation.gelu),
        qk_layernorm=model.qk_layernorm,
        seq_length=train.seq_length,
        local_seq_length=train.seq_length // parallel.context_parallel_size,
        micro_batch_size=train.micro_batch_size,
        hidden_size=model.hidden_size,
        query_size=query,
        kv_size=key,
        ffn_hidden_size=model.ffn_hidden_size,
        vocab_size=padded_vocab_size(model.vocab_size, tp),
        num_attention_heads=model.num_attention_heads,
        head_dim=model.head_dim,
        tensor_model_parallel_size=tp,
        context_parallel_size=parallel.context_parallel_size,
        sequence_parallel=parallel.sequence_parallel and tp > 1,
        element_bytes=element_bytes(train.precision),
        gemm_dtype=gemm_dtype(train.precision),
        fp8_recipe=train.fp8_recipe,
        gated=Activation(model.activation) == Activation.swiglu,
        gpt_style=Activation(model.activation) == Activation.gelu,
        learned_positions=model.position_embedding_type == "learned_absolute",
        unfused_attention=AttentionBackend(model.attention_backend) == AttentionBackend.unfused,
        recompute=Recompute(train.recompute_granularity),
    )


def forced_balance_imbalance(*, assignments: float, ranks: int) -> float:
    """The busiest of ``ranks`` ranks' share over the mean when ``assignments`` token-expert pairs per rank are
    routed at random (``moe_router_force_load_balancing``: random logits): a rank's count is about Poisson
    with mean ``assignments``, and the maximum of ``ranks`` such counts lies ``sqrt(2 ln ranks)`` standard
    deviations above the mean (the Gaussian extreme-value bound)."""
    if ranks <= 1 or assignments <= 0:
        return 1.0
    return 1.0 + math.sqrt(2.0 * math.log(ranks) / assignments)


def _imbalance(model: ModelSpec, parallel: ParallelSpec, train: TrainSpec) -> float:
    """The busiest EP rank's load factor: random routing's spread under forced balancing, else the stated one
    (never below the spread random routing already has)."""
    if not model.is_moe:
        return 1.0
    tokens = train.seq_length // parallel.context_parallel_size * train.micro_batch_size
    assignments = tokens * model.moe_router_topk * parallel.expert_tp / parallel.tensor_model_parallel_size
    spread = forced_balance_imbalance(assignments=assignments, ranks=parallel.expert_model_parallel_size)
    if parallel.features.moe_router_force_load_balancing or train.moe_load_imbalance is None:
        return spread
    return max(train.moe_load_imbalance, spread)


def _validate(*, model: ModelSpec, parallel: ParallelSpec, train: TrainSpec) -> None:
    positive = {
        "model.num_layers": model.num_layers, "model.hidden_size": model.hidden_size,
        "model.num_attention_heads": model.num_attention_heads, "model.num_query_groups": model.num_query_groups,
        "model.ffn_hidden_size": model.ffn_hidden_size, "model.vocab_size": model.vocab_size,
        "train.seq_length": train.seq_length, "train.micro_batch_size": train.micro_batch_size,
        "parallel.tensor_model_parallel_size": parallel.tensor_model_parallel_size,
        "parallel.context_parallel_size": parallel.context_parallel_size,
        "parallel.data_parallel_size": parallel.data_parallel_size,
    }
    for key, value in positive.items():
        if value < 1:
            raise ConfigError(f"{key}={value} must be >= 1")
    if model.num_attention_heads % model.num_query_groups:
        raise ConfigError(
            f"model.num_attention_heads={model.num_attention_heads} is not a multiple of "
            f"model.num_query_groups={model.num_query_groups}; pick a divisor"
        )
    tp = parallel.tensor_model_parallel_size
    for key, value in (("model.num_query_groups", model.num_query_groups),
                       ("model.ffn_hidden_size", model.ffn_hidden_size)):
        if value % tp and not (key == "model.num_query_groups" and model.multi_latent_attention):
            raise ConfigError(f"{key}={value} is not divisible by tensor_model_parallel_size={tp}; pick a divisor")
    _validate_experts(model=model, parallel=parallel)
    if parallel.sequence_parallel and tp > 1 and (train.seq_length // parallel.context_parallel_size) % tp:
        raise ConfigError(
            f"train.seq_length={train.seq_length} / context_parallel_size={parallel.context_parallel_size} is not "
            f"divisible by tensor_model_parallel_size={tp} as sequence_parallel needs; change one of them"
        )
    cp = parallel.context_parallel_size
    if cp > 1 and train.seq_length % (2 * cp):
        raise ConfigError(
            f"train.seq_length={train.seq_length} is not divisible by 2 * context_parallel_size={2 * cp} "
            "(Megatron's load-balanced context parallelism); change one of them"
        )


def _validate_experts(*, model: ModelSpec, parallel: ParallelSpec) -> None:
    """megatron-core's expert rules: EP divides the experts, ETP the expert width, ETP x EP x PP the world."""
    ep, etp = parallel.expert_model_parallel_size, parallel.expert_tp
    if not model.is_moe:
        if ep > 1:
            raise ConfigError(f"parallel.expert_model_parallel_size={ep} needs a MoE model (model.num_moe_experts > 0)")
        return
    if model.num_moe_experts % ep:
        raise ConfigError(f"model.num_moe_experts={model.num_moe_experts} is not divisible by "
                          f"expert_model_parallel_size={ep}; pick a divisor")
    if model.expert_ffn_hidden_size % etp:
        raise ConfigError(f"model.moe_ffn_hidden_size={model.expert_ffn_hidden_size} is not divisible by "
                          f"expert_tensor_parallel_size={etp}; pick a divisor")
    world = parallel.world_size
    if world % (etp * ep * parallel.pipeline_model_parallel_size):
        raise ConfigError(f"world size {world} is not divisible by ETP x EP x PP = {etp} x {ep} x "
                          f"{parallel.pipeline_model_parallel_size} (megatron-core's expert grid); change EP or ETP")
