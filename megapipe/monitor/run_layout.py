"""The layout string of a running model, read back from its megatron-core config.

``TransformerConfig.__post_init__`` turns ``pipeline_model_parallel_layout`` (a
string such as ``"Et|(t|)*2,tL"`` or a list of stages) into a
``PipelineParallelLayerLayout`` whose ``layout[pp_rank][vp_rank]`` lists each
stage's ``LayerType`` members (megatron/core/transformer/pipeline_parallel_layer_layout.py).
:func:`layout_string` walks that table in Megatron's stage order (vp-major:
stage ``vp * pp + rank``) and writes megapipe's flat form with
:func:`megapipe.layout.format_layout`, the form ``megapipe replan`` parses. Layer
types megapipe has no letter for (e.g. ``encoder``) fall back to Megatron's own
string representation.
"""

from __future__ import annotations

from typing import Any

from megapipe.errors import ConfigError
from megapipe.layout import format_layout, parse_layout
from megapipe.records import LayerKind

__all__ = ["layout_string"]


def layout_string(value: Any) -> str | None:
    """``config.pipeline_model_parallel_layout`` (None, a string or Megatron's layout object) -> a layout string."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            parse_layout(value)
            return value
        except ConfigError:  # Megatron's extended syntax (parentheses): unroll it
            from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

            stages = PipelineParallelLayerLayout.parse_str_to_list(value)
            return _format([[getattr(kind, "name", str(kind)) for kind in stage] for stage in stages], value)
    table = getattr(value, "layout", None)
    if not isinstance(table, list) or not table:
        return str(value)
    pp, vp = len(table), len(table[0])
    stages = [[getattr(kind, "name", str(kind)) for kind in table[rank][chunk]] for chunk in range(vp) for rank in range(pp)]
    return _format(stages, value)


def _format(stages: list[list[str]], original: Any) -> str:
    known = {kind.value for kind in LayerKind}
    if any(name not in known for stage in stages for name in stage):
        return str(original)
    return format_layout([[LayerKind(name) for name in stage] for stage in stages])
