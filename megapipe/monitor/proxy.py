"""The stand-in for ``config.timers`` that the schedule hook installs.

megatron-core calls ``config.timers(name, log_level=...)`` and then ``.start()`` /
``.stop()`` on what it returns. :class:`TimersProxy` forwards every call, with
its exact arguments, to the wrapped object (Megatron-LM's ``Timers`` or None) and
hands back a reusable per-name proxy that, after delegating, tells the hook
(``_on_start`` / ``_on_stop`` / ``_on_step_start`` / ``_on_step_end``). Names
outside :data:`~megapipe.monitor.metrics.TIMER_KINDS` and ``forward-backward``
get the wrapped timer itself. Clocks are read after delegating, so a wrapped
timer that synchronizes the device (megatron's ``Timer``) is measured at the
same instant.
"""

from __future__ import annotations

from typing import Any

from megapipe.monitor.metrics import TIMER_KINDS

__all__ = ["STEP_TIMER", "TimersProxy"]

STEP_TIMER = "forward-backward"
_SLOTS = {name: slot for slot, name in enumerate(TIMER_KINDS)}


class _NullTimer:
    def start(self, *args: Any, **kwargs: Any) -> None:
        pass

    def stop(self, *args: Any, **kwargs: Any) -> None:
        pass


_NULL_TIMER = _NullTimer()


class _TimerProxy:
    """Delegates to the wrapped timer, then records a mark; one instance per name, reused."""

    __slots__ = ("_hook", "_slot", "_kind", "inner")

    def __init__(self, hook: Any, slot: int, kind: int) -> None:
        self._hook, self._slot, self._kind, self.inner = hook, slot, kind, None

    def start(self, *args: Any, **kwargs: Any) -> None:
        if self.inner is not None:
            self.inner.start(*args, **kwargs)
        self._hook._on_start(self._slot)

    def stop(self, *args: Any, **kwargs: Any) -> None:
        if self.inner is not None:
            self.inner.stop(*args, **kwargs)
        self._hook._on_stop(self._slot, self._kind)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class _StepTimerProxy(_TimerProxy):
    __slots__ = ()

    def start(self, *args: Any, **kwargs: Any) -> None:
        if self.inner is not None:
            self.inner.start(*args, **kwargs)
        self._hook._on_step_start()

    def stop(self, *args: Any, **kwargs: Any) -> None:
        if self.inner is not None:
            self.inner.stop(*args, **kwargs)
        self._hook._on_step_end()


class TimersProxy:
    """Stands in for ``config.timers``; ``wrapped`` is the original (possibly None)."""

    def __init__(self, hook: Any, wrapped: Any) -> None:
        self._hook = hook
        self.wrapped = wrapped
        self._proxies: dict[str, _TimerProxy] = {
            name: _TimerProxy(hook, _SLOTS[name], int(kind)) for name, kind in TIMER_KINDS.items()
        }
        self._proxies[STEP_TIMER] = _StepTimerProxy(hook, -1, -1)

    def __call__(self, name: str, *args: Any, **kwargs: Any) -> Any:
        inner = self.wrapped(name, *args, **kwargs) if self.wrapped is not None else None
        proxy = self._proxies.get(name)
        if proxy is None or not self._hook.enabled:
            return inner if inner is not None else _NULL_TIMER
        proxy.inner = inner
        return proxy

    def __getattr__(self, name: str) -> Any:
        if self.wrapped is None:
            raise AttributeError(name)
        return getattr(self.wrapped, name)
