"""Gantt chart of a simulated step: one row per pipeline rank, F/I/B/W in distinct colours.

Gaps between bars are idle time. matplotlib is imported lazily with the Agg
backend; PNG metadata is pinned so the same result gives the same bytes.
"""

from __future__ import annotations

from megapipe.schedules import Kind
from megapipe.report.plots import save_png
from megapipe.simulate import SimResult

__all__ = ["KIND_COLOURS", "gantt_png"]

KIND_COLOURS = {Kind.F: "#4C72B0", Kind.B: "#DD8452", Kind.I: "#C44E52", Kind.W: "#55A868"}
_LABELS = {Kind.F: "F forward", Kind.B: "B full backward", Kind.I: "I input grad", Kind.W: "W weight grad"}


def gantt_png(result: SimResult, path: str, *, title: str | None = None, label_ops: bool | None = None) -> str:
    """Write the Gantt chart of ``result`` to ``path`` (PNG) and return the path."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    schedule = result.schedule
    ranks = len(schedule.orders)
    width = 12.0
    figure, axes = plt.subplots(figsize=(width, 1.4 + 0.45 * ranks), dpi=100)
    label_ops = schedule.num_ops <= 400 if label_ops is None else label_ops
    for rank, (order, starts, ends) in enumerate(zip(schedule.orders, result.start_ms, result.end_ms)):
        for kind in KIND_COLOURS:
            bars = [(s, e - s) for a, s, e in zip(order, starts, ends) if a.kind is kind]
            if bars:
                axes.broken_barh(bars, (rank - 0.4, 0.8), facecolors=KIND_COLOURS[kind], edgecolors="white",
                                 linewidth=0.3)
        if label_ops:
            for action, start, end in zip(order, starts, ends):
                axes.text((start + end) / 2, rank, f"{action.microbatch}", ha="center", va="center",
                          fontsize=6, color="white")
    axes.set_ylim(ranks - 0.5, -0.5)
    axes.set_yticks(range(ranks), [f"rank {r}" for r in range(ranks)])
    axes.set_xlim(0, max(result.step_time_ms, 1e-9))
    axes.set_xlabel("time (ms)")
    axes.set_title(_fitted(title or (
        f"{schedule.name}: P={schedule.pipeline_model_parallel_size}, m={schedule.num_microbatches}, "
        f"step {result.step_time_ms:,.1f} ms, bubble {100 * result.bubble_fraction:.1f}%"
    ), width), fontsize=10)
    used = {a.kind for order in schedule.orders for a in order}
    handles = [plt.Rectangle((0, 0), 1, 1, color=KIND_COLOURS[k]) for k in KIND_COLOURS if k in used]
    axes.legend(handles, [_LABELS[k] for k in KIND_COLOURS if k in used], loc="upper center", fontsize=7,
                bbox_to_anchor=(0.5, -0.12 - 0.5 / ranks), ncol=len(handles), frameon=False)
    figure.tight_layout()
    return save_png(figure, path)


def _fitted(title: str, width_inches: float) -> str:
    """``title`` cut to what the figure's width holds at the title's font size (a long layout would overflow)."""
    limit = max(20, int(width_inches * 14))
    return title if len(title) <= limit else title[:limit - 1] + "…"
