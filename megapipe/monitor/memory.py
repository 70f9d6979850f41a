"""Peak memory of one rank, and the spread of peaks across pipeline stages.

Sampling (:func:`sample_memory`) reads ``torch.cuda.max_memory_allocated`` /
``max_memory_reserved`` and the device's capacity on GPU; on CPU the process's
peak resident set (``VmHWM`` in ``/proc/self/status``, else ``ru_maxrss`` from
``resource``). Torch is imported lazily. :func:`spread` is pure.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["MemorySample", "MemorySpread", "sample_memory", "spread", "peak_rss_bytes"]


@dataclass(frozen=True, slots=True, kw_only=True)
class MemorySample:
    """One rank's memory since the last reset (bytes; NaN where the device has no such figure)."""

    device: str
    """``cuda`` or ``cpu``."""
    peak_allocated_bytes: float
    """``torch.cuda.max_memory_allocated``; on CPU the peak RSS."""
    peak_reserved_bytes: float
    """``torch.cuda.max_memory_reserved`` (allocator cache included); NaN on CPU."""
    rss_bytes: float
    """Peak resident set of the process (host memory)."""
    capacity_bytes: float
    """Total device memory (``torch.cuda.get_device_properties(..).total_memory``); NaN on CPU."""

    @property
    def peak_bytes(self) -> float:
        """The figure compared across stages: allocated peak on GPU, RSS on CPU."""
        return self.peak_allocated_bytes

    @property
    def headroom_bytes(self) -> float:
        """Capacity minus the reserved peak (what the allocator could still take); NaN on CPU."""
        return self.capacity_bytes - self.peak_reserved_bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class MemorySpread:
    """Peak memory across stages, NaN entries (a rank that reported no figure) left out."""

    max_bytes: float
    min_bytes: float
    mean_bytes: float
    spread: float
    """(max - min) / mean, the planner's ``memory_spread``."""
    cv: float
    """Population standard deviation / mean, the planner's ``memory_cv``."""
    count: int
    """How many stages had a finite figure."""


def peak_rss_bytes() -> float:
    """Peak resident set of this process: ``VmHWM`` (Linux), else ``ru_maxrss`` (KiB on Linux)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return float(line.split()[1]) * 1024.0
    except OSError:
        pass
    import resource
    import sys

    rss = float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    return rss if sys.platform == "darwin" else rss * 1024.0


def sample_memory(*, reset_peak: bool = False) -> MemorySample:
    """This rank's peaks; ``reset_peak`` restarts the CUDA peak counters afterwards."""
    rss = peak_rss_bytes()
    try:
        import torch
    except ImportError:  # pragma: no cover - the monitor runs inside torch training
        torch = None
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        device = torch.cuda.current_device()
        sample = MemorySample(
            device="cuda",
            peak_allocated_bytes=float(torch.cuda.max_memory_allocated(device)),
            peak_reserved_bytes=float(torch.cuda.max_memory_reserved(device)),
            rss_bytes=rss,
            capacity_bytes=float(torch.cuda.get_device_properties(device).total_memory),
        )
        if reset_peak:
            torch.cuda.reset_peak_memory_stats(device)
        return sample
    nan = float("nan")
    return MemorySample(device="cpu", peak_allocated_bytes=rss, peak_reserved_bytes=nan, rss_bytes=rss,
                        capacity_bytes=nan)


def spread(values: Sequence[float]) -> MemorySpread | None:
    """Spread and CV of per-stage peaks; None when no stage has a finite positive figure."""
    finite = [float(v) for v in values if isinstance(v, (int, float)) and math.isfinite(v) and v > 0]
    if not finite:
        return None
    mean = sum(finite) / len(finite)
    std = math.sqrt(sum((v - mean) ** 2 for v in finite) / len(finite))
    return MemorySpread(max_bytes=max(finite), min_bytes=min(finite), mean_bytes=mean,
                        spread=(max(finite) - min(finite)) / mean, cv=std / mean, count=len(finite))
