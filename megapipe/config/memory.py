"""The memory settings of the parallel and train groups (Megatron FSDP, the precision-aware optimizer, optimizer
offloading), read from the config as their records declare them; :func:`megapipe.cost.model_state.state_problem`
checks them against what Megatron accepts."""

from __future__ import annotations

from megapipe.errors import ConfigError
from megapipe.records import PARALLEL_MEMORY_FIELDS, TRAIN_MEMORY_FIELDS, ParallelSpec, TrainSpec

__all__ = ["MEMORY_FIELDS", "memory_fields"]

MEMORY_FIELDS = {ParallelSpec: PARALLEL_MEMORY_FIELDS, TrainSpec: TRAIN_MEMORY_FIELDS}
"""Each record's memory settings: off (Megatron's defaults) unless the config sets them."""


def memory_fields(node, record: type, *, where: str | None = None) -> dict[str, object]:
    """The record's memory settings ``node`` (a config group, or a published run's block) gives; the others keep the
    record's defaults (Megatron's). ``where`` names the block in an error (default: the config group)."""
    defaults = record()
    where = where or ("parallel" if record is ParallelSpec else "train")
    out: dict[str, object] = {}
    for name in MEMORY_FIELDS[record]:
        value = node.get(name)
        if value is None:
            continue
        kind = type(getattr(defaults, name))
        if kind is bool and not isinstance(value, bool):
            raise ConfigError(f"{where}.{name}={value!r} must be true or false")
        out[name] = float(value) if kind is float else kind(value)
    return out
