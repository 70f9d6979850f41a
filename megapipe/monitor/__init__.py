"""Run-time monitoring of real Megatron pipeline runs.

``from megapipe.monitor import attach``; ``hook = attach(model_chunks)`` measures
per-rank compute, p2p wait and bubble from megatron-core's own timer calls and
compares the pipeline's bubble with megapipe's simulator.
"""

from megapipe.monitor.hook import HookReport, ScheduleHook, attach
from megapipe.monitor.metrics import PipelineMetrics, StepMetrics
from megapipe.monitor.monitor import TrainingMonitor, attach_monitor

__all__ = ["attach", "attach_monitor", "TrainingMonitor", "HookReport", "ScheduleHook", "PipelineMetrics", "StepMetrics"]
