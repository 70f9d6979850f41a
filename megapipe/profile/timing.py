"""Timing and weighing one pipeline unit: forward, backward, input-only backward, saved bytes.

Used by :mod:`megapipe.profile.measure`; torch is imported inside functions.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from megapipe.records import LayerKind

__all__ = ["Unit", "UnitResult", "clock_name", "measure_unit", "spread"]


@dataclass(slots=True)
class Unit:
    """One pipeline unit as a closure over the built model: fresh inputs -> output to backpropagate."""

    name: str
    kind: LayerKind
    forward: Callable[[], object]
    modules: tuple
    has_input_grad: bool


@dataclass(frozen=True, slots=True)
class UnitResult:
    fwd_ms: tuple[float, ...]
    bwd_ms: tuple[float, ...]
    bwd_input_ms: tuple[float, ...]
    act_bytes: float
    param_count: float
    cuda_peak_bytes: float | None


def clock_name(device: str) -> str:
    """Which clock measure_unit uses: CUDA events, the thread's CPU time, or wall time.

    With one torch thread, every CPU kernel (forward and autograd's CPU backward) runs on
    the calling thread, so its CPU time is the device's busy time, like CUDA events, and
    stays right when other processes share the cores; with more threads, wall time.
    """
    import torch

    if device == "cuda":
        return "cuda events"
    return "thread_time" if torch.get_num_threads() == 1 else "perf_counter"


class _Clock:
    def __init__(self, device: str) -> None:
        import torch

        self._cuda = device == "cuda"
        self._torch = torch
        self._now = time.thread_time if clock_name(device) == "thread_time" else time.perf_counter

    def time_ms(self, thunk: Callable[[], object]) -> tuple[float, object]:
        if self._cuda:
            start = self._torch.cuda.Event(enable_timing=True)
            end = self._torch.cuda.Event(enable_timing=True)
            start.record()
            value = thunk()
            end.record()
            end.synchronize()
            return start.elapsed_time(end), value
        begin = self._now()
        value = thunk()
        return (self._now() - begin) * 1e3, value


def _params(unit: Unit) -> list:
    seen, params = set(), []
    for module in unit.modules:
        for param in module.parameters():
            if id(param) not in seen:
                seen.add(id(param))
                params.append(param)
    return params


def measure_unit(unit: Unit, *, device: str, warmup: int, iters: int) -> UnitResult:
    """Median-ready timings of warmup + iters passes, then bytes and parameter count."""
    clock = _Clock(device)
    params = _params(unit)
    fwd, bwd = _time_passes(unit, clock, params, warmup=warmup, iters=iters)
    bwd_input: tuple[float, ...] = ()
    if unit.has_input_grad:
        flags = [param.requires_grad for param in params]
        for param in params:
            param.requires_grad_(False)
        try:
            _, bwd_input = _time_passes(unit, clock, params, warmup=warmup, iters=iters)
        finally:
            for param, flag in zip(params, flags):
                param.requires_grad_(flag)
    act_bytes = _saved_tensor_bytes(unit, params)
    cuda_peak = _cuda_peak_bytes(unit, params) if device == "cuda" else None
    param_count = float(sum(param.numel() for param in params))
    return UnitResult(fwd, bwd, bwd_input, act_bytes, param_count, cuda_peak)


def _time_passes(unit: Unit, clock: _Clock, params: list, *, warmup: int, iters: int):
    import torch

    fwd, bwd = [], []
    for index in range(warmup + iters):
        fwd_ms, output = clock.time_ms(unit.forward)
        grad = torch.ones_like(output) if output.dim() == 0 else torch.randn_like(output)
        bwd_ms, _ = clock.time_ms(lambda out=output, g=grad: torch.autograd.backward(out, g))
        for param in params:
            param.grad = None
        del output, grad
        if index >= warmup:
            fwd.append(fwd_ms)
            bwd.append(bwd_ms)
    return tuple(fwd), tuple(bwd)


def _saved_tensor_bytes(unit: Unit, params: list) -> float:
    """Bytes of distinct storages autograd keeps for backward, parameters excluded.

    A saved view keeps its whole storage alive, so storages (not views) are counted.
    This is what one in-flight microbatch holds between its forward and backward.
    """
    import torch

    param_storages = {param.untyped_storage().data_ptr() for param in params}
    storages: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in param_storages:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        output = unit.forward()
    del output
    return float(sum(storages.values()))


def _cuda_peak_bytes(unit: Unit, params: list) -> float:
    """Peak allocator growth over one forward + backward (torch.cuda.max_memory_allocated delta)."""
    import torch

    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    output = unit.forward()
    torch.autograd.backward(output, torch.ones_like(output) if output.dim() == 0 else torch.randn_like(output))
    torch.cuda.synchronize()
    for param in params:
        param.grad = None
    return float(torch.cuda.max_memory_allocated() - before)


def spread(values: tuple[float, ...]) -> str:
    """p10 and p90 of the timed iterations, ms."""
    ordered = sorted(values)
    if not ordered:
        return ""
    low = ordered[int(0.1 * (len(ordered) - 1))]
    high = ordered[round(0.9 * (len(ordered) - 1))]
    return f"{low:.4g},{high:.4g}"
