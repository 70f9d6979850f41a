"""Checks and counts over a layout's stages, as megatron-core will read them.

megatron-core (``PipelineParallelLayerLayout``) lists stages vp-major: layout stage
``vp_stage * pipeline_model_parallel_size + pp_rank``. Decoder layer numbers run
through the stages in that order, so a stage's offset is the count of ``t`` in
every earlier layout stage. Without a layout Megatron splits ``num_layers``
equally over ``pipeline_model_parallel_size * virtual_pipeline_model_parallel_size``
chunks, the embedding on the first and the loss on the last
(``megatron.core.transformer.transformer_block.get_num_layers_to_build``).
"""

from __future__ import annotations

from collections.abc import Sequence

from megapipe.errors import ConfigError
from megapipe.layout import format_layout, mtp_problem
from megapipe.records import LayerKind

__all__ = [
    "StageKinds",
    "decoder_counts",
    "decoder_offsets",
    "equal_stage_kinds",
    "is_equal_split",
    "rank_of_stage",
    "validate_stages",
]

StageKinds = Sequence[Sequence[LayerKind]]


def rank_of_stage(stage_index: int, *, pipeline_model_parallel_size: int) -> tuple[int, int]:
    """Layout stage index -> (pp_rank, vp_stage), Megatron's vp-major order."""
    return stage_index % pipeline_model_parallel_size, stage_index // pipeline_model_parallel_size


def decoder_counts(stage_kinds: StageKinds) -> tuple[int, ...]:
    """Decoder layers (``t``) per layout stage: what ``get_num_layers_to_build`` returns."""
    return tuple(sum(1 for kind in kinds if kind == LayerKind.decoder) for kinds in stage_kinds)


def decoder_offsets(stage_kinds: StageKinds) -> tuple[int, ...]:
    """0-based global index of each stage's first decoder layer: ``get_layer_offset``."""
    offsets, total = [], 0
    for count in decoder_counts(stage_kinds):
        offsets.append(total)
        total += count
    return tuple(offsets)


def _where(stage_index: int, pipeline_model_parallel_size: int) -> str:
    pp_rank, vp_stage = rank_of_stage(stage_index, pipeline_model_parallel_size=pipeline_model_parallel_size)
    return f"stage {stage_index} (pp_rank={pp_rank}, vp_stage={vp_stage})"


def _check_ends(flat: list[LayerKind], layout: str) -> None:
    if flat.count(LayerKind.embedding) != 1 or flat[0] != LayerKind.embedding:
        raise ConfigError(f"layout {layout!r} must start with exactly one embedding E; put E first in stage 0 only")
    if flat.count(LayerKind.loss) != 1 or flat[-1] != LayerKind.loss:
        raise ConfigError(f"layout {layout!r} must end with exactly one loss L; put L last in the last stage only")


def validate_stages(
    stage_kinds: StageKinds, *, pipeline_model_parallel_size: int, virtual_pipeline_model_parallel_size: int = 1
) -> None:
    """Raise ConfigError unless megatron-core can build and run this layout.

    Beyond megatron-core's own ``validate_layer_layout`` (and its MTP rules,
    :func:`megapipe.layout.mtp_problem`) this rejects empty stages: they parse, but a rank
    chunk with no module deadlocks (Megatron-LM #1852).
    """
    layout = format_layout(stage_kinds)
    num_stages = pipeline_model_parallel_size * virtual_pipeline_model_parallel_size
    if len(stage_kinds) != num_stages:
        raise ConfigError(
            f"layout {layout!r} has {len(stage_kinds)} stages but {pipeline_model_parallel_size=} x "
            f"{virtual_pipeline_model_parallel_size=} needs {num_stages}; re-partition for these sizes"
        )
    for index, kinds in enumerate(stage_kinds):
        if not kinds:
            raise ConfigError(
                f"layout {layout!r} leaves {_where(index, pipeline_model_parallel_size)} empty, which deadlocks "
                "Megatron (Megatron-LM #1852); lower pipeline_model_parallel_size or give every stage an entry"
            )
    _check_ends([kind for kinds in stage_kinds for kind in kinds], layout)
    problem = mtp_problem(stage_kinds, pipeline_model_parallel_size=pipeline_model_parallel_size)
    if problem:
        raise ConfigError(f"layout {layout!r}: {problem}")


def equal_stage_kinds(
    *, num_layers: int, mtp_num_layers: int = 0, pipeline_model_parallel_size: int,
    virtual_pipeline_model_parallel_size: int = 1,
) -> tuple[tuple[LayerKind, ...], ...] | None:
    """Megatron's default split (no layout), or None when num_layers does not divide.

    The MTP layers sit with the loss on the last stage, as Megatron places them
    when no layout is given.
    """
    num_stages = pipeline_model_parallel_size * virtual_pipeline_model_parallel_size
    if num_layers % num_stages:
        return None
    per_stage = num_layers // num_stages
    stages = [[LayerKind.decoder] * per_stage for _ in range(num_stages)]
    stages[0].insert(0, LayerKind.embedding)
    stages[-1].extend([LayerKind.mtp] * mtp_num_layers + [LayerKind.loss])
    return tuple(tuple(stage) for stage in stages)


def is_equal_split(
    stage_kinds: StageKinds, *, pipeline_model_parallel_size: int, virtual_pipeline_model_parallel_size: int = 1
) -> bool:
    """True when the layout is what Megatron builds without one."""
    flat = [kind for kinds in stage_kinds for kind in kinds]
    equal = equal_stage_kinds(
        num_layers=flat.count(LayerKind.decoder),
        mtp_num_layers=flat.count(LayerKind.mtp),
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
    )
    return equal is not None and equal == tuple(tuple(kinds) for kinds in stage_kinds)
