"""Schedule hook: measure compute, p2p wait and bubble inside real megatron-core steps.

``hook = attach(model_chunks)`` replaces ``config.timers`` on every chunk's
TransformerConfig with a proxy that delegates every call to what was there
before (Megatron-LM's ``Timers``, or None) and additionally records the
intervals of the timers megatron-core's schedules open (names in
:data:`megapipe.monitor.metrics.TIMER_KINDS`; others pass through untouched).
Nothing in Megatron is patched.

At each ``forward-backward`` stop the step's intervals become a
:class:`~megapipe.monitor.metrics.StepMetrics`; every ``gather_every`` steps all
ranks of the pipeline group exchange one fixed-size float row with a single
``all_gather`` (every rank reaches that stop, so every rank calls it), and the
hook publishes a :class:`HookReport`: per-stage compute and spread, measured
bubble, the simulator's bubble and step from the measured stage times and
per-op dispatch overhead, and the plan's bubble.

Faults: an exception inside the hook is logged once and recording stops on that
rank; the next gather carries a fault flag, and every rank then restores the
original timers together (a rank that stopped alone would leave the others
waiting in the all-gather). Training is never interrupted by the hook.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from megapipe.errors import ConfigError
from megapipe.monitor.clock import CudaEventClock, HostClock, IntervalRing
from megapipe.monitor.metrics import (
    TIMER_KINDS,
    PipelineMetrics,
    StepMetrics,
    combine_rows,
    derive_step,
    mean_steps,
    pack_row,
    row_size,
    unpack_row,
)
from megapipe.monitor.predict import predict_bubble
from megapipe.monitor.proxy import TimersProxy

__all__ = ["HookReport", "ScheduleHook", "attach"]

logger = logging.getLogger("megapipe.monitor")

_NUM_SLOTS = len(TIMER_KINDS)
_VALID, _FAULTED, _SKIPPED = 1.0, 0.0, -1.0


@dataclass(frozen=True, slots=True, kw_only=True)
class HookReport:
    """What one gather window measured, identical on every rank of the pipeline group."""

    step: int
    """Steps completed when this report was made."""
    rank: StepMetrics
    """This rank's metrics (means over the window)."""
    pipeline: PipelineMetrics | None
    """All pipeline ranks; None with pipeline size 1 (no bubble to report)."""
    measured_bubble_fraction: float | None
    simulated_bubble_fraction: float | None
    """megapipe's simulator fed with the measured per-stage F/B times, per-op dispatch and p2p latency."""
    plan_bubble_fraction: float | None
    simulated_step_ms: float | None = None
    """The simulator's step for the measured window (compare with ``pipeline.makespan_ms``)."""
    dispatch_ms: float | None = None
    """The measured per-op dispatch overhead the simulator charged to every op."""
    p2p_latency_ms: float | None = None
    """The per-message latency the simulator charged."""


class ScheduleHook:
    """Created by :func:`attach`; read ``last_report`` / ``reports``, call ``detach()`` to remove."""

    def __init__(
        self,
        *,
        configs: Sequence[Any],
        group: Any,
        gather_every: int,
        capacity: int,
        warn_threshold: float,
        plan_bubble_fraction: float | None,
        schedule: str | None,
        p2p_latency_ms: float,
        on_report: Callable[[HookReport], None] | None,
        clock: HostClock | CudaEventClock,
        gather_device: str,
        keep_reports: int,
    ) -> None:
        config = configs[0]
        self.num_model_chunks = config.virtual_pipeline_model_parallel_size or 1
        self.microbatch_group_size = config.microbatch_group_size_per_vp_stage or config.pipeline_model_parallel_size
        self.enabled = True
        self.last_report: HookReport | None = None
        self.reports: deque[HookReport] = deque(maxlen=keep_reports)
        self._configs = list(configs)
        self._group, self._gather_every, self._clock = group, gather_every, clock
        self._warn_threshold, self._plan, self._schedule, self._on_report = warn_threshold, plan_bubble_fraction, schedule, on_report
        self.p2p_latency_ms = p2p_latency_ms
        """Per-message cost the simulator charges; the monitor sets it from its link check."""
        self._ring = IntervalRing(capacity=capacity, num_slots=_NUM_SLOTS)
        self._recording, self._faulted, self._warned, self._overflow_logged = True, False, False, False
        self._step_start = float("nan")
        self._steps = 0
        self._window: list[StepMetrics] = []
        self._gather_buffers = None
        if group is not None:
            self._gather_buffers = _gather_buffers(group, row_size(self.num_model_chunks), gather_device)
        self._proxies = [TimersProxy(self, cfg.timers) for cfg in self._configs]
        for cfg, proxy in zip(self._configs, self._proxies):
            cfg.timers = proxy

    # ------------------------------------------------------------------ recording
    def _on_start(self, slot: int) -> None:
        if self._recording:
            try:
                self._ring.open(slot, self._clock.now())
            except Exception as exc:  # never into training
                self._fault(exc)

    def _on_stop(self, slot: int, kind: int) -> None:
        if self._recording:
            try:
                self._ring.close(slot, kind, self._clock.now())
            except Exception as exc:
                self._fault(exc)

    def _on_step_start(self) -> None:
        if self._recording:
            try:
                self._clock.reset()
                self._ring.clear()
                self._step_start = self._clock.now()
            except Exception as exc:
                self._fault(exc)

    def _finish_step(self) -> StepMetrics | None:
        end = self._clock.now()
        ring, count = self._ring, self._ring.count
        if ring.overflowed or self._step_start != self._step_start:
            if ring.overflowed and not self._overflow_logged:
                self._overflow_logged = True
                logger.warning("schedule hook: more than capacity=%d timer intervals in one step; "
                               "step skipped, pass a larger capacity to attach()", ring.capacity)
            return None
        times = self._clock.to_ms([self._step_start, end, *ring.starts[:count], *ring.ends[:count]])
        starts, ends = times[2 : 2 + count], times[2 + count :]
        order = sorted(range(count), key=starts.__getitem__)  # stable: ties keep recording order
        self._step_start = float("nan")
        kinds = ring.kinds
        return derive_step(
            step_start=times[0],
            step_end=times[1],
            starts=[starts[i] for i in order],
            ends=[ends[i] for i in order],
            kinds=[kinds[i] for i in order],
            num_model_chunks=self.num_model_chunks,
            microbatch_group_size=self.microbatch_group_size,
        )

    # ------------------------------------------------------------ step end, gather
    def _on_step_end(self) -> None:
        if not self.enabled:
            return
        if self._recording:
            try:
                local = self._finish_step()
                if local is not None:
                    self._window.append(local)
            except Exception as exc:
                self._fault(exc)
        self._steps += 1
        if self._steps % self._gather_every == 0:
            self._close_window()

    def _close_window(self) -> None:
        local = mean_steps(self._window) if self._window and not self._faulted else None
        self._window.clear()
        if self._faulted:
            row = [_FAULTED] * row_size(self.num_model_chunks)
        elif local is None:
            row = [_SKIPPED] * row_size(self.num_model_chunks)
        else:
            row = pack_row(local, self.num_model_chunks)
        try:
            rows = self._exchange(row)
        except Exception:
            logger.exception("schedule hook: the pipeline-group all_gather failed; hook disabled")
            self._disable()
            return
        if any(r[0] == _FAULTED for r in rows):
            logger.warning("schedule hook: disabled on this rank because a pipeline rank's hook faulted")
            self._disable()
            return
        if local is None or any(r[0] != _VALID for r in rows):
            return
        try:
            self._publish(local, [unpack_row(r, self.num_model_chunks) for r in rows])
        except Exception as exc:
            self._fault(exc)

    def _exchange(self, row: list[float]) -> list[list[float]]:
        if self._gather_buffers is None:
            return [row]
        import torch
        import torch.distributed as dist

        send, recv = self._gather_buffers
        send.copy_(torch.tensor(row, dtype=send.dtype))
        dist.all_gather(recv, send, group=self._group)
        return [t.tolist() for t in recv]

    def _publish(self, local: StepMetrics, ranks: list[StepMetrics]) -> None:
        pipeline = measured = prediction = None
        if self._gather_buffers is not None:
            pipeline = combine_rows(ranks, num_model_chunks=self.num_model_chunks)
            measured = pipeline.bubble_fraction
            prediction = predict_bubble(
                pipeline, schedule=self._schedule, microbatch_group_size_per_vp_stage=self.microbatch_group_size,
                p2p_latency_ms=self.p2p_latency_ms,
            )
        report = HookReport(
            step=self._steps, rank=local, pipeline=pipeline, measured_bubble_fraction=measured,
            simulated_bubble_fraction=prediction and prediction.bubble_fraction,
            plan_bubble_fraction=self._plan,
            simulated_step_ms=prediction and prediction.step_time_ms,
            dispatch_ms=prediction and prediction.dispatch_ms,
            p2p_latency_ms=prediction and prediction.p2p_latency_ms,
        )
        self.last_report = report
        self.reports.append(report)
        self._check(report)
        if self._on_report is not None:
            self._on_report(report)

    def _check(self, report: HookReport) -> None:
        measured = report.measured_bubble_fraction
        if self._warned or measured is None:
            return
        for label, other in (("simulated", report.simulated_bubble_fraction), ("plan", report.plan_bubble_fraction)):
            if other is not None and abs(measured - other) > self._warn_threshold:
                self._warned = True
                logger.warning(
                    "schedule hook: measured bubble fraction %.3f differs from the %s %.3f by more than "
                    "warn_threshold=%.3f (stage forward ms %s, backward ms %s)",
                    measured, label, other, self._warn_threshold,
                    [round(x, 2) for x in report.pipeline.stage_forward_ms],
                    [round(x, 2) for x in report.pipeline.stage_backward_ms],
                )
                return

    # --------------------------------------------------------------- fault, detach
    def _fault(self, exc: BaseException) -> None:
        if not self._faulted:
            logger.error("schedule hook: internal error, hook disabled; training continues", exc_info=exc)
        self._faulted, self._recording = True, False
        if self._gather_buffers is None:
            self._disable()

    def _disable(self) -> None:
        self.enabled, self._recording = False, False
        for cfg, proxy in zip(self._configs, self._proxies):
            if cfg.timers is proxy:
                cfg.timers = proxy.wrapped

    def detach(self) -> None:
        """Restore every config's original timers (call between steps, on every rank)."""
        self._disable()


def _gather_buffers(group: Any, size: int, device: str):
    import torch
    import torch.distributed as dist

    send = torch.zeros(size, dtype=torch.float64, device=device)
    recv = [torch.zeros_like(send) for _ in range(dist.get_world_size(group))]
    return send, recv


def _config_of(item: Any) -> Any:
    if hasattr(item, "pipeline_model_parallel_size") and hasattr(item, "timers"):
        return item
    from megatron.core.utils import get_model_config

    return get_model_config(item)


def _pipeline_group(config: Any, group: Any) -> Any:
    import torch.distributed as dist

    if group == "auto":
        group = None
        if config.pipeline_model_parallel_size > 1 and dist.is_available() and dist.is_initialized():
            from megatron.core import parallel_state

            group = parallel_state.get_pipeline_model_parallel_group()
    if group is not None and dist.get_world_size(group) != config.pipeline_model_parallel_size:
        raise ConfigError(
            f"pipeline group has {dist.get_world_size(group)} ranks but "
            f"{config.pipeline_model_parallel_size=}; pass the pipeline-parallel group as pipeline_group"
        )
    return group if config.pipeline_model_parallel_size > 1 else None


def _plan_bubble(plan: Any) -> float | None:
    value = getattr(plan, "bubble_fraction", plan)
    if value is None:
        return None
    if not (isinstance(value, (int, float)) and 0.0 <= value < 1.0):
        raise ConfigError(f"plan bubble fraction {value!r} must be a number in [0, 1); pass a plan record or a fraction")
    return float(value)


def _make_clock(timing: str, capacity: int) -> HostClock | CudaEventClock:
    if timing == "auto":
        import torch

        timing = "cuda_events" if torch.cuda.is_available() and torch.cuda.is_initialized() else "host"
    if timing == "host":
        return HostClock()
    if timing == "cuda_events":
        return CudaEventClock(num_marks=2 * capacity + 2)
    raise ConfigError(f"{timing=} is not a clock; use auto, host or cuda_events")


def attach(
    models: Any,
    *,
    pipeline_group: Any = "auto",
    gather_every: int = 10,
    capacity: int = 8192,
    warn_threshold: float = 0.05,
    plan: Any = None,
    schedule: str | None = None,
    p2p_latency_ms: float = 0.0,
    on_report: Callable[[HookReport], None] | None = None,
    timing: str = "auto",
    keep_reports: int = 64,
) -> ScheduleHook:
    """Wrap ``config.timers`` of every model chunk (modules or TransformerConfigs).

    Call on every rank of the pipeline group, before the first step.
    ``pipeline_group``: "auto" uses megatron-core's ``parallel_state`` pipeline
    group. ``gather_every``: steps per all-gather (reports are means over them).
    ``capacity``: timer intervals one step may hold. ``warn_threshold``: absolute
    bubble-fraction difference (measured vs simulated or plan) that logs one
    warning. ``plan``: the plan's predicted bubble fraction, or a megapipe plan
    record (anything with ``bubble_fraction``). ``schedule``: a megapipe schedule name for the simulator (default:
    what megatron-core runs, 1f1b or interleaved_1f1b). ``p2p_latency_ms``: one
    p2p message's cost for the simulator (e.g. the link latency plus
    activation bytes / bandwidth; settable later as ``hook.p2p_latency_ms``). The
    simulator also charges every op the dispatch overhead the hook measures
    (:mod:`megapipe.monitor.predict`). ``timing``: auto, host (perf_counter) or
    cuda_events.
    """
    items = models if isinstance(models, (list, tuple)) else [models]
    configs: list[Any] = []
    for item in items:
        config = _config_of(item)
        if all(config is not seen for seen in configs):
            configs.append(config)
    if not configs:
        raise ConfigError("attach() got no model chunks; pass the list of model chunks or their configs")
    if not (isinstance(gather_every, int) and gather_every >= 1):
        raise ConfigError(f"{gather_every=} must be an int >= 1 (steps per all-gather)")
    if not (isinstance(p2p_latency_ms, (int, float)) and p2p_latency_ms >= 0):
        raise ConfigError(f"{p2p_latency_ms=} must be a number >= 0 (ms per p2p message)")
    if not (isinstance(capacity, int) and capacity >= 16):
        raise ConfigError(f"{capacity=} must be an int >= 16 (timer intervals per step)")
    group = _pipeline_group(configs[0], pipeline_group)
    gather_device = "cpu"
    if group is not None:
        import torch
        import torch.distributed as dist

        if dist.get_backend(group) == "nccl":
            gather_device = f"cuda:{torch.cuda.current_device()}"
    return ScheduleHook(
        configs=configs, group=group, gather_every=gather_every, capacity=capacity,
        warn_threshold=warn_threshold, plan_bubble_fraction=_plan_bubble(plan), schedule=schedule,
        p2p_latency_ms=float(p2p_latency_ms),
        on_report=on_report, clock=_make_clock(timing, capacity), gather_device=gather_device,
        keep_reports=keep_reports,
    )
