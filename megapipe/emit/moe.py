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
"""

from __future__ import annotations

from itertools import groupby

from megapipe.emit.quoting import cli_number
from megapipe.records import ModelSpec, ParallelSpec

__all__ = ["moe_layer_freq_expr", "moe_config", "expert_parallel_config", "megatron_moe_args"]


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
        moe_token_dispatcher_type=parallel.moe_token_dispatcher_type, moe_grouped_gemm=True,
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


def megatron_moe_args(model: ModelSpec, parallel: ParallelSpec) -> list[str]:
    """Megatron-LM flags for :func:`moe_config` and the expert-parallel sizes."""
    args: list[str] = []
    for name, value in {**expert_parallel_config(model, parallel), **moe_config(model, parallel)}.items():
        flag = _flag(_CLI_NAMES.get(name, name))
        if value is True:
            args.append(flag)
        elif name == "moe_layer_freq":
            args += [flag, moe_layer_freq_expr(tuple(int(v) for v in model.moe_layers))]
        elif value is not None and value is not False:
            args += [flag, cli_number(value) if isinstance(value, (int, float)) else str(value)]
    return args

