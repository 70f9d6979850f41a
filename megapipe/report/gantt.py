"""Gantt chart of a simulated step: one row per pipeline rank, F/I/B/W in distinct colours, and each model
chunk a rank holds (interleaved 1F1B, the V schedules) in its own shade of them, light to dark.

Gaps between bars are idle time. Every op is one polygon of a single collection (thousands of ops draw in
tens of milliseconds), at least a pixel wide so no op vanishes; white op borders only where ops are wide
enough to show them (on narrow ops they wash the colours out). The rows keep a readable height up to 64
ranks and the legend sits under the time axis, outside the data.
"""

from __future__ import annotations

from megapipe.report.canvas import fitted, new_figure, pinned_style, place_axes, save_png
from megapipe.schedules import Kind
from megapipe.simulate import SimResult

__all__ = ["KIND_COLOURS", "chunk_shade", "gantt_figure", "gantt_png"]

KIND_COLOURS = {Kind.F: "#4C72B0", Kind.B: "#DD8452", Kind.I: "#C44E52", Kind.W: "#55A868"}
_LABELS = {Kind.F: "F forward", Kind.B: "B full backward", Kind.I: "I input grad", Kind.W: "W weight grad"}
_WIDTH_IN, _LEFT_IN, _RIGHT_IN = 12.0, 0.85, 0.3
_AXIS_IN, _LEGEND_ROW_IN = 0.55, 0.3
"""Below the axes: tick labels and the axis label, then one row per legend."""
_LIGHTEST, _DARKEST = 0.45, 0.35
"""Chunk 0 is its kind's colour mixed this much with white, the last chunk this much with black."""
_BORDER_PX = 6.0
"""Ops narrower than this (the median) get no white border."""
_MAX_LABELS = 800


def chunk_shade(colour: str, chunk: int, chunks: int) -> tuple[float, float, float]:
    """``colour`` (hex) for model chunk ``chunk`` of ``chunks``: itself for one chunk, else light to dark."""
    rgb = tuple(int(colour[i:i + 2], 16) / 255 for i in (1, 3, 5))
    if chunks == 1:
        return rgb
    position = -_LIGHTEST + (_LIGHTEST + _DARKEST) * chunk / (chunks - 1)
    if position < 0:
        return tuple(c + (1 - c) * -position for c in rgb)
    return tuple(c * (1 - position) for c in rgb)


def gantt_png(result: SimResult, path: str, *, title: str | None = None, label_ops: bool | None = None) -> str:
    """Write the Gantt chart of ``result`` to ``path`` (PNG) and return the path."""
    with pinned_style():
        figure = gantt_figure(result, title=title, label_ops=label_ops)
    return save_png(figure, path)


def gantt_figure(result: SimResult, *, title: str | None = None, label_ops: bool | None = None):
    """The chart as a matplotlib Figure. ``label_ops``: print each op's microbatch on it (None: where ops are
    few and wide enough to hold the number)."""
    schedule = result.schedule
    ranks = len(schedule.orders)
    chunks = 1 + max((action.chunk for order in schedule.orders for action in order), default=0)
    row_in = min(0.45, max(0.2, 0.45 * (8 / ranks) ** 0.5))
    figure = new_figure(_WIDTH_IN, 1.0)
    title = fitted(figure, title or (
        f"{schedule.name}: P={schedule.pipeline_model_parallel_size}, m={schedule.num_microbatches}, "
        f"step {result.step_time_ms:,.1f} ms, bubble {100 * result.bubble_fraction:.1f}%"
    ), width_in=_WIDTH_IN - 0.4, fontsize=11, max_lines=2)
    top_in = 0.2 + 0.2 * (title.count("\n") + 1)
    legend_rows = 1 + (chunks > 1)
    bottom_in = _AXIS_IN + _LEGEND_ROW_IN * legend_rows + 0.1
    height_in = top_in + row_in * ranks + bottom_in
    figure.set_size_inches(_WIDTH_IN, height_in)
    axes = place_axes(figure, left_in=_LEFT_IN, bottom_in=bottom_in, width_in=_WIDTH_IN - _LEFT_IN - _RIGHT_IN,
                      height_in=row_in * ranks)
    figure.text(0.5, 1 - 0.12 / height_in, title, ha="center", va="top", fontsize=11, linespacing=1.1)
    span_ms = max(result.step_time_ms, 1e-9)
    px_per_ms = (_WIDTH_IN - _LEFT_IN - _RIGHT_IN) * figure.dpi / span_ms
    _draw_ops(axes, result, chunks=chunks, px_per_ms=px_per_ms, row_px=row_in * figure.dpi, label_ops=label_ops)
    axes.set_xlim(0, span_ms)
    axes.set_ylim(ranks - 0.5, -0.5)
    axes.set_yticks(range(ranks), [f"rank {r}" for r in range(ranks)], fontsize=9 if ranks <= 16 else 8)
    axes.tick_params(axis="y", length=0)
    axes.xaxis.set_major_formatter("{x:,.0f}")
    axes.set_xlabel("time (ms)", fontsize=10)
    _legends(figure, schedule, chunks=chunks, top_in=bottom_in - _AXIS_IN)
    return figure


def _draw_ops(axes, result: SimResult, *, chunks: int, px_per_ms: float, row_px: float,
              label_ops: bool | None) -> None:
    """Every op as one polygon of a single collection, in its kind's shade for its chunk."""
    import numpy as np
    from matplotlib.collections import PolyCollection

    shades = {(kind, chunk): chunk_shade(colour, chunk, chunks) for kind, colour in KIND_COLOURS.items()
              for chunk in range(chunks)}
    rows, starts, ends, colours, ops = [], [], [], [], []
    for rank, (order, rank_starts, rank_ends) in enumerate(zip(result.schedule.orders, result.start_ms,
                                                               result.end_ms)):
        for action, start, end in zip(order, rank_starts, rank_ends):
            rows.append(rank)
            starts.append(start)
            ends.append(end)
            colours.append(shades[action.kind, action.chunk])
            ops.append(action)
    if not ops:
        return
    row, start = np.asarray(rows, dtype=float), np.asarray(starts)
    end = np.maximum(np.asarray(ends), start + 1 / px_per_ms)  # a pixel at least: no op vanishes
    width_px = (end - start) * px_per_ms
    verts = np.stack([np.stack([start, row - 0.4], 1), np.stack([start, row + 0.4], 1),
                      np.stack([end, row + 0.4], 1), np.stack([end, row - 0.4], 1)], 1)
    bordered = float(np.median(width_px)) >= _BORDER_PX
    axes.add_collection(PolyCollection(verts, facecolors=colours, edgecolors="white" if bordered else "none",
                                       linewidths=0.6 if bordered else 0.0, antialiaseds=bordered))
    if label_ops is False or row_px < 12:
        return
    digits_px = np.array([6.0 * len(str(action.microbatch)) + 4 for action in ops])
    wide = np.flatnonzero(width_px >= digits_px)
    if label_ops is None and len(wide) > _MAX_LABELS:
        return
    for index in wide:
        red, green, blue = colours[index]
        ink = "black" if 0.299 * red + 0.587 * green + 0.114 * blue > 0.6 else "white"
        axes.text((start[index] + end[index]) / 2, row[index], str(ops[index].microbatch), ha="center",
                  va="center", fontsize=7, color=ink)


def _legends(figure, schedule, *, chunks: int, top_in: float) -> None:
    """The kinds in one row under the time axis; the chunk shades (when a rank holds several) in a second."""
    from matplotlib.patches import Rectangle

    height_in = figure.get_size_inches()[1]
    used = {action.kind for order in schedule.orders for action in order}
    kinds = [kind for kind in KIND_COLOURS if kind in used]
    figure.legend([Rectangle((0, 0), 1, 1, color=KIND_COLOURS[k]) for k in kinds], [_LABELS[k] for k in kinds],
                  loc="upper center", bbox_to_anchor=(0.5, top_in / height_in), ncol=len(kinds), fontsize=9,
                  frameon=False, borderaxespad=0.2)
    if chunks == 1:
        return
    shown = sorted({round(i * (chunks - 1) / 5) for i in range(6)}) if chunks > 8 else range(chunks)
    handles = [Rectangle((0, 0), 1, 1, alpha=0)] + [
        Rectangle((0, 0), 1, 1, color=chunk_shade(KIND_COLOURS[kinds[0]], chunk, chunks)) for chunk in shown]
    labels = [f"shade = model chunk on the rank ({chunks}), every kind:"] + [f"chunk {chunk}" for chunk in shown]
    figure.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, (top_in - _LEGEND_ROW_IN) / height_in),
                  ncol=len(handles), fontsize=9, frameon=False, borderaxespad=0.2, handletextpad=0.4)
