"""Overrides for Megatron-Bridge, NeMo 2 (NeMo-Run CLI) and NeMo 1 configs: the plan, the model shape and precision.

Key names were checked in the public sources (docs/emit.md has the references):

- Megatron-Bridge ``ConfigContainer``: ``model.*`` is the TransformerConfig-based provider (flat
  in the released 0.6.x; Bridge main, unreleased 0.7, nests the Llama recipes' transformer fields
  under ``model.transformer.*`` and keeps vocabulary, sequence and position fields on ``model.*``);
  ``train.micro_batch_size`` / ``train.global_batch_size``; ``dataset.seq_length``, which the run
  script copies into the model; the distributed optimizer in both ``ddp`` and ``optimizer``;
  precision as a ``mixed_precision`` recipe name (a bare ``model.bf16`` is undone by it;
  :mod:`megapipe.emit.precision`); the environment in ``env_vars``. Bridge applies overrides with Hydra's OverridesParser.
- NeMo 2 ``MegatronStrategy`` (2.5-2.7) takes ``pipeline_model_parallel_layout`` and the parallel
  sizes under ``trainer.strategy``; the model's TransformerConfig is ``model.config``; batch and
  sequence are ``data.*`` (and ``model.config.seq_length``); the optimizer ``optim.config``;
  precision the ``trainer.plugins`` MegatronMixedPrecision (which overrides ``model.config``).
- NeMo 1 ``megatron_gpt_config.yaml``: ``model.*`` sizes and shape, ``activations_checkpoint_*``,
  ``trainer.precision``; ``context_parallel_size`` and ``rotary_base`` are read with ``cfg.get``
  but are not in the yaml, so they are force-added (``++``). There is no per-stage key.

Recipes may preset ``num_layers_in_first/last_pipeline_stage`` or
``account_for_*_in_pipeline_split``, which megatron-core rejects next to a layout, so the layout
overrides reset them.
"""

from __future__ import annotations

import enum

from megapipe.cost.shapes import MAKE_VOCAB_SIZE_DIVISIBLE_BY
from megapipe.emit.megatron import family_settings, recompute_settings
from megapipe.emit.memory import bridge_memory, nemo1_memory, nemo2_memory
from megapipe.emit.moe import expert_parallel_config, feature_config, moe_config, overlap_config
from megapipe.emit.precision import bridge_precision, nemo1_precision, nemo2_precision
from megapipe.emit.quoting import format_override
from megapipe.records import Activation, ModelSpec, ParallelSpec, TrainSpec

__all__ = ["BridgeKeys", "bridge_settings", "nemo1_settings", "nemo2_settings", "to_overrides"]


class BridgeKeys(str, enum.Enum):
    """How Megatron-Bridge spells TransformerConfig fields: flat ``model.*`` (0.6.x) or ``model.transformer.*``."""

    flat = "flat"
    nested = "nested"


_LAYOUT_RESETS = {
    "num_layers_in_first_pipeline_stage": None,
    "num_layers_in_last_pipeline_stage": None,
    "account_for_embedding_in_pipeline_split": False,
    "account_for_loss_in_pipeline_split": False,
}


def _virtual_size(parallel: ParallelSpec) -> int | None:
    """Megatron spells "no interleaving" as None."""
    return parallel.virtual_pipeline_model_parallel_size if parallel.virtual_pipeline_model_parallel_size > 1 else None


def _sequence_parallel(parallel: ParallelSpec) -> bool:
    return parallel.sequence_parallel and parallel.tensor_model_parallel_size > 1


def _strategy_settings(*, layout: str, parallel: ParallelSpec) -> dict[str, object]:
    """Fields shared by Bridge's model provider and NeMo 2's MegatronStrategy."""
    settings: dict[str, object] = {
        "tensor_model_parallel_size": parallel.tensor_model_parallel_size,
        "pipeline_model_parallel_size": parallel.pipeline_model_parallel_size,
        "virtual_pipeline_model_parallel_size": _virtual_size(parallel),
        "pipeline_model_parallel_layout": layout,
        **_LAYOUT_RESETS,
        "context_parallel_size": parallel.context_parallel_size,
        "sequence_parallel": _sequence_parallel(parallel),
    }
    if _virtual_size(parallel) and parallel.microbatch_group_size_per_vp_stage:
        settings["microbatch_group_size_per_vp_stage"] = parallel.microbatch_group_size_per_vp_stage
    return settings


def _transformer_shape(model: ModelSpec) -> dict[str, object]:
    """TransformerConfig fields of the model's shape and family."""
    family = family_settings(model)
    return {
        "num_layers": model.num_layers, "hidden_size": model.hidden_size, "ffn_hidden_size": model.ffn_hidden_size,
        "num_attention_heads": model.num_attention_heads, "num_query_groups": model.num_query_groups,
        "kv_channels": model.head_dim, "normalization": family["normalization"],
        "layernorm_epsilon": model.norm_epsilon, "add_bias_linear": family["add_bias_linear"],
        "gated_linear_unit": Activation(model.activation) == Activation.swiglu,
        "attention_dropout": family["attention_dropout"], "hidden_dropout": family["hidden_dropout"],
        **({"add_qkv_bias": True} if model.add_qkv_bias and not family["add_bias_linear"] else {}),
    }


def _model_shape(model: ModelSpec, train: TrainSpec) -> dict[str, object]:
    """Fields of the GPT model around the transformer: vocabulary, sequence, positions, tied embeddings."""
    settings: dict[str, object] = {
        "vocab_size": model.vocab_size, "make_vocab_size_divisible_by": MAKE_VOCAB_SIZE_DIVISIBLE_BY,
        "seq_length": train.seq_length,
        "share_embeddings_and_output_weights": not model.untie_embeddings_and_output_weights,
        "position_embedding_type": model.position_embedding_type,
    }
    if model.position_embedding_type == "rope":
        settings["rotary_base"] = int(round(model.rotary_base))
        if model.use_rope_scaling:  # GPTModel's rope_scaling / rope_scaling_factor (Bridge's and NeMo 2's GPTConfig)
            settings.update(rope_scaling=True, rope_scaling_factor=model.rope_scaling_factor)
    return settings


def _prefixed(prefix: str, settings: dict[str, object]) -> dict[str, object]:
    return {f"{prefix}.{key}": value for key, value in settings.items()}


def bridge_settings(*, layout: str, parallel: ParallelSpec, train: TrainSpec, model: ModelSpec,
                    env: dict[str, str], keys: BridgeKeys = BridgeKeys.flat) -> dict[str, object]:
    """Megatron-Bridge ConfigContainer keys and values (``keys``: 0.6.x flat or main's nested spelling)."""
    transformer = "model.transformer" if BridgeKeys(keys) == BridgeKeys.nested else "model"
    settings = {
        **_prefixed(transformer, _strategy_settings(layout=layout, parallel=parallel)),
        **_prefixed(transformer, recompute_settings(train.recompute_granularity)),
        **_prefixed(transformer, _transformer_shape(model)),
        **_prefixed(transformer, {**expert_parallel_config(model, parallel), **moe_config(model, parallel),
                                  **feature_config(model, parallel, train)}),
        **_prefixed("comm_overlap", overlap_config(parallel)),
        **({"rng.te_rng_tracker": True} if parallel.features.cuda_graphs else {}),
        **_prefixed("model", _model_shape(model, train)),
        "train.micro_batch_size": train.micro_batch_size,
        "train.global_batch_size": train.global_batch_size,
        "dataset.seq_length": train.seq_length,
        "ddp.use_distributed_optimizer": parallel.use_distributed_optimizer,
        "optimizer.use_distributed_optimizer": parallel.use_distributed_optimizer,
        "ddp.overlap_grad_reduce": parallel.overlap_grad_reduce,
        "ddp.overlap_param_gather": parallel.use_distributed_optimizer and parallel.overlap_param_gather,
        **bridge_precision(train, parallel)[0],
        **bridge_memory(train, parallel),
    }
    settings.update({f"++env_vars.{name}": value for name, value in env.items()})
    return settings


def nemo2_settings(*, layout: str, parallel: ParallelSpec, train: TrainSpec, model: ModelSpec,
                   gpus_per_node: int | None = None) -> dict[str, object]:
    """NeMo 2 recipe keys (``nemo llm pretrain`` through NeMo-Run) and values; with ``gpus_per_node`` the
    trainer's nodes and devices (the recipe's own defaults are one node of eight)."""
    shape = _model_shape(model, train)
    for key in ("rope_scaling", "rope_scaling_factor"):  # NeMo 2 keeps Llama 3.1's scaling in Llama31Config
        shape.pop(key, None)
    trainer = ({"trainer.num_nodes": max(1, parallel.world_size // gpus_per_node),
                "trainer.devices": min(gpus_per_node, parallel.world_size)} if gpus_per_node else {})
    return {
        **trainer,
        **_prefixed("trainer.strategy", _strategy_settings(layout=layout, parallel=parallel)),
        **_prefixed("trainer.strategy", expert_parallel_config(model, parallel)),
        "trainer.strategy.ddp.overlap_grad_reduce": parallel.overlap_grad_reduce,
        "trainer.strategy.ddp.overlap_param_gather": parallel.use_distributed_optimizer and parallel.overlap_param_gather,
        **_prefixed("model.config", recompute_settings(train.recompute_granularity)),
        **_prefixed("model.config", _transformer_shape(model)),
        **_prefixed("model.config", {**moe_config(model, parallel), **feature_config(model, parallel, train),
                                     **overlap_config(parallel)}),
        **({"trainer.strategy.use_te_rng_tracker": True} if parallel.features.cuda_graphs else {}),
        **_prefixed("model.config", shape),
        "data.micro_batch_size": train.micro_batch_size,
        "data.global_batch_size": train.global_batch_size,
        "data.seq_length": train.seq_length,
        "optim.config.use_distributed_optimizer": parallel.use_distributed_optimizer,
        **nemo2_precision(train),
        **nemo2_memory(train, parallel),
    }


def nemo1_settings(*, parallel: ParallelSpec, train: TrainSpec, model: ModelSpec) -> dict[str, object]:
    """NeMo 1 ``megatron_gpt_config.yaml`` keys; a ``++`` key is force-added."""
    recompute = recompute_settings(train.recompute_granularity)
    family = family_settings(model)
    swiglu = Activation(model.activation) == Activation.swiglu
    settings: dict[str, object] = {
        "model.tensor_model_parallel_size": parallel.tensor_model_parallel_size,
        "model.pipeline_model_parallel_size": parallel.pipeline_model_parallel_size,
        "model.virtual_pipeline_model_parallel_size": _virtual_size(parallel),
        "++model.context_parallel_size": parallel.context_parallel_size,
        "model.sequence_parallel": _sequence_parallel(parallel),
        "model.micro_batch_size": train.micro_batch_size,
        "model.global_batch_size": train.global_batch_size,
        "model.activations_checkpoint_granularity": recompute["recompute_granularity"],
        "model.activations_checkpoint_method": recompute["recompute_method"],
        "model.activations_checkpoint_num_layers": recompute["recompute_num_layers"],
        "model.num_layers": model.num_layers, "model.hidden_size": model.hidden_size,
        "model.ffn_hidden_size": model.ffn_hidden_size, "model.num_attention_heads": model.num_attention_heads,
        "model.num_query_groups": model.num_query_groups, "model.kv_channels": model.head_dim,
        "model.encoder_seq_length": train.seq_length,
        "model.max_position_embeddings": max(model.max_position_embeddings or 0, train.seq_length),
        "model.position_embedding_type": model.position_embedding_type,
        "model.activation": "fast-swiglu" if swiglu else "gelu",
        "model.normalization": "rmsnorm" if family["normalization"] == "RMSNorm" else "layernorm",
        "model.layernorm_epsilon": model.norm_epsilon,
        "model.bias": bool(family["add_bias_linear"]),
        "model.hidden_dropout": family["hidden_dropout"], "model.attention_dropout": family["attention_dropout"],
        "model.share_embeddings_and_output_weights": not model.untie_embeddings_and_output_weights,
        "model.make_vocab_size_divisible_by": MAKE_VOCAB_SIZE_DIVISIBLE_BY,
        **nemo1_precision(train, parallel)[0],
    }
    if model.position_embedding_type == "rope":
        settings["++model.rotary_base"] = int(round(model.rotary_base))
    moe = {**expert_parallel_config(model, parallel), **moe_config(model, parallel)}
    moe.pop("mtp_num_layers", None)  # NeMo 1 has no MTP (emitted.py warns)
    settings.update({f"++model.{key}": value for key, value in moe.items()})
    if parallel.use_distributed_optimizer:
        settings["model.optim.name"] = "distributed_fused_adam"
        settings.update(nemo1_memory(train))
    return settings


def to_overrides(settings: dict[str, object]) -> tuple[str, ...]:
    """``key=value`` lines; layouts are always quoted."""
    return tuple(
        format_override(key, value, quote=key.endswith("pipeline_model_parallel_layout"))
        for key, value in settings.items()
    )
