"""Run-time monitoring of real Megatron pipeline runs.

``from megapipe.monitor import attach``; ``hook = attach(model_chunks)`` measures
per-rank compute, p2p wait and bubble from megatron-core's own timer calls and
compares the pipeline's bubble with megapipe's simulator.

The names below load on first use (PEP 562), so a command that only reads a monitor log
(``megapipe.monitor.jsonl``) does not import the hook and the training monitor.
"""

from importlib import import_module

__all__ = ["attach", "attach_monitor", "TrainingMonitor", "HookReport", "ScheduleHook", "PipelineMetrics", "StepMetrics"]

_HOMES = {
    "attach": "hook", "HookReport": "hook", "ScheduleHook": "hook",
    "PipelineMetrics": "metrics", "StepMetrics": "metrics",
    "TrainingMonitor": "monitor", "attach_monitor": "monitor",
}


def __getattr__(name: str):
    if name in _HOMES:
        return getattr(import_module(f"megapipe.monitor.{_HOMES[name]}"), name)
    raise AttributeError(f"module 'megapipe.monitor' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
