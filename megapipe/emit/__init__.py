"""Megatron output: the layout string, Megatron-LM arguments, Megatron-Bridge, NeMo 2 and NeMo 1 overrides.

Pure: records in, strings out; no torch, no I/O. ``emit`` is the entry point.
"""

from megapipe.emit.emitted import Emitted, emit
from megapipe.emit.launch import launch_line, launch_script, node_rank_lines, slurm_script
from megapipe.emit.megatron import megatron_args, megatron_env, recompute_settings
from megapipe.emit.overrides import BridgeKeys, bridge_settings, nemo1_settings, nemo2_settings, to_overrides
from megapipe.emit.quoting import format_override, format_value, shell_join, shell_quote
from megapipe.emit.stages import (
    decoder_counts,
    decoder_offsets,
    equal_stage_kinds,
    is_equal_split,
    rank_of_stage,
    validate_stages,
)

__all__ = [
    "BridgeKeys",
    "Emitted",
    "emit",
    "launch_line",
    "launch_script",
    "slurm_script",
    "megatron_env",
    "node_rank_lines",
    "megatron_args",
    "recompute_settings",
    "bridge_settings",
    "nemo1_settings",
    "nemo2_settings",
    "to_overrides",
    "format_override",
    "format_value",
    "shell_join",
    "shell_quote",
    "decoder_counts",
    "decoder_offsets",
    "equal_stage_kinds",
    "is_equal_split",
    "rank_of_stage",
    "validate_stages",
]
