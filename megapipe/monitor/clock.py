"""Clocks and the preallocated interval ring of the schedule hook.

Two clocks, chosen once when the hook is attached:

* :class:`HostClock` reads ``time.perf_counter``. It is exact on CPU, and on GPU
  whenever the wrapped Megatron timer synchronizes (megatron's ``Timer.start`` /
  ``Timer.stop`` call ``torch.cuda.synchronize()``; the hook reads its clock right
  after delegating, so it sees the same synchronized instant).
* :class:`CudaEventClock` records a preallocated ``torch.cuda.Event`` per mark and
  resolves them once per step (one ``Event.synchronize`` on the last mark), so
  the hook adds no host-device synchronization inside the step when Megatron's
  own timers are dummies (``--timing-log-level`` below 2).

Neither allocates per microbatch: marks and intervals go into arrays sized at
attach time.
"""

from __future__ import annotations

import time

__all__ = ["HostClock", "CudaEventClock", "IntervalRing"]

_NAN = float("nan")


class HostClock:
    """``perf_counter`` marks; ``to_ms`` scales seconds to milliseconds."""

    def reset(self) -> None:
        pass

    def now(self) -> float:
        return time.perf_counter()

    def to_ms(self, marks: list[float]) -> list[float]:
        return [mark * 1e3 for mark in marks]


class CudaEventClock:
    """Marks are indices of CUDA events recorded on the current stream."""

    def __init__(self, *, num_marks: int) -> None:
        import torch

        self._events = [torch.cuda.Event(enable_timing=True) for _ in range(num_marks)]
        self._next = 0

    def reset(self) -> None:
        self._next = 0

    def now(self) -> float:
        index = self._next
        if index >= len(self._events):
            return -1.0
        self._events[index].record()
        self._next = index + 1
        return float(index)

    def to_ms(self, marks: list[float]) -> list[float]:
        """Milliseconds since the step's first mark; waits for the last recorded event."""
        if self._next == 0:
            return [float(m) for m in marks]
        self._events[self._next - 1].synchronize()
        first = self._events[0]
        return [first.elapsed_time(self._events[int(m)]) if m >= 0 else _NAN for m in marks]


class IntervalRing:
    """Closed intervals (start mark, end mark, kind) of one step, in lists sized at attach time.

    Plain lists, not numpy arrays: a list item store is several times cheaper
    than a numpy scalar store, and the hook writes two per timer call.
    """

    def __init__(self, *, capacity: int, num_slots: int) -> None:
        self.capacity = capacity
        self.starts = [0.0] * capacity
        self.ends = [0.0] * capacity
        self.kinds = [0] * capacity
        self._closed = [_NAN] * num_slots
        self.open_marks = list(self._closed)
        self.count = 0
        self.overflowed = False

    def clear(self) -> None:
        self.count = 0
        self.overflowed = False
        self.open_marks[:] = self._closed

    def open(self, slot: int, mark: float) -> None:
        self.open_marks[slot] = mark

    def close(self, slot: int, kind: int, mark: float) -> None:
        marks = self.open_marks
        start = marks[slot]
        if start != start:  # a stop without a start (hook attached mid-step): nothing to record
            return
        marks[slot] = _NAN
        index = self.count
        if index >= self.capacity:
            self.overflowed = True
            return
        self.starts[index] = start
        self.ends[index] = mark
        self.kinds[index] = kind
        self.count = index + 1
