"""Planner pictures: peak memory per pipeline rank (static + activations), and a sweep's
tokens/s/GPU and cost per model x cluster. matplotlib is imported lazily (Agg backend);
PNG metadata is pinned so the same inputs give the same bytes.
"""

from __future__ import annotations

from collections.abc import Sequence

from megapipe.files import atomic_write_bytes
from megapipe.units import GIB

__all__ = ["memory_chart", "sweep_chart", "save_png"]

_META = {"Software": None}


def save_png(figure, path: str) -> str:
    """The figure as PNG with pinned metadata (same inputs, same bytes), written atomically; closes it."""
    import io as _memory

    import matplotlib.pyplot as plt

    buffer = _memory.BytesIO()
    figure.savefig(buffer, format="png", metadata=_META)
    plt.close(figure)
    atomic_write_bytes(path, buffer.getvalue())
    return path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def memory_chart(plan, path: str, *, baseline=None, usable_gib: float | None = None) -> str:
    """Stacked bars per pipeline rank: static (weights, grads, optimizer) and peak activations.

    ``baseline`` (the equal split) is drawn as outlined bars beside the plan's.
    """
    plt = _pyplot()
    ranks = range(len(plan.stages))
    width = 0.4 if baseline is not None else 0.8
    figure, axes = plt.subplots(figsize=(max(6, 0.6 * len(plan.stages) + 3), 4), dpi=100)
    static = [s.static_bytes / GIB for s in plan.stages]
    act = [s.activation_bytes / GIB for s in plan.stages]
    left = [r - width / 2 if baseline is not None else r for r in ranks]
    axes.bar(left, static, width, label="static (plan)", color="#4C72B0")
    axes.bar(left, act, width, bottom=static, label="activations (plan)", color="#DD8452")
    if baseline is not None and len(baseline.stages) == len(plan.stages):
        right = [r + width / 2 for r in ranks]
        totals = [s.total_bytes / GIB for s in baseline.stages]
        axes.bar(right, totals, width, label="equal split total", facecolor="none", edgecolor="#333333", hatch="//")
    if usable_gib is not None:
        axes.axhline(usable_gib, color="#C44E52", linestyle="--", linewidth=1, label="usable memory")
    axes.set_xticks(list(ranks), [f"{r}" for r in ranks])
    axes.set_xlabel("pipeline rank")
    axes.set_ylabel("peak memory per GPU (GiB)")
    axes.set_title(f"memory per stage: {plan.schedule}, CV {plan.memory_cv:.2f}")
    axes.legend(fontsize=8)
    figure.tight_layout()
    return save_png(figure, path)


def sweep_chart(rows: Sequence[dict], path: str) -> str:
    """Two panels, one bar per (model, cluster, seq_length): best tokens/s/GPU and $ per 1M tokens."""
    plt = _pyplot()
    labels = [f"{r['model']}\n{r['cluster']}\n{r['seq_length']}" for r in rows]
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(max(6, 1.1 * len(rows) + 2), 6), dpi=100, sharex=True)
    positions = range(len(rows))
    top.bar(positions, [r["tokens_per_s_per_gpu"] for r in rows], color="#4C72B0")
    top.set_ylabel("tokens/s/GPU")
    bottom.bar(positions, [r["cost_per_million_tokens"] for r in rows], color="#55A868")
    bottom.set_ylabel("$ per 1M tokens")
    bottom.set_xticks(list(positions), labels, fontsize=7)
    top.set_title("megapipe sweep: best plan per model x cluster")
    figure.tight_layout()
    return save_png(figure, path)
