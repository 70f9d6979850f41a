"""How far a predicted step time may be off: the leave-one-source-out errors of plans of its kind.

``megapipe validate`` refits the runtime without every run of one source and predicts those runs; the spread of
those errors, by kind (dense or MoE), GPU generation and precision, is what a plan of that kind can expect on a
cluster and software the fit has not seen. It records, per kind, the central 80% of ``measured / predicted - 1``
(:func:`intervals_from_errors`) in the runtime file; a plan reads the most specific kind that has enough runs
(:func:`step_interval`). Pure.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from megapipe.records import RuntimeSpec

__all__ = ["interval_key", "step_interval", "throughput_interval", "intervals_from_errors", "format_interval",
           "format_share", "MIN_RUNS"]

MIN_RUNS = 5
"""Errors a kind needs before it gets an interval of its own (else the next coarser kind's)."""
_COVERAGE = (0.1, 0.9)


def interval_key(*, moe: bool, architecture: str, precision: str) -> tuple[str, str, str]:
    return ("moe" if moe else "dense", architecture or "*", precision)


def _candidates(key: tuple[str, str, str]) -> list[str]:
    kind, architecture, precision = key
    return [f"{kind}/{architecture}/{precision}", f"{kind}/{architecture}/*", f"{kind}/*/{precision}", f"{kind}/*/*"]


def step_interval(runtime: RuntimeSpec, *, moe: bool, architecture: str, precision: str) -> tuple[float, float] | None:
    """(low, high): the measured step over the predicted one lies in ``[1 + low, 1 + high]`` for 80% of the held-out
    published runs of the most specific matching kind; None when the runtime carries no intervals."""
    if architecture == "cpu":  # the test cluster: no published run speaks for it
        return None
    table = {key: (low, high) for key, low, high in runtime.step_time_intervals}
    for candidate in _candidates(interval_key(moe=moe, architecture=architecture, precision=precision)):
        if candidate in table:
            return table[candidate]
    return None


def _quantile(values: Sequence[float], share: float) -> float:
    ordered = sorted(values)
    position = share * (len(ordered) - 1)
    below = int(position)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (ordered[above] - ordered[below]) * (position - below)


def intervals_from_errors(errors: Iterable[tuple[tuple[str, str, str], float]]) -> tuple[tuple[str, float, float], ...]:
    """Per kind, the central 80% of ``measured / predicted - 1`` over its runs (``errors`` gives each run's kind
    and its held-out ``predicted / measured - 1``), for every kind with :data:`MIN_RUNS` or more runs, and always
    for the coarsest (dense or MoE alone)."""
    groups: dict[str, list[float]] = {}
    for key, error in errors:
        ratio = 1.0 / (1.0 + error) - 1.0
        kind, architecture, precision = key
        for candidate in {f"{kind}/{architecture}/{precision}", f"{kind}/{architecture}/*", f"{kind}/*/{precision}",
                          f"{kind}/*/*"}:
            groups.setdefault(candidate, []).append(ratio)
    out = []
    for name, values in sorted(groups.items()):
        if len(values) >= MIN_RUNS or name.endswith("/*/*"):
            low, high = (_quantile(values, share) for share in _COVERAGE)
            out.append((name, float(f"{min(low, 0.0):.4g}"), float(f"{max(high, 0.0):.4g}")))
    return tuple(out)


def throughput_interval(interval: tuple[float, float] | None) -> tuple[float, float] | None:
    """A step interval as one of tokens/s (the rate goes as 1 / step): the measured rate over the predicted
    one lies in ``[1 + low, 1 + high]`` when the step's does in its interval."""
    if interval is None:
        return None
    low, high = interval
    return (float(f"{1.0 / (1.0 + high) - 1.0:.4g}"), float(f"{1.0 / (1.0 + low) - 1.0:.4g}"))


def format_share(interval: tuple[float, float] | None) -> str:
    """`` (-6%/+9%)``, or nothing without an interval."""
    if interval is None:
        return ""
    low, high = interval
    return f" ({low:+.0%}/{high:+.0%})"


def format_interval(step_s: float, interval: tuple[float, float] | None) -> str:
    """``12.3 s (-6%/+9%)``, or the bare time without an interval."""
    return f"{step_s:.3g} s{format_share(interval)}"
