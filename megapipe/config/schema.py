"""Hydra structured-config schemas, registered in ConfigStore by :func:`register_configs`.

These are mutable, Hydra-owned dataclasses holding only OmegaConf types. The
YAML files in ``hydra_conf/`` extend them through their defaults list
(``defaults: [base_model, _self_]``), so a mistyped key is Hydra's error.
A parallel or train field left ``None`` is searched by ``megapipe plan`` and
takes a documented default elsewhere (``megapipe.config.build``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from megapipe.records import Activation, AttentionBackend, Recompute

__all__ = [
    "ModelConfig",
    "GpuConfig",
    "LinkConfig",
    "NodeGroupConfig",
    "ClusterConfig",
    "RuntimeConfig",
    "ParallelConfig",
    "TrainConfig",
    "ScheduleConfig",
    "SearchConfig",
    "OutputConfig",
    "ValidateConfig",
    "Config",
    "register_configs",
]


class Objective(str, enum.Enum):
    throughput = "throughput"
    cost = "cost"


class OutputFormat(str, enum.Enum):
    table = "table"
    json = "json"


@dataclass
class ModelConfig:
    name: str = MISSING
    num_layers: Optional[int] = None
    """Decoder layers (Megatron num_layers)."""
    hidden_size: Optional[int] = None
    num_attention_heads: Optional[int] = None
    num_query_groups: Optional[int] = None
    """Key/value heads for GQA; null means num_attention_heads (plain MHA)."""
    ffn_hidden_size: Optional[int] = None
    vocab_size: Optional[int] = None
    """Padded vocabulary size as Megatron builds it."""
    seq_length: Optional[int] = None
    """Default training sequence length, tokens."""
    activation: Activation = Activation.swiglu
    untie_embeddings_and_output_weights: bool = True
    position_embedding_type: str = "rope"
    """rope, learned_absolute or none."""
    attention_backend: AttentionBackend = AttentionBackend.flash
    kv_channels: Optional[int] = None
    """Per-head dimension; null means hidden_size / num_attention_heads."""
    mtp_num_layers: int = 0
    max_position_embeddings: Optional[int] = None
    """Positions the embedding table (learned_absolute) or RoPE covers; null means seq_length."""
    rotary_base: float = 10000.0
    """RoPE theta (Megatron --rotary-base)."""
    norm_epsilon: float = 1e-5
    qk_layernorm: bool = False
    """Per-head query/key norms (Qwen3); with MLA the q and kv latent norms."""
    add_bias_linear: Optional[bool] = None
    """Biases on every linear layer; null follows the activation (gelu: yes; swiglu, squared_relu: no)."""
    # mixture of experts (megatron-core TransformerConfig names; Megatron-LM flags in the comments)
    num_moe_experts: int = 0
    """Routed experts per MoE layer (--num-experts); 0 is a dense model."""
    moe_ffn_hidden_size: Optional[int] = None
    """One routed expert's FFN width; null means ffn_hidden_size."""
    moe_router_topk: int = 2
    moe_shared_expert_intermediate_size: int = 0
    """All shared experts of a layer together (n_shared x width); 0 means none."""
    moe_layer_freq: Any = 1
    """Megatron's --moe-layer-freq: an int N (layer i is MoE when i % N == 0) or a 0/1 list per layer."""
    moe_router_score_function: str = "softmax"
    moe_router_pre_softmax: bool = False
    moe_router_enable_expert_bias: bool = False
    moe_router_num_groups: Optional[int] = None
    moe_router_group_topk: Optional[int] = None
    moe_router_topk_scaling_factor: Optional[float] = None
    moe_router_load_balancing_type: str = "aux_loss"
    moe_aux_loss_coeff: float = 0.0
    # multi-latent attention (DeepSeek-V2/V3)
    multi_latent_attention: bool = False
    q_lora_rank: Optional[int] = None
    """Query latent width; null projects queries directly."""
    kv_lora_rank: int = 512
    qk_head_dim: int = 128
    """Per-head query/key width without RoPE (HF qk_nope_head_dim)."""
    qk_pos_emb_head_dim: int = 64
    """Per-head RoPE width (HF qk_rope_head_dim)."""
    v_head_dim: int = 128
    source: str = ""
    """Where the values come from (the model's config.json, paper or recipe)."""
    not_modelled: List[str] = field(default_factory=list)
    """Features of the real model that megapipe neither costs nor emits (GPT-OSS's sliding window and
    attention sinks); every plan of the model warns about each."""
    config_path: Optional[str] = None
    """A Hugging Face config.json read from disk (model=hf); its values fill the null fields."""


@dataclass
class GpuConfig:
    name: str = MISSING
    bf16_tflops: float = MISSING
    """Dense bf16 peak, TFLOP/s (datasheet)."""
    hbm_gbytes_per_s: float = MISSING
    """HBM bandwidth, GB/s."""
    memory_gib: float = MISSING
    usable_memory_fraction: float = 0.9
    fp8_tflops: float = 0.0
    """Dense FP8 peak, TFLOP/s; 0 = no FP8 tensor cores."""
    num_sms: int = 0
    """Streaming multiprocessors (compute units), for tile and wave quantization; 0 ignores it."""
    matmul_efficiency: float = 0.75
    """Sustained fraction of bf16_tflops on large GEMMs (maximum achievable matmul FLOPS)."""
    fp8_matmul_efficiency: float = 0.0
    """The same for FP8 GEMMs; 0 means matmul_efficiency."""
    attention_efficiency: float = 0.5
    """Flash attention forward, achieved fraction of bf16_tflops (causal FLOPs)."""
    attention_backward_efficiency: float = 0.4
    bandwidth_efficiency: float = 0.8
    kernel_overhead_us: float = 3.0
    """Fixed time per kernel, microseconds."""
    architecture: str = ""
    """ampere, hopper, blackwell, cdna3 or cpu."""


@dataclass
class LinkConfig:
    kind: str = MISSING
    """nvlink, infiniband, roce, xgmi, ethernet, loopback."""
    bandwidth_gbytes_per_s: float = MISSING
    """Per GPU, one direction, GB/s."""
    latency_us: float = MISSING
    """Per step of a ring collective (and per p2p message), microseconds."""
    bandwidth_efficiency: float = 0.8
    """Achieved share of the bandwidth by large NCCL collectives (nccl-tests bus bandwidth)."""


@dataclass
class NodeGroupConfig:
    gpu: GpuConfig = MISSING
    num_nodes: int = MISSING


@dataclass
class ClusterConfig:
    name: str = MISSING
    num_nodes: int = MISSING
    gpus_per_node: int = MISSING
    price_per_gpu_hour: float = MISSING
    """US dollars per GPU-hour."""
    gpu: GpuConfig = MISSING
    intra_node: LinkConfig = MISSING
    inter_node: LinkConfig = MISSING
    node_groups: List[NodeGroupConfig] = field(default_factory=list)
    """Mixed clusters: node groups in pipeline-placement order; empty for a homogeneous cluster."""
    scale_up_gpus: int = 0
    """GPUs one intra_node (NVLink) domain joins; 0 means gpus_per_node (GB200 NVL72: 72)."""
    host_cpu: str = "x86"
    """The CPU that launches the kernels: x86, or grace (GB200/GB300)."""


@dataclass
class RuntimeConfig:
    """The training framework's time beyond the kernels (fitted on public runs by `megapipe validate`)."""

    name: str = MISSING
    microbatch_overhead_ms: float = 0.0
    """Per model chunk and microbatch, forward + backward."""
    step_overhead_ms: float = 0.0
    """Per optimizer step."""
    gemm_efficiency_scale: float = 1.0
    """For GPU architectures gemm_efficiency_by_architecture does not list."""
    gemm_efficiency_by_architecture: Dict[str, float] = field(default_factory=dict)
    """GEMM scale per GPU architecture (ampere, hopper, blackwell, ...)."""
    attention_efficiency_scale: float = 1.0
    attention_efficiency_by_architecture: Dict[str, float] = field(default_factory=dict)
    comm_efficiency_scale: float = 1.0
    host_kernel_us: float = 5.0
    """CPU time per launched kernel (Python, PyTorch, Transformer Engine, the launch), microseconds."""
    host_kernel_us_by_cpu: Dict[str, float] = field(default_factory=dict)
    """host_kernel_us per host CPU (cluster.host_cpu: x86, grace)."""
    host_sync_us: float = 20.0
    """GPU idle per device-to-host sync, microseconds."""
    moe_dropless_imbalance: float = 1.0
    """Busiest EP rank's tokens over the mean under dropless aux-loss routing (fitted)."""
    step_time_intervals: Dict[str, List[float]] = field(default_factory=dict)
    """kind -> [low, high] of measured/predicted - 1 over held-out published runs (written by megapipe validate)."""


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: Optional[int] = None
    pipeline_model_parallel_size: Optional[int] = None
    virtual_pipeline_model_parallel_size: Optional[int] = None
    """Model chunks per pipeline rank; 1 means no interleaving."""
    context_parallel_size: Optional[int] = None
    sequence_parallel: Optional[bool] = None
    use_distributed_optimizer: bool = True
    microbatch_group_size_per_vp_stage: Optional[int] = None
    tp_comm_overlap: bool = False
    """Megatron's --tp-comm-overlap (Transformer Engine userbuffers; needs sequence parallelism)."""
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = True
    expert_model_parallel_size: Optional[int] = None
    """EP (MoE models): experts spread over this many ranks; null is searched (1 for dense models)."""
    expert_tensor_parallel_size: Optional[int] = None
    """ETP: each expert split this many ways; null is searched for MoE models (TP elsewhere, Megatron's default)."""
    moe_token_dispatcher_type: Optional[str] = None
    """MoE: alltoall, allgather or flex (DeepEP or HybridEP, moe_flex_dispatcher_backend); null is searched by
    `megapipe plan` (alltoall, flex/deepep, flex/hybridep) and is Megatron's alltoall elsewhere."""
    moe_flex_dispatcher_backend: Optional[str] = None
    """With flex: deepep or hybridep; setting it alone implies moe_token_dispatcher_type=flex."""
    overlap_moe_expert_parallel_comm: Optional[bool] = None
    """MoE: run each EP all-to-all under another microbatch's compute (combined 1F1B; needs PP=1 or VP >= 2 and
    CUDA_DEVICE_MAX_CONNECTIONS > 1); null is searched by `megapipe plan`, off elsewhere."""
    delay_wgrad_compute: Optional[bool] = None
    """With EP overlap: the weight gradients run under the backward all-to-all; null follows the overlap."""
    moe_shared_expert_overlap: bool = False
    """MoE with shared experts, alltoall dispatcher, without EP overlap: shared experts under the dispatch."""


@dataclass
class TrainConfig:
    micro_batch_size: Optional[int] = None
    global_batch_size: int = 256
    """Sequences per optimizer step."""
    seq_length: Optional[int] = None
    """Tokens per sequence; null means model.seq_length."""
    recompute_granularity: Optional[Recompute] = None
    """none, selective or full (emitted to Megatron as null, selective, full)."""
    precision: str = "bf16"
    """bf16, fp16, fp32, or fp8 (bf16 with FP8 GEMMs on H100/H200/B200/B300)."""
    fp8_recipe: Optional[str] = None
    """With fp8: delayed, tensorwise, mxfp8 (Blackwell) or blockwise; null picks mxfp8 on Blackwell, else tensorwise."""
    fp8_param_gather: Optional[bool] = None
    """With fp8: keep GEMM weights in FP8 and all-gather them so (--fp8-param-gather); null means on with the
    distributed optimizer (as Megatron-Bridge's FP8 recipes), off for blockwise."""
    num_microbatches: Optional[int] = None
    """Derived as global_batch_size / (micro_batch_size * data-parallel size); set it only to simulate directly."""
    total_tokens: float = 2.0e12
    """Tokens of the whole training run, for the cost estimate."""
    moe_load_imbalance: Optional[float] = None
    """MoE routing assumption: the busiest expert-parallel rank gets this many times the mean tokens (1.0 =
    balanced, what aux-loss-free or forced balancing aims for); null is the runtime's moe_dropless_imbalance,
    dropless aux-loss routing as published runs measured it."""
    moe_permute_fusion: Optional[bool] = None
    """MoE: Transformer Engine's fused permute/unpermute; null is on in `megapipe plan` (as every
    Megatron-Bridge MoE recipe sets it), Megatron's off elsewhere."""
    moe_router_fusion: Optional[bool] = None
    """MoE: Transformer Engine's fused router kernels; null as moe_permute_fusion."""
    cuda_graph_impl: Optional[str] = None
    """none, local or transformer_engine; null is searched with cuda_graph_scope for MoE plans, none elsewhere."""
    cuda_graph_scope: Optional[List[str]] = None
    """What the graphs capture: attn, mlp, moe, moe_router, moe_preprocess, full_iteration; [] the whole layer."""
    recompute_modules: Optional[List[str]] = None
    """With recompute_granularity=selective: core_attn, moe_act, layernorm, mla_up_proj, mlp, moe,
    shared_experts; null is Megatron's [core_attn]."""
    moe_router_force_load_balancing: bool = False
    """Route evenly regardless of the router (a benchmarking switch of Megatron's): balanced experts."""
    moe_router_padding_for_quantization: bool = False
    """FP8 MoE: pad each expert's tokens in the routing map (sent through the all-to-all) instead of after it."""


@dataclass
class ScheduleConfig:
    name: Optional[str] = None
    """gpipe, 1f1b, interleaved_1f1b, zb_h1, zb_h2, zb_v, dualpipe_v, all; null is searched."""


@dataclass
class ReferenceConfig:
    """A published configuration to evaluate beside the best plan (set by an experiment, not by default)."""

    label: str = MISSING
    """How the row is labelled, e.g. the write-ups' TP4 PP8."""
    tensor_model_parallel_size: int = MISSING
    pipeline_model_parallel_size: int = MISSING
    reported_tokens_per_s_per_gpu: Optional[float] = None
    """What the source reports for it, printed beside megapipe's prediction."""
    source: str = ""


@dataclass
class SearchConfig:
    objective: Objective = Objective.throughput
    allow_cross_node_tp: bool = False
    bubble_target: Optional[List[float]] = None
    """[low, high]: pick the micro-batch size whose bubble falls in this range."""
    bubble_warning_range: Optional[List[float]] = None
    """[low, high]: warn when a plan's bubble falls outside it; null warns never."""
    ignore_memory_limit: bool = False
    top_k: int = 5
    max_pipeline_model_parallel_size: Optional[int] = None
    per_stage_recompute: bool = False
    """Also search per-stage recompute (AdaPipe): each pipeline rank picks none/selective/full with the split."""
    what_if_schedules: bool = False
    """Also search schedules megatron-core cannot run (ZB-H1/H2, ZB-V, DualPipeV), ranked as what-if results:
    labelled as such, and Megatron arguments are written only for the best plan megatron-core runs."""
    drift_threshold: float = 0.1
    """Relative difference between measured and predicted figures that triggers a warning."""
    min_gain: float = 0.02
    """replan refuses to suggest a change whose predicted gain is below this fraction."""
    reference: Optional[ReferenceConfig] = None
    """A published configuration shown beside the best plan (DP is the rest, 1F1B, micro-batch 1, SP)."""
    replan_attribution: str = "stage"
    """replan: stage (split each stage's measured time in proportion to the profile) or kind (per-kind factors first)."""


@dataclass
class OutputConfig:
    format: OutputFormat = OutputFormat.table
    dir: Optional[str] = None
    """Where files go; null means Hydra's output directory."""
    pictures: bool = True
    bridge_keys: str = "flat"
    """Megatron-Bridge spelling: flat (model.*, released 0.6.x) or nested (model.transformer.*, Bridge main)."""


@dataclass
class ValidateConfig:
    """`megapipe validate`: which runs, what to fit, where the table goes."""

    ids: Optional[List[str]] = None
    """Only these runs of the data set (by id); null means all."""
    leave_one_out: bool = True
    """Refit without each run in turn and predict it (about a minute per 60 runs)."""
    leave_one_source_out: bool = True
    """Refit without every run of one source (table, paper, write-up) in turn and predict those runs: the
    headline error, what a new source can expect."""
    fit: Optional[List[str]] = None
    """Runtime fields to fit on the dense runs (megapipe.validation.fit.FIT_FIELDS); null means DEFAULT_FIT."""
    fit_moe: Optional[List[str]] = None
    """Runtime fields to fit on the MoE runs, the dense fields held; null means MOE_FIT."""
    docs: Optional[str] = None
    """A Markdown file whose section between the validation markers is rewritten with the table."""


@dataclass
class JobConfig:
    """One training job of a shared cluster (`megapipe pack`)."""

    name: str = MISSING
    model: str = MISSING
    """A hydra_conf/model option (llama3_70b, mixtral_8x7b, ...)."""
    global_batch_size: int = MISSING
    seq_length: Optional[int] = None
    """null: the model's default training length."""
    precision: Optional[str] = None
    """bf16, fp8, ...; null: the command line's train.precision (bf16 by default)."""
    tokens: Optional[float] = None
    """The token budget (training tokens to process); null: none (throughput only)."""
    deadline_hours: Optional[float] = None
    """Wall-clock hours in which the token budget must be done (objective deadlines)."""
    weight: float = 1.0
    """How much a FLOP of this job counts against the others'."""
    gpu: Optional[str] = None
    """Pin the job to this GPU type (a node group's gpu.name); null: any group."""
    max_micro_batch_size: Optional[int] = None
    """Largest micro-batch the job may use; null: the search's list."""
    arrives_later: bool = False
    """Left out of the first packing; added by the what-if `pack.arrive=true`."""


@dataclass
class JobsConfig:
    """A list of jobs (hydra_conf/jobs/)."""

    name: str = ""
    description: str = ""
    jobs: List[JobConfig] = field(default_factory=list)


@dataclass
class PackConfig:
    """`megapipe pack`: objective, node counts, baselines and what-ifs."""

    objective: str = "throughput"
    """throughput (weighted model FLOP/s), makespan (finish every token budget soonest) or deadlines."""
    node_counts: Optional[List[int]] = None
    """Node counts a job may get; null: the powers of two up to each group's size, and its size."""
    baseline_pipeline_sizes: List[int] = field(default_factory=lambda: [1, 2, 4, 8])
    """The fixed-depth baseline packs every job at one of these pipeline sizes (the best one is shown)."""
    fail_group: Optional[str] = None
    """What-if: the node group of this GPU type fails; the jobs are repacked with the fewest moves."""
    fail_nodes: int = 0
    """What-if: this many nodes of the largest group fail."""
    arrive: bool = False
    """What-if: the jobs marked arrives_later join; repacked with the fewest moves."""
    move_slack: float = 0.0
    """What-if: accept an objective this fraction below the optimum to move fewer jobs."""
    restart_minutes: float = 10.0
    """When a job finishes, the others are repacked onto the nodes; a job that changes nodes idles this long
    (checkpoint, restart, reload)."""


@dataclass
class Config:
    model: ModelConfig = MISSING
    cluster: ClusterConfig = MISSING
    runtime: RuntimeConfig = MISSING
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    search: SearchConfig = field(default_factory=SearchConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    validate: ValidateConfig = field(default_factory=ValidateConfig)
    jobs: JobsConfig = field(default_factory=JobsConfig)
    pack: PackConfig = field(default_factory=PackConfig)
    profile: Optional[str] = None
    """A megapipe-profile/1 file used instead of the cost model."""
    stage_times: Optional[List[List[Any]]] = None
    """Per-stage [F, B, W] in ms for `megapipe simulate` (ints or floats; checked by the command)."""
    input: Optional[str] = None
    """The positional argument of commands that take a path (report DIR, replan RUN_DIR)."""
    extra: Any = None
    """Free-form settings for commands (e.g. profile iterations); not validated."""


def register_configs() -> None:
    """Register every schema in Hydra's ConfigStore (idempotent)."""
    store = ConfigStore.instance()
    store.store(name="base_config", node=Config)
    store.store(group="model", name="base_model", node=ModelConfig)
    store.store(group="cluster", name="base_cluster", node=ClusterConfig)
    store.store(group="runtime", name="base_runtime", node=RuntimeConfig)
    store.store(group="parallel", name="base_parallel", node=ParallelConfig)
    store.store(group="train", name="base_train", node=TrainConfig)
    store.store(group="schedule", name="base_schedule", node=ScheduleConfig)
    store.store(group="search", name="base_search", node=SearchConfig)
    store.store(group="output", name="base_output", node=OutputConfig)
    store.store(group="jobs", name="base_jobs", node=JobsConfig)
