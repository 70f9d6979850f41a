"""Mixture-of-experts, multi-latent attention and MTP settings, in every target's spelling.

One table of TransformerConfig fields (:func:`moe_config`) feeds Megatron-Bridge (``model.*``), NeMo 2
(``model.config.*``, with the expert-parallel sizes on ``trainer.strategy``) and NeMo 1 (``model.*``);
:func:`megatron_moe_args` spells the same for Megatron-LM's ``pretrain_gpt.py``. Flag names are those of
Megatron-LM core_v0.16.1 ``megatron/training/arguments.py`` (most generated from TransformerConfig by its
ArgumentGroupFactory), checked by ``scripts/check_megatron_args.py``.

- ``--moe-layer-freq`` takes an int N (MoE where ``i % N == 0``) or a Python list expression; megapipe
  writes ``1`` for all-MoE models and otherwise the pattern as runs, e.g. ``([0]*3+[1]*58)``.
- ``--moe-grouped-gemm``: the cost model times the routed experts as one grouped GEMM.
- With TP > 1 a MoE model trains only with ``--sequence-parallel`` (megatron-core ``MoELayer.forward``
  raises otherwise); the search keeps SP on for such plans.
- MLA replaces query groups: ``--group-query-attention`` is never written with it.

Runtime features (:class:`megapipe.records.RuntimeFeatures`; each flag and its requirements were run through
Megatron-LM's own ``validate_args`` at core_v0.16.1, core_v0.19.0 and main, docs/emit.md):

- the dispatcher and its flex backend; DeepEP gets ``--moe-router-dtype fp32`` (it takes fp32 probabilities and
  otherwise casts them with a warning);
- EP overlap and ``delay_wgrad_compute`` (Megatron-Bridge: under ``comm_overlap.*``, whose set-up overwrites the
  model's copy), shared-expert overlap, the permute and router fusions, forced balancing, router padding;
- CUDA graphs: ``--cuda-graph-impl`` with ``--cuda-graph-scope`` (the spelling of core_v0.16.1, which 0.18 and
  later still parse as a deprecated alias of ``--cuda-graph-modules``) and ``--te-rng-tracker`` (Bridge: both
  ``model.use_te_rng_tracker`` and ``rng.te_rng_tracker``); a full-iteration graph also turns off the NaN check
  (``--no-check-for-nan-in-loss-and-grad``) and, with EP, sets ``--moe-pad-experts-for-cuda-graph-inference``
  (required at core_v0.16.1);
- ``--recompute-modules`` with selective recompute;
- fine-grained activation offloading: ``--fine-grained-activation-offloading`` with ``--offload-modules``
  (TransformerConfig fields at core_v0.16.1; :func:`megapipe.emit.megatron.megatron_env` adds the
  ``NVTE_CPU_OFFLOAD_V1=1`` it needs).
"""

from __future__ import annotations

from itertools import groupby

from megapipe.emit.quoting import cli_number
from megapipe.records import ModelSpec, ParallelSpec, Recompute, RuntimeFeatures, TrainSpec

__all__ = ["moe_layer_freq_expr", "moe_config", "expert_parallel_config", "megatron_moe_args", "feature_config",
           "overlap_config", "hybridep_env"]


def moe_layer_freq_expr(pattern: tuple[int, ...]) -> str:
    """Megatron's ``--moe-layer-freq`` for a 0/1 pattern: ``1`` when every layer is MoE, else runs."""
    if all(pattern):
        return "1"
    runs = [f"[{value}]*{len(list(group))}" for value, group in groupby(pattern)]
    return "(" + "+".join(runs) + ")"


def expert_parallel_config(model: ModelSpec, parallel: ParallelSpec) -> dict[str, object]:
    """The expert-parallel sizes and dispatcher (where NeMo 2 keeps them: its MegatronStrategy)."""
    if not model.is_moe:
        return {}
    return {"expert_model_parallel_size": parallel.expert_model_parallel_size,
            "expert_tensor_parallel_size": parallel.expert_tp}


def moe_config(model: ModelSpec, parallel: ParallelSpec) -> dict[str, object]:
    """TransformerConfig fields for the model's experts, router, MLA and MTP; empty for a plain dense model."""
    settings: dict[str, object] = {}
    if model.qk_layernorm:
        settings["qk_layernorm"] = True
    if model.multi_latent_attention:
        settings.update(multi_latent_attention=True, q_lora_rank=model.q_lora_rank, kv_lora_rank=model.kv_lora_rank,
                        qk_head_dim=model.qk_head_dim, qk_pos_emb_head_dim=model.qk_pos_emb_head_dim,
                        v_head_dim=model.v_head_dim)
    if model.mtp_num_layers:
        settings["mtp_num_layers"] = model.mtp_num_layers
    if not model.is_moe:
        return settings
    settings.update(
        num_moe_experts=model.num_moe_experts, moe_router_topk=model.moe_router_topk,
        moe_ffn_hidden_size=model.expert_ffn_hidden_size,
        moe_layer_freq=1 if all(model.moe_layers) else list(int(v) for v in model.moe_layers),
        moe_grouped_gemm=True,
        moe_router_score_function=model.moe_router_score_function,
        moe_router_load_balancing_type=model.moe_router_load_balancing_type,
        moe_aux_loss_coeff=model.moe_aux_loss_coeff,
    )
    if model.moe_shared_expert_intermediate_size:
        settings["moe_shared_expert_intermediate_size"] = model.moe_shared_expert_intermediate_size
    if model.moe_router_pre_softmax:
        settings["moe_router_pre_softmax"] = True
    if model.moe_router_enable_expert_bias:
        settings["moe_router_enable_expert_bias"] = True
    if model.moe_router_num_groups:
        settings.update(moe_router_num_groups=model.moe_router_num_groups,
                        moe_router_group_topk=model.moe_router_group_topk)
    if model.moe_router_topk_scaling_factor is not None:
        settings["moe_router_topk_scaling_factor"] = model.moe_router_topk_scaling_factor
    return settings


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


_CLI_NAMES = {"num_moe_experts": "num_experts"}
"""TransformerConfig fields whose Megatron-LM flag is named otherwise."""


def megatron_moe_args(model: ModelSpec, parallel: ParallelSpec, train: TrainSpec | None = None) -> list[str]:
    """Megatron-LM flags for :func:`moe_config`, the expert-parallel sizes and the runtime features."""
    args: list[str] = []
    features = feature_config(model, parallel, train) if train is not None else {}
    settings = {**expert_parallel_config(model, parallel), **moe_config(model, parallel), **features,
                **overlap_config(parallel)}
    for name, value in settings.items():
        flag = _flag(_CLI_NAMES.get(name, name))
        if name == "use_te_rng_tracker":
            args.append("--te-rng-tracker")
        elif value is True:
            args.append(flag)
        elif name == "moe_layer_freq":
            args += [flag, moe_layer_freq_expr(tuple(int(v) for v in model.moe_layers))]
        elif isinstance(value, list):
            if value:
                args += [flag, *[str(item) for item in value]]
        elif value is not None and value is not False:
            args += [flag, cli_number(value) if isinstance(value, (int, float)) else str(value)]
    if "full_iteration" in parallel.features.cuda_graph_scope:
        args.append("--no-check-for-nan-in-loss-and-grad")
    return args



def feature_config(model: ModelSpec, parallel: ParallelSpec, train: TrainSpec) -> dict[str, object]:
    """TransformerConfig fields of the plan's runtime features: only what differs from Megatron's defaults, and
    the dispatcher always (for MoE models)."""
    features = parallel.features
    settings: dict[str, object] = {}
    if model.is_moe:
        settings["moe_token_dispatcher_type"] = features.moe_token_dispatcher_type
        if features.moe_token_dispatcher_type == "flex":
            settings["moe_flex_dispatcher_backend"] = features.moe_flex_dispatcher_backend
            if features.moe_flex_dispatcher_backend == "deepep":
                settings["moe_router_dtype"] = "fp32"
        for name in ("moe_shared_expert_overlap", "moe_permute_fusion", "moe_router_fusion",
                     "moe_router_force_load_balancing", "moe_router_padding_for_quantization"):
            if getattr(features, name):
                settings[name] = True
    if features.cuda_graphs:
        full = "full_iteration" in features.cuda_graph_scope
        settings["cuda_graph_impl"] = "local" if full else features.cuda_graph_impl
        settings["cuda_graph_scope"] = list(features.cuda_graph_scope)
        settings["use_te_rng_tracker"] = True
        if full and model.is_moe and parallel.expert_model_parallel_size > 1:
            settings["moe_pad_experts_for_cuda_graph_inference"] = True
    if (Recompute(train.recompute_granularity) == Recompute.selective
            and features.recompute_modules != RuntimeFeatures().recompute_modules):
        settings["recompute_modules"] = list(features.recompute_modules)
    if features.fine_grained_activation_offloading:
        settings.update(fine_grained_activation_offloading=True, offload_modules=list(features.offload_modules))
    return settings


def overlap_config(parallel: ParallelSpec) -> dict[str, object]:
    """EP overlap and delayed weight gradients (ModelParallelConfig fields; Bridge's ``comm_overlap.*``)."""
    features = parallel.features
    if not features.overlap_moe_expert_parallel_comm:
        return {}
    return {"overlap_moe_expert_parallel_comm": True, "delay_wgrad_compute": features.delay_wgrad_compute}


def hybridep_env(parallel: ParallelSpec, *, domain_gpus: int) -> dict[str, str]:
    """What the HybridEP library reads for its topology (Megatron-Bridge's performance tooling sets the same):
    the NVLink domain's size, multi-node NVLink on GB200/GB300 NVL72, and the EP ranks per domain."""
    features = parallel.features
    if features.dispatcher != "hybridep":
        return {}
    domain = 72 if domain_gpus >= 72 else 8
    return {"NVLINK_DOMAIN_SIZE": str(domain), "USE_MNNVL": "1" if domain_gpus > 8 else "0",
            "NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN": str(min(parallel.expert_model_parallel_size, domain))}
