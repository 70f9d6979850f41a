"""Hydra-style overrides for Megatron-Bridge, NeMo 2 (NeMo-Run) and NeMo 1 configs.

Key names were checked in the public sources:
- Megatron-Bridge ``ConfigContainer`` (src/megatron/bridge/training/config.py):
  ``model.*`` is the TransformerConfig-based provider, ``train.micro_batch_size`` /
  ``train.global_batch_size``, and the distributed optimizer is set in both
  ``ddp`` and ``optimizer``. Bridge applies overrides with Hydra's OverridesParser.
- NeMo 2 ``MegatronStrategy`` (nemo/lightning/pytorch/strategies/megatron_strategy.py,
  2.6+) takes ``pipeline_model_parallel_layout`` and the parallel sizes; recompute
  lives in ``model.config``, batch sizes in ``data``, the optimizer in ``optim.config``.
- NeMo 1 ``megatron_gpt_config.yaml``: ``model.*`` sizes and
  ``activations_checkpoint_*``; ``context_parallel_size`` is read with ``cfg.get`` but
  is not in the yaml, so it is force-added (``++``). There is no per-stage key.

Recipes may preset ``num_layers_in_first/last_pipeline_stage`` or
``account_for_*_in_pipeline_split``, which megatron-core rejects next to a layout,
so the layout overrides reset them.
"""

from __future__ import annotations

from megapipe.emit.megatron import recompute_settings
from megapipe.emit.quoting import format_override
from megapipe.records import ParallelSpec, TrainSpec

__all__ = ["bridge_settings", "nemo1_settings", "nemo2_settings", "to_overrides"]

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


def _prefixed(prefix: str, settings: dict[str, object]) -> dict[str, object]:
    return {f"{prefix}.{key}": value for key, value in settings.items()}


def bridge_settings(*, layout: str, parallel: ParallelSpec, train: TrainSpec) -> dict[str, object]:
    """Megatron-Bridge ConfigContainer keys and values."""
    return {
        **_prefixed("model", _strategy_settings(layout=layout, parallel=parallel)),
        **_prefixed("model", recompute_settings(train.recompute_granularity)),
        "train.micro_batch_size": train.micro_batch_size,
        "train.global_batch_size": train.global_batch_size,
        "ddp.use_distributed_optimizer": parallel.use_distributed_optimizer,
        "optimizer.use_distributed_optimizer": parallel.use_distributed_optimizer,
    }


def nemo2_settings(*, layout: str, parallel: ParallelSpec, train: TrainSpec) -> dict[str, object]:
    """NeMo 2 recipe keys (``llm.pretrain`` through NeMo-Run) and values."""
    return {
        **_prefixed("trainer.strategy", _strategy_settings(layout=layout, parallel=parallel)),
        **_prefixed("model.config", recompute_settings(train.recompute_granularity)),
        "data.micro_batch_size": train.micro_batch_size,
        "data.global_batch_size": train.global_batch_size,
        "optim.config.use_distributed_optimizer": parallel.use_distributed_optimizer,
    }


def nemo1_settings(*, parallel: ParallelSpec, train: TrainSpec) -> dict[str, object]:
    """NeMo 1 ``megatron_gpt_config.yaml`` keys; a ``++`` key is force-added."""
    recompute = recompute_settings(train.recompute_granularity)
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
    }
    if parallel.use_distributed_optimizer:
        settings["model.optim.name"] = "distributed_fused_adam"
    return settings


def to_overrides(settings: dict[str, object]) -> tuple[str, ...]:
    """``key=value`` lines; layouts are always quoted."""
    return tuple(
        format_override(key, value, quote=key.endswith("pipeline_model_parallel_layout"))
        for key, value in settings.items()
    )
