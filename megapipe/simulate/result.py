"""Records the simulator takes and returns: StageTimes, P2PCost, RankStats, OpTiming, SimResult."""

from __future__ import annotations

import math
from dataclasses import dataclass

from megapipe.errors import ScheduleError
from megapipe.records import LinkSpec
from megapipe.schedules.base import Action, Schedule

__all__ = ["StageTimes", "P2PCost", "RankStats", "OpTiming", "SimResult"]


def _check_times(name: str, values: tuple[float, ...], length: int) -> None:
    if len(values) != length:
        raise ScheduleError(f"StageTimes.{name} has {len(values)} entries; give one per layout stage ({length})")
    for index, value in enumerate(values):
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
            raise ScheduleError(f"StageTimes.{name}[{index}]={value!r} must be a finite number >= 0")


@dataclass(frozen=True, slots=True, kw_only=True)
class StageTimes:
    """Per layout stage (model order, length P*v): op times in ms and activation bytes."""

    fwd_ms: tuple[float, ...]
    bwd_ms: tuple[float, ...]
    """Whole backward (input + weight gradient), as ``LayerCost.bwd_ms``."""
    wgrad_ms: tuple[float, ...]
    """Weight-gradient part of bwd_ms (the zero-bubble W); the input-gradient op I costs bwd_ms - wgrad_ms."""
    act_bytes: tuple[float, ...] | None = None
    """Activation bytes held per in-flight microbatch of each stage; None means not tracked."""

    def __post_init__(self) -> None:
        length = len(self.fwd_ms)
        _check_times("fwd_ms", self.fwd_ms, length)
        _check_times("bwd_ms", self.bwd_ms, length)
        _check_times("wgrad_ms", self.wgrad_ms, length)
        if self.act_bytes is not None:
            _check_times("act_bytes", self.act_bytes, length)
        for index, (bwd, wgrad) in enumerate(zip(self.bwd_ms, self.wgrad_ms)):
            if wgrad > bwd:
                raise ScheduleError(
                    f"StageTimes.wgrad_ms[{index}]={wgrad} exceeds bwd_ms[{index}]={bwd}; "
                    "bwd_ms is the whole backward and wgrad_ms its weight-gradient part"
                )

    @classmethod
    def split(
        cls, *, fwd_ms, input_grad_ms, wgrad_ms, act_bytes=None
    ) -> StageTimes:
        """From the zero-bubble paper's (F, B, W) per stage, where B is the input-gradient part only."""
        return cls(
            fwd_ms=tuple(fwd_ms),
            bwd_ms=tuple(b + w for b, w in zip(input_grad_ms, wgrad_ms)),
            wgrad_ms=tuple(wgrad_ms),
            act_bytes=None if act_bytes is None else tuple(act_bytes),
        )

    @classmethod
    def uniform(
        cls, num_stages: int, *, fwd_ms: float, input_grad_ms: float, wgrad_ms: float = 0.0,
        act_bytes: float | None = None,
    ) -> StageTimes:
        """Equal stages: the setting of every closed form."""
        return cls.split(
            fwd_ms=(fwd_ms,) * num_stages, input_grad_ms=(input_grad_ms,) * num_stages,
            wgrad_ms=(wgrad_ms,) * num_stages, act_bytes=None if act_bytes is None else (act_bytes,) * num_stages,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class P2PCost:
    """Cost of one activation (or gradient) message between neighbouring ranks."""

    latency_ms: float = 0.0
    bytes_per_microbatch: float = 0.0
    """Bytes sent per microbatch across a stage boundary (e.g. cost.p2p_bytes)."""
    bandwidth_gbytes_per_s: float = math.inf
    boundary_ms: tuple[float, ...] | None = None
    """Optional per rank boundary r -> r+1 (length P-1): message ms overriding the uniform figure."""

    def __post_init__(self) -> None:
        for name in ("latency_ms", "bytes_per_microbatch"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ScheduleError(f"P2PCost.{name}={value!r} must be a finite number >= 0")
        if not self.bandwidth_gbytes_per_s > 0:
            raise ScheduleError(f"P2PCost.bandwidth_gbytes_per_s={self.bandwidth_gbytes_per_s!r} must be > 0")
        for value in self.boundary_ms or ():
            if not (math.isfinite(value) and value >= 0):
                raise ScheduleError(f"P2PCost.boundary_ms holds {value!r}; each must be a finite number >= 0")

    @property
    def message_ms(self) -> float:
        """latency + bytes / bandwidth (10^9 bytes per GB)."""
        return self.latency_ms + self.bytes_per_microbatch / (self.bandwidth_gbytes_per_s * 1e9) * 1e3

    @classmethod
    def from_link(cls, link: LinkSpec, *, p2p_bytes: float, efficiency_scale: float = 1.0) -> P2PCost:
        """A message over ``link`` at the bandwidth NCCL achieves on it (``LinkSpec.bandwidth_efficiency``)."""
        return cls(
            latency_ms=link.latency_us / 1e3, bytes_per_microbatch=p2p_bytes,
            bandwidth_gbytes_per_s=link.bandwidth_gbytes_per_s * link.bandwidth_efficiency * efficiency_scale,
        )

    def between(self, rank_a: int, rank_b: int) -> float:
        if rank_a == rank_b:
            return 0.0
        if self.boundary_ms is not None:
            return self.boundary_ms[min(rank_a, rank_b)]
        return self.message_ms


@dataclass(frozen=True, slots=True, kw_only=True)
class RankStats:
    rank: int
    busy_ms: float
    idle_ms: float
    """step_time_ms - busy_ms (flushed)."""
    bubble_fraction: float
    """idle_ms / step_time_ms."""
    span_ms: float
    """First op's start to last op's end on this rank."""
    peak_in_flight: int
    """Peak microbatch-chunks whose activations this rank holds at once."""
    peak_activation_bytes: float


@dataclass(frozen=True, slots=True)
class OpTiming:
    action: Action
    start_ms: float
    end_ms: float


@dataclass(frozen=True, slots=True, kw_only=True)
class SimResult:
    schedule: Schedule
    step_time_ms: float
    bubble_fraction: float
    steady_bubble_fraction: float
    ranks: tuple[RankStats, ...]
    stage_peak_in_flight: tuple[int, ...]
    """Per layout stage (model order)."""
    critical_steps: tuple[tuple[int, int], ...]
    """(rank, position in its order) of the ops whose chain fixes step_time_ms, first to last."""
    start_ms: tuple[tuple[float, ...], ...]
    """Aligned with schedule.orders."""
    end_ms: tuple[tuple[float, ...], ...]

    @property
    def critical_path(self) -> tuple[Action, ...]:
        """The ops whose chain fixes step_time_ms, first to last (the schedule's actions, built on first use)."""
        orders = self.schedule.orders
        return tuple(orders[rank][index] for rank, index in self.critical_steps)

    def timeline(self) -> tuple[OpTiming, ...]:
        return tuple(
            OpTiming(action, start, end)
            for order, starts, ends in zip(self.schedule.orders, self.start_ms, self.end_ms)
            for action, start, end in zip(order, starts, ends)
        )


