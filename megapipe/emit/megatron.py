"""Megatron-LM command-line arguments (``megatron/training/arguments.py``) and the environment a launch needs.

The arguments hold everything the plan assumed, so a ``pretrain_gpt.py`` run needs only data,
tokenizer and optimizer-schedule flags added:

- parallelism: TP, PP, the layout, CP, sequence parallel, micro and global batch, recompute, the
  distributed optimizer and the overlap of its collectives that the step-time model counts on
  (``--overlap-grad-reduce``, ``--overlap-param-gather``);
- the model shape: layers, hidden, FFN, heads, query groups (``--group-query-attention`` too:
  without it Megatron silently builds MHA), head size, sequence length and position table,
  position embedding and RoPE base, SwiGLU, untied embeddings, vocabulary; and the family's
  normalisation, biases and dropout (:mod:`megapipe.cost.shapes`' convention: the swiglu family is
  Llama's RMSNorm without biases or dropout, the gelu family GPT's LayerNorm with biases and 0.1
  dropout);
- mixture of experts, MLA and MTP: :mod:`megapipe.emit.moe`;
- precision: ``--bf16`` or ``--fp16`` (Megatron's default is fp32); FP8 and ``--tp-comm-overlap`` as
  :mod:`megapipe.emit.precision` spells them.

Flag names were checked against Megatron-LM core_v0.16.1, core_v0.19.0 and main (2026-08) by
running these arguments through ``parse_args``, ``validate_args`` and ``TransformerConfig``
(``scripts/check_megatron_args.py``; docs/emit.md). With a layout no virtual-stage flag is
emitted (``validate_args`` derives it and accepts only one of the three);
``--decoder-first/last-pipeline-num-layers`` and ``--account-for-*`` conflict with a layout and
are never emitted. ``--rotary-base`` is an int in Megatron's parser.

Environment: ``validate_args`` refuses TP > 1 or CP > 1 on GPUs before Blackwell (compute
capability < 10) unless ``CUDA_DEVICE_MAX_CONNECTIONS=1`` (:func:`megatron_env`).
"""

from __future__ import annotations

from megapipe.cost.shapes import MAKE_VOCAB_SIZE_DIVISIBLE_BY
from megapipe.emit.memory import megatron_memory_args
from megapipe.emit.moe import hybridep_env, megatron_moe_args
from megapipe.features import device_max_connections
from megapipe.emit.precision import megatron_precision_args
from megapipe.emit.quoting import cli_number
from megapipe.records import Activation, GpuSpec, ModelSpec, ParallelSpec, Recompute, TrainSpec

__all__ = ["megatron_args", "megatron_env", "recompute_settings", "family_settings"]


def recompute_settings(granularity: Recompute) -> dict[str, object]:
    """Megatron's (recompute_granularity, recompute_method, recompute_num_layers); ``none`` is all None.

    Full recompute checkpoints every layer (uniform, 1 layer per unit), which is what
    the memory model's 2·s·b·h per layer assumes (Korthikanti et al. 2022, Table 2).
    """
    granularity = Recompute(granularity)
    if granularity == Recompute.full:
        return {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    if granularity == Recompute.selective:
        return {"recompute_granularity": "selective", "recompute_method": None, "recompute_num_layers": None}
    return {"recompute_granularity": None, "recompute_method": None, "recompute_num_layers": None}


def family_settings(model: ModelSpec) -> dict[str, object]:
    """Normalisation, biases and dropout of the model's family, in TransformerConfig names
    (``model.add_bias_linear`` overrides the family's biases: GPT-OSS)."""
    activation = Activation(model.activation)
    if activation == Activation.swiglu:
        family = {"normalization": "RMSNorm", "add_bias_linear": False, "attention_dropout": 0.0, "hidden_dropout": 0.0}
    elif activation == Activation.squared_relu:  # Nemotron: LayerNorm, no biases, no dropout
        family = {"normalization": "LayerNorm", "add_bias_linear": False, "attention_dropout": 0.0, "hidden_dropout": 0.0}
    else:
        family = {"normalization": "LayerNorm", "add_bias_linear": True, "attention_dropout": 0.1, "hidden_dropout": 0.1}
    if model.add_bias_linear is not None:
        family["add_bias_linear"] = bool(model.add_bias_linear)
    return family


def _shape_args(model: ModelSpec, train: TrainSpec) -> list[str]:
    args = ["--num-layers", str(model.num_layers), "--hidden-size", str(model.hidden_size),
            "--ffn-hidden-size", str(model.ffn_hidden_size), "--num-attention-heads", str(model.num_attention_heads)]
    if model.num_query_groups != model.num_attention_heads and not model.multi_latent_attention:
        args += ["--group-query-attention", "--num-query-groups", str(model.num_query_groups)]
    args += ["--kv-channels", str(model.head_dim), "--seq-length", str(train.seq_length),
             "--max-position-embeddings", str(max(model.max_position_embeddings or 0, train.seq_length))]
    args += ["--position-embedding-type", model.position_embedding_type]
    if model.position_embedding_type == "rope":
        args += ["--rotary-base", str(int(round(model.rotary_base)))]
        if model.use_rope_scaling:
            args += ["--use-rope-scaling", "--rope-scaling-factor", cli_number(model.rope_scaling_factor)]
    if Activation(model.activation) == Activation.swiglu:
        args.append("--swiglu")
    elif Activation(model.activation) == Activation.squared_relu:
        args.append("--squared-relu")
    family = family_settings(model)
    args += ["--normalization", str(family["normalization"]), "--norm-epsilon", cli_number(model.norm_epsilon)]
    if not family["add_bias_linear"]:
        args.append("--disable-bias-linear")
        if model.add_qkv_bias:
            args.append("--add-qkv-bias")
    args += ["--attention-dropout", cli_number(family["attention_dropout"]),
             "--hidden-dropout", cli_number(family["hidden_dropout"])]
    if model.untie_embeddings_and_output_weights:
        args.append("--untie-embeddings-and-output-weights")
    args += ["--vocab-size", str(model.vocab_size),
             "--make-vocab-size-divisible-by", str(MAKE_VOCAB_SIZE_DIVISIBLE_BY)]
    return args


def megatron_args(*, layout: str, parallel: ParallelSpec, train: TrainSpec, model: ModelSpec) -> tuple[str, ...]:
    """argv tokens for ``pretrain_gpt.py``; the layout token is raw (argparse sees no quotes)."""
    args = [
        "--tensor-model-parallel-size", str(parallel.tensor_model_parallel_size),
        "--pipeline-model-parallel-size", str(parallel.pipeline_model_parallel_size),
        "--pipeline-model-parallel-layout", layout,
    ]  # fmt: skip
    if parallel.virtual_pipeline_model_parallel_size > 1 and parallel.microbatch_group_size_per_vp_stage:
        args += ["--microbatch-group-size-per-virtual-pipeline-stage", str(parallel.microbatch_group_size_per_vp_stage)]
    args += ["--context-parallel-size", str(parallel.context_parallel_size)]
    if parallel.sequence_parallel and parallel.tensor_model_parallel_size > 1:
        args.append("--sequence-parallel")
    args += ["--micro-batch-size", str(train.micro_batch_size), "--global-batch-size", str(train.global_batch_size)]
    for name, value in recompute_settings(train.recompute_granularity).items():
        if value is not None:
            args += ["--" + name.replace("_", "-"), str(value)]
    if parallel.use_distributed_optimizer:
        args.append("--use-distributed-optimizer")
    # What the step-time model assumes about the DP collectives (megapipe.cost.data_parallel).
    if parallel.overlap_grad_reduce:
        args.append("--overlap-grad-reduce")
    if parallel.overlap_param_gather and parallel.use_distributed_optimizer:
        args.append("--overlap-param-gather")
    args += _shape_args(model, train)
    args += megatron_moe_args(model, parallel, train)
    args += megatron_precision_args(train, parallel)
    args += megatron_memory_args(train, parallel)
    return tuple(args)


def megatron_env(*, parallel: ParallelSpec, gpus: tuple[GpuSpec, ...], domain_gpus: int = 8) -> dict[str, str]:
    """Environment variables Megatron-LM's start-up checks and the plan's runtime features need on these GPUs.

    CUDA_DEVICE_MAX_CONNECTIONS: 1 where ``validate_args`` demands it (TP or CP > 1 before Blackwell), except
    with EP overlap, which needs more than one (its all-to-alls run on a stream of their own; validate_args then
    only warns) and with Megatron FSDP, which refuses 1; 32 for EP overlap or DeepEP/HybridEP otherwise
    (:func:`megapipe.features.device_max_connections`). HybridEP's topology variables come from
    :func:`megapipe.emit.moe.hybridep_env`; fine-grained activation offloading needs NVTE_CPU_OFFLOAD_V1=1
    (``validate_args``: Transformer Engine 2.10 and later would offload the weights too)."""
    env: dict[str, str] = {}
    wanted = device_max_connections(parallel.features)
    model_parallel = parallel.tensor_model_parallel_size > 1 or parallel.context_parallel_size > 1
    if parallel.use_megatron_fsdp:  # validate_args: "FSDP always requires CUDA_DEVICE_MAX_CONNECTIONS ... > 1"
        env["CUDA_DEVICE_MAX_CONNECTIONS"] = str(wanted or 32)
    elif parallel.features.overlap_moe_expert_parallel_comm:
        env["CUDA_DEVICE_MAX_CONNECTIONS"] = str(wanted)
    elif model_parallel and any(gpu.before_blackwell for gpu in gpus):
        env["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    elif wanted:
        env["CUDA_DEVICE_MAX_CONNECTIONS"] = str(wanted)
    env.update(hybridep_env(parallel, domain_gpus=domain_gpus))
    if parallel.features.fine_grained_activation_offloading:  # validate_args: TE >= 2.10 offloads weights without it
        env["NVTE_CPU_OFFLOAD_V1"] = "1"
    return env
