"""Frozen domain records shared by megapipe's pure core.

The Hydra config is turned into these records once (``megapipe.config.to_records``);
everything downstream (cost, partition, schedules, simulate, plan, emit) takes and
returns records only. Fields use Megatron's names where Megatron has one, and carry
their unit in the name otherwise.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from megapipe.errors import ProfileError
from megapipe.units import GIB

__all__ = [
    "Activation",
    "AttentionBackend",
    "Recompute",
    "LayerKind",
    "ModelSpec",
    "MOE_MODEL_FIELDS",
    "MLA_MODEL_FIELDS",
    "PARALLEL_MEMORY_FIELDS",
    "TRAIN_MEMORY_FIELDS",
    "GpuSpec",
    "LinkSpec",
    "NodeGroup",
    "ClusterSpec",
    "RuntimeSpec",
    "RuntimeFeatures",
    "ParallelSpec",
    "TrainSpec",
    "LayerCost",
    "Profile",
    "StageSpec",
    "SEARCH_DIMENSIONS",
    "TIME_PARTS",
    "BOUNDS",
    "bounded",
]

BOUNDS = {
    "positive": "a finite number > 0",
    "non_negative": "a finite number >= 0",
    "fraction": "a share of the whole in (0, 1]",
    "fraction_or_zero": "0 or a share of the whole in (0, 1]",
}
"""What a record field's ``bound`` metadata allows; :func:`megapipe.config.validate.check_bounds` enforces it."""


def bounded(bound: str, default=None, *, required: bool = False):
    """A record field with its bound (a :data:`BOUNDS` key) beside its default, so docs, default and bound of a
    setting sit in one declaration."""
    if bound not in BOUNDS:
        raise ValueError(f"bound {bound!r} is not one of {sorted(BOUNDS)}")
    if required:
        return field(metadata={"bound": bound})
    return field(default=default, metadata={"bound": bound})

SEARCH_DIMENSIONS = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size",
    "context_parallel_size",
    "sequence_parallel",
    "micro_batch_size",
    "recompute_granularity",
    "schedule",
    "expert_model_parallel_size",
    "expert_tensor_parallel_size",
    "moe_token_dispatcher_type",
    "overlap_moe_expert_parallel_comm",
    "cuda_graph_scope",
)
"""What ``megapipe plan`` searches when left null; data_parallel_size is what is left of the GPUs. The last three
are MoE runtime features (:data:`megapipe.features.SEARCHED`): the dispatcher (alltoall, deepep, hybridep),
EP overlap, and the CUDA-graph implementation with its scope."""


class Activation(str, enum.Enum):
    gelu = "gelu"
    swiglu = "swiglu"
    squared_relu = "squared_relu"
    """Nemotron's ReLU(x)^2: one fc1 width like GELU, no biases or dropout like the Llama family."""


class AttentionBackend(str, enum.Enum):
    """flash and fused keep no s x s score tensor; unfused does (Korthikanti's 5as/h term)."""

    flash = "flash"
    fused = "fused"
    unfused = "unfused"


class Recompute(str, enum.Enum):
    """Megatron's recompute_granularity; ``none`` is emitted to Megatron as null."""

    none = "none"
    selective = "selective"
    full = "full"


class LayerKind(str, enum.Enum):
    """A pipeline unit, as Megatron's layout letters name them (E, t, m, L)."""

    embedding = "embedding"
    decoder = "decoder"
    loss = "loss"
    mtp = "mtp"


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSpec:
    """A decoder-only transformer, in Megatron's TransformerConfig names."""

    name: str
    """The model's name, as plans and files label it (a hydra_conf/model option, or the Hugging Face model_type)."""
    num_layers: int
    """Decoder layers (Megatron num_layers)."""
    hidden_size: int
    """Width of the residual stream (Megatron --hidden-size)."""
    num_attention_heads: int
    """Query heads per layer (Megatron --num-attention-heads)."""
    num_query_groups: int
    """Key/value heads (GQA); equal to num_attention_heads for plain multi-head attention."""
    ffn_hidden_size: int
    """Width of a dense layer's MLP (Megatron --ffn-hidden-size)."""
    vocab_size: int
    """Padded vocabulary size, as Megatron builds it."""
    seq_length: int
    """Default training sequence length in tokens."""
    activation: Activation = Activation.swiglu
    """The MLP's activation: swiglu (gated: a third weight matrix), gelu or squared_relu."""
    untie_embeddings_and_output_weights: bool = True
    """Separate input embedding and output layer weights (Megatron --untie-embeddings-and-output-weights)."""
    position_embedding_type: str = "rope"
    """rope, learned_absolute or none; learned_absolute adds seq_length x hidden_size parameters."""
    attention_backend: AttentionBackend = AttentionBackend.flash
    """flash, fused or unfused attention kernels (unfused keeps the s x s scores for the backward)."""
    kv_channels: int | None = None
    """Per-head dimension; hidden_size // num_attention_heads when None."""
    mtp_num_layers: int = 0
    """Multi-token-prediction layers (layout letter m) placed before the loss."""
    max_position_embeddings: int | None = None
    """Positions the embedding table (learned_absolute) or RoPE covers; seq_length when None."""
    rotary_base: float = 10000.0
    """RoPE's theta (Megatron --rotary-base); Llama 3 uses 500,000."""
    use_rope_scaling: bool = False
    """Llama 3.1's RoPE frequency scaling (Megatron --use-rope-scaling; low/high frequency factors 1 and 4 over
    an original 8,192 positions). Changes no cost."""
    rope_scaling_factor: float = 8.0
    """Its factor (Megatron --rope-scaling-factor)."""
    add_qkv_bias: bool = False
    """Biases on the query, key and value projections only (Qwen2 and Qwen2.5; Megatron --add-qkv-bias); implied
    by add_bias_linear. Their (heads + 2 x groups) x head_dim parameters per layer are left out of the memory."""
    norm_epsilon: float = 1e-5
    """The normalisation's epsilon (Megatron --norm-epsilon)."""
    qk_layernorm: bool = False
    """Normalise queries and keys per head (Qwen3; with MLA, the q and kv latents)."""
    not_modelled: tuple[str, ...] = ()
    """Features of the real model that are neither costed nor emitted; plans warn about each."""
    add_bias_linear: bool | None = None
    """Biases on every linear layer (Megatron --add-bias-linear); None follows the activation's family
    (gelu: yes, swiglu and squared_relu: no). GPT-OSS sets it with swiglu."""
    # -- mixture of experts (megatron-core TransformerConfig names) --------------------------------------
    num_moe_experts: int = 0
    """Routed experts per MoE layer (Megatron --num-experts); 0 is a dense model."""
    moe_ffn_hidden_size: int | None = None
    """One routed expert's FFN width; ffn_hidden_size when None."""
    moe_router_topk: int = 2
    """Routed experts each token goes to (Megatron --moe-router-topk)."""
    moe_shared_expert_intermediate_size: int = 0
    """All shared experts of a MoE layer together (n_shared x their width); 0 means none."""
    moe_layer_freq: tuple[int, ...] = ()
    """Per decoder layer, 1 for MoE and 0 for dense; empty means every layer is MoE (with experts)."""
    moe_router_score_function: str = "softmax"
    """softmax or sigmoid (DeepSeek-V3) router scores (Megatron --moe-router-score-function)."""
    moe_router_pre_softmax: bool = False
    """Softmax before the top-k instead of after it (Megatron --moe-router-pre-softmax)."""
    moe_router_enable_expert_bias: bool = False
    """Aux-loss-free balancing with a per-expert score bias (Megatron --moe-router-enable-expert-bias)."""
    moe_router_num_groups: int | None = None
    """Expert groups for group-limited routing (DeepSeek's node-limited routing); None routes over all experts."""
    moe_router_group_topk: int | None = None
    """Groups a token may be routed to with group-limited routing."""
    moe_router_topk_scaling_factor: float | None = None
    """Scale of the top-k routing weights (DeepSeek-V3: 2.5); None leaves them unscaled."""
    moe_router_load_balancing_type: str = "aux_loss"
    """aux_loss, seq_aux_loss, global_aux_loss, sinkhorn or none (Megatron --moe-router-load-balancing-type)."""
    moe_aux_loss_coeff: float = 0.0
    """Weight of the load-balancing loss (Megatron --moe-aux-loss-coeff)."""
    # -- multi-latent attention (DeepSeek) ----------------------------------------------------------------
    multi_latent_attention: bool = False
    """DeepSeek's multi-latent attention (MLA) instead of grouped-query attention."""
    q_lora_rank: int | None = None
    """Query latent width; None projects queries directly."""
    kv_lora_rank: int = 512
    """Key/value latent width (MLA)."""
    qk_head_dim: int = 128
    """Per-head query/key width without RoPE (HF qk_nope_head_dim)."""
    qk_pos_emb_head_dim: int = 64
    """Per-head RoPE width of queries and keys (HF qk_rope_head_dim)."""
    v_head_dim: int = 128
    """Per-head value width (MLA)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "moe_layer_freq", tuple(int(v) for v in self.moe_layer_freq))
        object.__setattr__(self, "not_modelled", tuple(str(v) for v in self.not_modelled))

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def is_moe(self) -> bool:
        return self.num_moe_experts > 0

    @property
    def expert_ffn_hidden_size(self) -> int:
        return self.moe_ffn_hidden_size or self.ffn_hidden_size

    @property
    def moe_layers(self) -> tuple[bool, ...]:
        """Per decoder layer: MoE (True) or dense; all dense without experts."""
        if not self.is_moe:
            return (False,) * self.num_layers
        if not self.moe_layer_freq:
            return (True,) * self.num_layers
        return tuple(bool(v) for v in self.moe_layer_freq)

    @property
    def unused_fields(self) -> tuple[str, ...]:
        """The fields that do not apply to this model: the MoE ones of a dense model, the MLA ones without
        multi-latent attention (a plan's record leaves them out)."""
        return (() if self.is_moe else MOE_MODEL_FIELDS) + (() if self.multi_latent_attention else MLA_MODEL_FIELDS)


MOE_MODEL_FIELDS = ("num_moe_experts", "moe_ffn_hidden_size", "moe_router_topk", "moe_shared_expert_intermediate_size",
                    "moe_layer_freq", "moe_router_score_function", "moe_router_pre_softmax",
                    "moe_router_enable_expert_bias", "moe_router_num_groups", "moe_router_group_topk",
                    "moe_router_topk_scaling_factor", "moe_router_load_balancing_type", "moe_aux_loss_coeff")
"""ModelSpec's mixture-of-experts fields."""
PARALLEL_MEMORY_FIELDS = ("use_megatron_fsdp", "data_parallel_sharding_strategy")
"""ParallelSpec's memory settings (Megatron FSDP): off unless a config or a run states them."""
TRAIN_MEMORY_FIELDS = ("use_precision_aware_optimizer", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype",
                       "offload_optimizer_states", "optimizer_cpu_offload", "optimizer_offload_fraction")
"""TrainSpec's optimizer-memory settings (precision-aware optimizer, optimizer offloading): off by default."""
MLA_MODEL_FIELDS = ("multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
                    "v_head_dim")
"""ModelSpec's multi-latent-attention fields."""


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuSpec:
    """One accelerator: datasheet figures, and what its kernels achieve of them (microbenchmarks, cited in the
    cluster files); the time model is :mod:`megapipe.cost.kernels`."""

    name: str
    """The GPU type's name (its hydra_conf/cluster file's GPU), as plans and node ranks label it."""
    bf16_tflops: float = bounded("positive", required=True)
    """Dense (no sparsity) bf16 peak, TFLOP/s."""
    hbm_gbytes_per_s: float = bounded("positive", required=True)
    """HBM bandwidth, GB/s (10^9 bytes)."""
    memory_gib: float = bounded("positive", required=True)
    """HBM per GPU, GiB."""
    usable_memory_fraction: float = bounded("fraction", 0.9)
    """Share of memory_gib left for megapipe's accounting after the CUDA context, NCCL buffers and fragmentation."""
    fp8_tflops: float = bounded("non_negative", 0.0)
    """Dense FP8 tensor-core peak, TFLOP/s; 0 where the GPU has no FP8 tensor cores (A100)."""
    num_sms: int = bounded("non_negative", 0)
    """Streaming multiprocessors (compute units): GEMM tiles and attention blocks are spread over them; 0 ignores
    tile and wave quantization."""
    matmul_efficiency: float = bounded("fraction", 0.75)
    """Sustained fraction of bf16_tflops on large bf16 GEMMs (maximum achievable matmul FLOPS)."""
    fp8_matmul_efficiency: float = bounded("fraction_or_zero", 0.0)
    """Sustained fraction of fp8_tflops on large FP8 GEMMs; 0 means matmul_efficiency."""
    attention_efficiency: float = bounded("fraction", 0.5)
    """Flash/fused attention forward, achieved fraction of bf16_tflops on the causal half of the square."""
    attention_backward_efficiency: float = bounded("fraction", 0.4)
    """The same for its backward (five s x s matmuls against the forward's two)."""
    bandwidth_efficiency: float = bounded("fraction", 0.8)
    """Achieved fraction of hbm_gbytes_per_s for memory-bound kernels."""
    kernel_overhead_us: float = bounded("non_negative", 3.0)
    """Fixed time per kernel (launch, prologue, tail), microseconds."""
    architecture: str = ""
    """ampere, hopper, blackwell, cdna3 or cpu: what the GPU's kernels and Megatron's startup checks depend on."""

    @property
    def before_blackwell(self) -> bool:
        """Megatron-LM's ``validate_args`` needs CUDA_DEVICE_MAX_CONNECTIONS=1 with TP or CP > 1 before Blackwell
        (compute capability < 10); an unknown architecture is treated as older."""
        return self.architecture not in ("blackwell", "cpu")

    @property
    def usable_memory_bytes(self) -> float:
        return self.memory_gib * GIB * self.usable_memory_fraction


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkSpec:
    """One network level: NVLink, InfiniBand, RoCEv2, xGMI, Ethernet."""

    kind: str
    """nvlink, infiniband, roce, xgmi, ethernet, loopback."""
    bandwidth_gbytes_per_s: float = bounded("positive", required=True)
    """Per GPU, one direction, GB/s (10^9 bytes)."""
    latency_us: float = bounded("non_negative", required=True)
    """Per step of a ring collective (and per p2p message), microseconds."""
    bandwidth_efficiency: float = bounded("fraction", 0.8)
    """Achieved share of bandwidth_gbytes_per_s by large NCCL collectives (nccl-tests bus bandwidth)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeGroup:
    """A set of identical nodes inside a (possibly mixed) cluster."""

    gpu: GpuSpec
    num_nodes: int


@dataclass(frozen=True, slots=True, kw_only=True)
class RuntimeSpec:
    """What the training framework (megatron-core with Transformer Engine) adds to the kernels' time.

    Fitted on public measured runs by ``megapipe validate`` (hydra_conf/runtime/); each field is a
    physical quantity, so a value far from 1 (or from a few ms) says the model misses something.
    """

    name: str = "megatron_core"
    """The runtime's name (a hydra_conf/runtime option)."""
    microbatch_overhead_ms: float = 0.0
    """Per model chunk and microbatch, forward plus backward: the schedule's Python, p2p set-up, loss, launches
    the GPU does not hide."""
    step_overhead_ms: float = 0.0
    """Per step: gradient-norm and loss all-reduces, optimizer launches, timers, logging, the data loader."""
    gemm_efficiency_scale: float = 1.0
    """GEMMs in training against the same GEMM alone (clocks under full-node power, SMs shared with NCCL), for
    architectures gemm_efficiency_by_architecture does not list."""
    gemm_efficiency_by_architecture: tuple[tuple[str, float], ...] = ()
    """(GpuSpec.architecture, scale) pairs: each generation sustains its own share of its microbenchmark."""
    attention_efficiency_scale: float = 1.0
    """Attention kernels in training against their microbenchmarks, for architectures not listed below."""
    attention_efficiency_by_architecture: tuple[tuple[str, float], ...] = ()
    """(GpuSpec.architecture, scale) pairs for attention, as gemm_efficiency_by_architecture for GEMMs."""
    comm_efficiency_scale: float = 1.0
    """Collectives in training against nccl-tests' bus bandwidth (contention with compute and other groups)."""
    host_kernel_us: float = 5.0
    """CPU time per launched kernel in eager PyTorch with Transformer Engine (Python, dispatcher, launch):
    :mod:`megapipe.cost.host`. 4-6 us is a bare cudaLaunchKernel's. For host CPUs host_kernel_us_by_cpu omits."""
    host_kernel_us_by_cpu: tuple[tuple[str, float], ...] = ()
    """(ClusterSpec.host_cpu, us) pairs: a Grace core runs the same Python at its own speed."""
    host_sync_us: float = 20.0
    """GPU idle per device-to-host sync: the copy's round trip, the host waking and the next launch."""
    step_time_intervals: tuple[tuple[str, float, float], ...] = ()
    """(kind, low, high): for plans of a kind ("moe/hopper/bf16", "dense/*/*", ...), the measured step over the
    predicted one minus 1 lies in [low, high] for the central 80% of held-out published runs
    (:mod:`megapipe.plan.interval`; written by ``megapipe validate``)."""
    moe_dropless_imbalance: float = 1.0
    """The busiest expert-parallel rank's tokens over the mean under dropless aux-loss routing, when a plan does not
    state its own (train.moe_load_imbalance) and does not force balance: fitted on published runs that ran both
    ways (docs/cost_model.md)."""

    def __post_init__(self) -> None:
        for name in ("gemm_efficiency_by_architecture", "attention_efficiency_by_architecture",
                     "host_kernel_us_by_cpu"):
            pairs = dict(getattr(self, name))
            object.__setattr__(self, name, tuple(sorted((str(k), float(v)) for k, v in pairs.items())))
        object.__setattr__(self, "step_time_intervals", tuple(sorted(
            (str(key), float(low), float(high)) for key, low, high in self.step_time_intervals)))

    def gemm_scale(self, architecture: str) -> float:
        return dict(self.gemm_efficiency_by_architecture).get(architecture, self.gemm_efficiency_scale)

    def attention_scale(self, architecture: str) -> float:
        return dict(self.attention_efficiency_by_architecture).get(architecture, self.attention_efficiency_scale)

    def host_kernel(self, cpu: str) -> float:
        return dict(self.host_kernel_us_by_cpu).get(cpu, self.host_kernel_us)


@dataclass(frozen=True, slots=True, kw_only=True)
class ClusterSpec:
    name: str
    gpus_per_node: int
    price_per_gpu_hour: float
    intra_node: LinkSpec
    inter_node: LinkSpec
    node_groups: tuple[NodeGroup, ...]
    """One group for a homogeneous cluster; several for a mixed one, in pipeline-placement order."""
    scale_up_gpus: int = 0
    """GPUs one ``intra_node`` (NVLink) domain joins; 0 means gpus_per_node. GB200 NVL72: 72 over 4-GPU trays."""
    host_cpu: str = "x86"
    """The CPU that launches the kernels: x86 (HGX/DGX nodes) or grace (GB200/GB300 superchips); the runtime's
    host time per kernel depends on it (RuntimeSpec.host_kernel_us_by_cpu)."""
    runtime: RuntimeSpec = field(default_factory=RuntimeSpec)

    @property
    def domain_gpus(self) -> int:
        """GPUs reachable over the intra_node link."""
        return self.scale_up_gpus or self.gpus_per_node

    @property
    def num_nodes(self) -> int:
        return sum(g.num_nodes for g in self.node_groups)

    @property
    def num_gpus(self) -> int:
        return self.num_nodes * self.gpus_per_node

    @property
    def gpu(self) -> GpuSpec:
        """The first group's GPU: the only one on a homogeneous cluster."""
        return self.node_groups[0].gpu

    @property
    def is_heterogeneous(self) -> bool:
        return len({g.gpu.name for g in self.node_groups}) > 1


@dataclass(frozen=True, slots=True, kw_only=True)
class RuntimeFeatures:
    """What the training runtime runs beyond the parallel sizes, in megatron-core's TransformerConfig names.

    The defaults are Megatron's, so a plan that names none of them means what Megatron does by default.
    What each one hides, fuses or removes, and what it costs, is in docs/cost_model.md; which combinations
    Megatron accepts is :func:`megapipe.features.feature_problem`.
    """

    moe_token_dispatcher_type: str = "alltoall"
    """alltoall (NCCL all-to-all over EP), allgather (all-gather over ETP x EP) or flex (DeepEP or HybridEP)."""
    moe_flex_dispatcher_backend: str = "deepep"
    """With flex: deepep or hybridep (Megatron's default deepep); unused by the other dispatchers."""
    overlap_moe_expert_parallel_comm: bool = False
    """EP all-to-all of one microbatch under another's compute (megatron-core's combined 1F1B)."""
    delay_wgrad_compute: bool = False
    """Split the backward so the weight gradients run under the all-to-all (with EP overlap)."""
    moe_shared_expert_overlap: bool = False
    """The shared experts run on a side stream under the dispatch (alltoall; excludes EP overlap)."""
    moe_permute_fusion: bool = False
    """Transformer Engine's fused permute/unpermute kernels instead of PyTorch's sort and gather."""
    moe_router_fusion: bool = False
    """Transformer Engine's fused router score, top-k and aux-loss kernels."""
    cuda_graph_impl: str = "none"
    """none, local (megatron-core's graphs) or transformer_engine (TE's make_graphed_callables)."""
    cuda_graph_scope: tuple[str, ...] = ()
    """What is captured: attn, mlp, moe, moe_router, moe_preprocess, full_iteration; empty is the whole layer."""
    recompute_modules: tuple[str, ...] = ("core_attn",)
    """With recompute_granularity=selective: core_attn, moe_act, layernorm, mla_up_proj, mlp, moe, shared_experts."""
    moe_router_force_load_balancing: bool = False
    """Route tokens evenly regardless of the router (benchmarking): the busiest rank gets the mean load."""
    moe_router_padding_for_quantization: bool = False
    """Pad each expert's tokens in the routing map, instead of padding the permuted tokens, under FP8/FP4."""
    fine_grained_activation_offloading: bool = False
    """Copy the inputs of the offload_modules to host memory in the forward and back before their backward
    (megatron-core's fine-grained activation offloading)."""
    offload_modules: tuple[str, ...] = ()
    """With fine_grained_activation_offloading: attn_norm, qkv_linear, core_attn, attn_proj, mlp_norm, expert_fc1,
    moe_act (the modules whose saved inputs leave the GPU)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "cuda_graph_scope", tuple(str(v) for v in self.cuda_graph_scope))
        object.__setattr__(self, "recompute_modules", tuple(str(v) for v in self.recompute_modules))
        object.__setattr__(self, "offload_modules", tuple(str(v) for v in self.offload_modules))

    @property
    def dispatcher(self) -> str:
        """alltoall, allgather, deepep or hybridep: what moves the tokens."""
        if self.moe_token_dispatcher_type == "flex":
            return self.moe_flex_dispatcher_backend
        return self.moe_token_dispatcher_type

    @property
    def cuda_graphs(self) -> bool:
        return self.cuda_graph_impl != "none"


@dataclass(frozen=True, slots=True, kw_only=True)
class ParallelSpec:
    """Megatron's model-parallel sizes; data_parallel_size is what is left of the GPUs."""

    tensor_model_parallel_size: int = 1
    """TP: each layer's weights split this many ways (Megatron --tensor-model-parallel-size)."""
    pipeline_model_parallel_size: int = 1
    """PP: pipeline ranks the layers are split over (Megatron --pipeline-model-parallel-size)."""
    virtual_pipeline_model_parallel_size: int = 1
    """Model chunks per pipeline rank; 1 means no interleaving (Megatron's None)."""
    context_parallel_size: int = 1
    """CP: each sequence split this many ways, ring attention between them (Megatron --context-parallel-size)."""
    data_parallel_size: int = 1
    """DP: model replicas, the GPUs left over TP x PP x CP."""
    sequence_parallel: bool = False
    """Shard the norms' and dropouts' activations over the TP group (Megatron --sequence-parallel; needs TP > 1)."""
    use_distributed_optimizer: bool = True
    """Shard the optimizer state over data-parallel ranks (Megatron --use-distributed-optimizer, ZeRO-1)."""
    microbatch_group_size_per_vp_stage: int | None = None
    """Megatron's interleaving group; pipeline_model_parallel_size when None."""
    expert_model_parallel_size: int = 1
    """EP: the ranks a MoE layer's experts are spread over (each holds num_moe_experts / EP)."""
    expert_tensor_parallel_size: int = 0
    """ETP: each expert split this many ways; 0 means tensor_model_parallel_size (Megatron's default)."""
    features: RuntimeFeatures = field(default_factory=RuntimeFeatures)
    """The runtime features the plan runs with (dispatcher, overlaps, fusions, CUDA graphs, recompute modules)."""
    tp_comm_overlap: bool = False
    """Megatron's ``--tp-comm-overlap``: Transformer Engine pipelines the TP all-gather and reduce-scatter with
    the GEMMs (userbuffers; needs sequence parallelism)."""
    overlap_grad_reduce: bool = True
    """The data-parallel gradient reduce runs under the backward (Megatron --overlap-grad-reduce)."""
    overlap_param_gather: bool = True
    """With the distributed optimizer: the parameter all-gather runs under the next forward."""
    use_megatron_fsdp: bool = False
    """Megatron FSDP (Megatron --use-megatron-fsdp) instead of DDP with the distributed optimizer: what it shards
    over the data-parallel group is data_parallel_sharding_strategy."""
    data_parallel_sharding_strategy: str = "optim_grads_params"
    """With use_megatron_fsdp: optim (optimizer state, ZeRO-1), optim_grads (and gradients, ZeRO-2) or
    optim_grads_params (and parameters, ZeRO-3), Megatron --data-parallel-sharding-strategy; no_shard shards
    nothing."""

    @property
    def world_size(self) -> int:
        return (
            self.tensor_model_parallel_size
            * self.pipeline_model_parallel_size
            * self.context_parallel_size
            * self.data_parallel_size
        )

    @property
    def expert_tp(self) -> int:
        return self.expert_tensor_parallel_size or self.tensor_model_parallel_size

    @property
    def moe_token_dispatcher_type(self) -> str:
        return self.features.moe_token_dispatcher_type

    @property
    def expert_data_parallel_size(self) -> int:
        """EDP = world / (ETP x EP x PP): megatron-core's expert grid, over which expert optimizer state shards."""
        return self.world_size // (self.expert_tp * self.expert_model_parallel_size * self.pipeline_model_parallel_size)


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainSpec:
    micro_batch_size: int = 1
    """Sequences per microbatch (Megatron --micro-batch-size)."""
    global_batch_size: int = 1
    """Sequences per optimizer step over all data-parallel ranks (Megatron --global-batch-size)."""
    seq_length: int = 2048
    """Training sequence length in tokens (Megatron --seq-length)."""
    recompute_granularity: Recompute = Recompute.none
    """Activation recompute: none, selective (the recompute_modules) or full (only each layer's input is kept and
    the layer runs again in the backward)."""
    precision: str = "bf16"
    """bf16, fp16 or fp32 for activations and weights; fp8 is bf16 with FP8 GEMMs (Transformer Engine).
    Master weights and Adam state are fp32."""
    fp8_recipe: str = ""
    """With fp8: delayed, tensorwise, mxfp8 or blockwise (Megatron's ``--fp8-recipe``); empty otherwise."""
    fp8_param_gather: bool = False
    """With fp8: keep the GEMM weights in FP8 and all-gather them so (``--fp8-param-gather``)."""
    grad_reduce_in_fp32: bool = True
    """Main gradients accumulated and reduced in fp32 (Megatron's default); false keeps them in the
    parameters' bf16, 2 bytes less per parameter (``--grad-reduce-in-bf16``; Megatron-Bridge's performance
    recipes set ``ddp.grad_reduce_in_fp32=False``)."""
    use_precision_aware_optimizer: bool = False
    """Transformer Engine's FusedAdam holds the master weights and Adam moments in main_params_dtype, exp_avg_dtype
    and exp_avg_sq_dtype (Megatron --use-precision-aware-optimizer)."""
    main_params_dtype: str = "fp32"
    """fp32 or fp16 master weights (Megatron --main-params-dtype; with the precision-aware optimizer); bf16 as NeMo 1's
    distributed_fused_adam keeps them (its optim.dtype)."""
    exp_avg_dtype: str = "fp32"
    """fp32, fp16, bf16 or fp8 first Adam moment (Megatron --exp-avg-dtype; with the precision-aware optimizer)."""
    exp_avg_sq_dtype: str = "fp32"
    """fp32, fp16, bf16 or fp8 second Adam moment (Megatron --exp-avg-sq-dtype; with the precision-aware
    optimizer)."""
    offload_optimizer_states: bool = False
    """The distributed optimizer's master weights and moments go to host memory after each step and come back for
    the next (Megatron --offload-optimizer-states): off the GPU during forward and backward."""
    optimizer_cpu_offload: bool = False
    """Megatron's hybrid CPU-GPU optimizer (--optimizer-cpu-offload): optimizer_offload_fraction of the master
    weights and moments live and update on the host."""
    optimizer_offload_fraction: float = bounded("fraction", 1.0)
    """With optimizer_cpu_offload: the share of the optimizer state on the host (Megatron
    --optimizer-offload-fraction)."""
    moe_load_imbalance: float | None = None
    """The routing assumption: the busiest expert-parallel rank receives this many times the mean tokens
    (1.0 = balanced). None means dropless aux-loss routing's typical imbalance, the runtime's
    ``moe_dropless_imbalance`` (the config boundary fills it in); forced balancing (RuntimeFeatures) overrides it."""

    def num_microbatches(self, data_parallel_size: int) -> int:
        """Megatron's count: global_batch_size / (micro_batch_size * data_parallel_size)."""
        return self.global_batch_size // (self.micro_batch_size * data_parallel_size)


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerCost:
    """Cost of one pipeline unit for one microbatch on one GPU of its stage.

    ``bwd_ms`` is the whole backward; ``wgrad_ms`` is its weight-gradient part
    (W in zero-bubble schedules), so the input-gradient part is ``bwd_ms - wgrad_ms``.
    """

    name: str
    kind: LayerKind
    fwd_ms: float
    bwd_ms: float
    wgrad_ms: float
    static_bytes: float
    """Weights, gradients and optimizer state held per GPU."""
    act_bytes: float
    """Activation bytes kept per in-flight microbatch."""
    param_count: float = 0.0
    """Parameters of this unit per GPU (after TP sharding), for the ``parameters`` split."""
    expert_param_count: float = 0.0
    """The routed experts' share of param_count (sharded by EP x ETP, synced over expert DP)."""
    parts: tuple[float, ...] = ()
    """fwd_ms + bwd_ms split into :data:`TIME_PARTS` (cost model); empty for a measured profile."""


_LAYER_NUMBERS = ("fwd_ms", "bwd_ms", "wgrad_ms", "static_bytes", "act_bytes")

TIME_PARTS = ("gemm", "attention", "memory_bound", "fp8_cast", "tp_comm", "cp_comm", "ep_comm", "recompute", "host")
"""What a unit's forward + backward time is made of (``LayerCost.parts``), in this order."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Profile:
    """Per-unit costs for one microbatch: embedding, each decoder layer, MTP layers, loss, in model order.

    Written by the cost model (:func:`megapipe.cost.layer_costs`) or measured (``megapipe profile``);
    its file form is ``megapipe-profile/1`` (:mod:`megapipe.profile.format`).
    """

    layers: tuple[LayerCost, ...]
    device: str = ""
    """The GPU (cluster config name or torch device name) the times are for."""
    meta: tuple[tuple[str, str], ...] = field(default=())
    """Provenance: source, torch / megatron-core versions, shapes, date."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))
        object.__setattr__(self, "meta", tuple((str(k), str(v)) for k, v in dict(self.meta).items()))
        if not self.layers:
            raise ProfileError("profile has no layers")
        for index, layer in enumerate(self.layers):
            for key in _LAYER_NUMBERS:
                value = getattr(layer, key)
                if not math.isfinite(value) or value < 0:
                    raise ProfileError(f"layers[{index}] ({layer.name}): {key}={value!r} must be finite and >= 0")
            if layer.wgrad_ms > layer.bwd_ms * (1 + 1e-9):
                raise ProfileError(
                    f"layers[{index}] ({layer.name}): wgrad_ms={layer.wgrad_ms} exceeds bwd_ms={layer.bwd_ms}; "
                    "wgrad_ms is the weight-gradient part of bwd_ms"
                )
        kinds = [layer.kind for layer in self.layers]
        if kinds.count(LayerKind.embedding) > 1 or kinds.count(LayerKind.loss) > 1:
            raise ProfileError("a profile holds at most one embedding and one loss entry")
        if LayerKind.embedding in kinds and kinds[0] != LayerKind.embedding:
            raise ProfileError("the embedding entry must come first")
        if LayerKind.loss in kinds and kinds[-1] != LayerKind.loss:
            raise ProfileError("the loss entry must come last")

    @property
    def num_decoder_layers(self) -> int:
        return sum(1 for layer in self.layers if layer.kind == LayerKind.decoder)


@dataclass(frozen=True, slots=True, kw_only=True)
class StageSpec:
    """What one pipeline rank offers: relative speed and memory cap."""

    time_scale: float = 1.0
    """Multiplier on profile times (2.0 = half as fast as the profiled GPU)."""
    memory_bytes: float = float("inf")
    """Bytes available for static + activation memory on this rank."""
    gpu_name: str = ""
    microbatch_overhead_ms: float = 0.0
    """Framework time per model chunk and microbatch on this rank (half in the forward, half in the backward)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Partition:
    """Which profile entries each pipeline stage holds, and what that costs.

    Stages are listed in model order. With virtual stages this is Megatron's
    vp-major order: layout stage index = vp * pipeline_model_parallel_size + pp_rank.
    """

    entries_per_stage: tuple[int, ...]
    """Profile entries per stage: the embedding, MTP layers and the loss count as entries, as decoders do
    (``decoder_counts`` of the emitters gives the decoders alone)."""
    stage_kinds: tuple[tuple[LayerKind, ...], ...]
    """The entries' kinds per stage, in order; this is what the layout string spells."""
    stage_time_ms: tuple[float, ...]
    """time_scale * sum(fwd_ms + bwd_ms) of each stage's entries."""
    stage_static_bytes: tuple[float, ...]
    stage_act_bytes: tuple[float, ...]
    """Activation bytes per in-flight microbatch of each stage."""
    stage_in_flight: tuple[int, ...]
    """Peak in-flight microbatches the schedule keeps on each stage."""
    stage_memory_bytes: tuple[float, ...]
    """stage_static_bytes + stage_in_flight * stage_act_bytes."""
    layout: str
    """Megatron pipeline_model_parallel_layout string."""
    pipeline_model_parallel_size: int
    virtual_pipeline_model_parallel_size: int = 1
    num_microbatches: int = 1
    schedule: str
    """The schedule the in-flight counts and stage placement are for (a ``megapipe.schedules`` name)."""
    method: str = "optimal"
    """optimal (exact min-max), equal (Megatron's uniform split) or parameters (DeepSpeed's)."""
    fits_memory: bool = True
    """False when a split made with check_memory=False exceeds some pipeline rank's memory_bytes."""
    stage_to_rank: tuple[int, ...] = ()
    """Pipeline rank of each layout stage; empty means vp-major (stage % pipeline_model_parallel_size).
    V-shaped schedules (zb_v, dualpipe_v) put stage s on rank 2P - 1 - s for s >= P."""
    rank_peak_bytes: tuple[float, ...] = ()
    """Each pipeline rank's peak bytes with its stages' activations summed at the moments they peak together
    (ranks holding several stages); empty means the sum of the stages' own peaks."""

    @property
    def bottleneck_ms(self) -> float:
        return max(self.stage_time_ms)

    def _rank_sums(self, values: tuple[float, ...]) -> tuple[float, ...]:
        pp = self.pipeline_model_parallel_size
        ranks = self.stage_to_rank or tuple(stage % pp for stage in range(len(values)))
        sums = [0.0] * pp
        for rank, value in zip(ranks, values):
            sums[rank] += value
        return tuple(sums)

    @property
    def rank_memory_bytes(self) -> tuple[float, ...]:
        """Each pipeline rank's peak bytes (coupled over its stages when rank_peak_bytes is set)."""
        return self.rank_peak_bytes or self._rank_sums(self.stage_memory_bytes)

    @property
    def rank_stage_peaks_bytes(self) -> tuple[float, ...]:
        """Each pipeline rank's stages' own peaks, summed: what rank_memory_bytes would be if they peaked together."""
        return self._rank_sums(self.stage_memory_bytes)


@dataclass(frozen=True, slots=True, kw_only=True)
class JobSpec:
    """One training job of a shared cluster (``megapipe pack``): what it trains and what it must achieve."""

    name: str
    model: ModelSpec
    train: TrainSpec
    """Global batch, sequence length and precision (micro-batch and recompute are searched)."""
    tokens: float = 0.0
    """Token budget; 0 means none (the job is scored by throughput only)."""
    deadline_hours: float | None = None
    weight: float = 1.0
    """How much a model FLOP of this job counts against the others'."""
    gpu: str | None = None
    """The GPU type (a node group's ``gpu.name``) the job is pinned to; None: any group."""
    max_micro_batch_size: int | None = None
    arrives_later: bool = False
    """Held out of the first packing; the what-if adds it."""
    template: ParallelSpec = field(default_factory=lambda: ParallelSpec())
    """The settings every plan of the job keeps (overlap flags, the distributed optimizer, runtime features), as
    the command line gave them; its sizes are searched unless ``fixed`` pins them."""
    fixed: tuple[tuple[str, object], ...] = ()
    """The search dimensions the command line pins for every job (``parallel.*``, ``schedule=``,
    ``train.micro_batch_size``, ``train.recompute_granularity``), by name."""
