"""Megatron-LM command-line arguments (``megatron/training/arguments.py``).

Flag names were checked against Megatron-LM core_v0.16.1 and main (2026-08):
TransformerConfig fields become ``--field-name`` flags; the interleaving group
keeps its long name ``--microbatch-group-size-per-virtual-pipeline-stage``.
``validate_args`` accepts at most one of ``--pipeline-model-parallel-layout``,
``--num-virtual-stages-per-pipeline-rank`` and ``--num-layers-per-virtual-pipeline-stage``
and derives the virtual stages from the layout (stages / pipeline size), so with a
layout no virtual-stage flag is emitted. ``--decoder-first/last-pipeline-num-layers``
and ``--account-for-*-in-pipeline-split`` conflict with a layout and are never emitted.
"""

from __future__ import annotations

from megapipe.records import ParallelSpec, Recompute, TrainSpec

__all__ = ["megatron_args", "recompute_settings"]


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


def megatron_args(*, layout: str, parallel: ParallelSpec, train: TrainSpec) -> tuple[str, ...]:
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
    return tuple(args)
