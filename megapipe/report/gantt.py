"""Gantt chart of a simulated step: one row per pipeline rank, F/I/B/W in distinct colours, and each model
chunk a rank holds (interleaved 1F1B, the V schedules) in its own shade of them, light to dark.

Gaps between bars are idle time. Every op is one polygon of a single collection (thousands of ops draw in
tens of milliseconds), at least a pixel wide so no op vanishes; white op borders only where ops are wide
enough to show them (on narrow ops they wash the colours out). When most ops are narrower than two pixels
(a thousand microbatches over a 30 s step), drawing each at a pixel would paint stripes that are not there,
so each pixel column mixes the colours of the ops in it by their time instead, white standing for idle. The
rows keep a readable height up to 64 ranks and the legend sits under the time axis, outside the data.
"""

from __future__ import annotations

from megapipe.report.canvas import legend_row, new_figure, pinned_style, place_axes, put_title, save_png, title_lines
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
_BLEND_PX = 2.0
"""When the median op is narrower than this many pixels, pixel columns are blended (:func:`_draw_blended`)."""
_LABELLED_SHARE = 0.5
"""Without ``label_ops``, ops are numbered only when at least this share of them is wide enough for it."""


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
    title, top_in = title_lines(figure, title or (
        f"{schedule.name}: P={schedule.pipeline_model_parallel_size}, m={schedule.num_microbatches}, "
        f"step {result.step_time_ms:,.1f} ms, bubble {100 * result.bubble_fraction:.1f}%"
    ), width_in=_WIDTH_IN - 0.4)
    legend_rows = 1 + (chunks > 1)
    bottom_in = _AXIS_IN + _LEGEND_ROW_IN * legend_rows + 0.1
    height_in = top_in + row_in * ranks + bottom_in
    figure.set_size_inches(_WIDTH_IN, height_in)
    axes = place_axes(figure, left_in=_LEFT_IN, bottom_in=bottom_in, width_in=_WIDTH_IN - _LEFT_IN - _RIGHT_IN,
                      height_in=row_in * ranks)
    put_title(figure, title)
    span_ms = max(result.step_time_ms, 1e-9)
    px_per_ms = (_WIDTH_IN - _LEFT_IN - _RIGHT_IN) * figure.dpi / span_ms
    blended = _draw_ops(axes, result, chunks=chunks, px_per_ms=px_per_ms, row_px=row_in * figure.dpi,
                        label_ops=label_ops)
    axes.set_xlim(0, span_ms)
    axes.set_ylim(ranks - 0.5, -0.5)
    axes.set_yticks(range(ranks), [f"rank {r}" for r in range(ranks)], fontsize=9 if ranks <= 16 else 8)
    axes.tick_params(axis="y", length=0)
    axes.xaxis.set_major_formatter("{x:,.0f}")
    axes.set_xlabel("time (ms)", fontsize=10)
    _legends(figure, schedule, chunks=chunks, top_in=bottom_in - _AXIS_IN, blended=blended)
    return figure


def _op_arrays(result: SimResult, chunks: int):
    """Every op's rank, start and end (ms), its (kind, chunk) shade and its action, in rank order."""
    import numpy as np

    shades = {(kind, chunk): chunk_shade(colour, chunk, chunks) for kind, colour in KIND_COLOURS.items()
              for chunk in range(chunks)}
    rows, starts, ends, ops = [], [], [], []
    for rank, (order, rank_starts, rank_ends) in enumerate(zip(result.schedule.orders, result.start_ms,
                                                               result.end_ms)):
        rows += [rank] * len(order)
        starts += rank_starts
        ends += rank_ends
        ops += order
    return (np.asarray(rows, dtype=float), np.asarray(starts, dtype=float), np.asarray(ends, dtype=float),
            [shades[action.kind, action.chunk] for action in ops], ops)


def _draw_ops(axes, result: SimResult, *, chunks: int, px_per_ms: float, row_px: float,
              label_ops: bool | None) -> bool:
    """Every op as one polygon of a single collection, in its kind's shade for its chunk; when most ops are
    narrower than :data:`_BLEND_PX`, each pixel column blended instead (:func:`_draw_blended`). Returns
    whether it blended."""
    import numpy as np
    from matplotlib.collections import PolyCollection

    row, start, end, colours, ops = _op_arrays(result, chunks)
    if not ops:
        return False
    if float(np.median(end - start)) * px_per_ms < _BLEND_PX:
        _draw_blended(axes, row, start, end, colours, ranks=len(result.schedule.orders), px_per_ms=px_per_ms,
                      span_ms=max(result.step_time_ms, 1e-9))
        return True
    end = np.maximum(end, start + 1 / px_per_ms)  # a pixel at least: no op vanishes
    width_px = (end - start) * px_per_ms
    verts = np.stack([np.stack([start, row - 0.4], 1), np.stack([start, row + 0.4], 1),
                      np.stack([end, row + 0.4], 1), np.stack([end, row - 0.4], 1)], 1)
    bordered = float(np.median(width_px)) >= _BORDER_PX
    axes.add_collection(PolyCollection(verts, facecolors=colours, edgecolors="white" if bordered else "none",
                                       linewidths=0.6 if bordered else 0.0, antialiaseds=bordered))
    if label_ops is False or row_px < 12:
        return False
    digits_px = np.array([6.0 * len(str(action.microbatch)) + 4 for action in ops])
    wide = np.flatnonzero(width_px >= digits_px)
    if label_ops is None and (len(wide) > _MAX_LABELS or len(wide) < _LABELLED_SHARE * len(ops)):
        return False  # a few numbered ops among many bare ones read as marks, not as labels
    for index in wide:
        red, green, blue = colours[index]
        ink = "black" if 0.299 * red + 0.587 * green + 0.114 * blue > 0.6 else "white"
        axes.text((start[index] + end[index]) / 2, row[index], str(ops[index].microbatch), ha="center",
                  va="center", fontsize=7, color=ink)
    return False


def _draw_blended(axes, row, start, end, colours, *, ranks: int, px_per_ms: float, span_ms: float) -> None:
    """Each rank's row as one image a pixel column wide per column: the shades of the ops it holds mixed by the
    time each takes of it, white for the idle rest. Ops a pixel wide at least, drawn one by one, would cover
    their neighbours and show stripes that are not there (aliasing)."""
    import numpy as np

    columns = max(1, int(round(span_ms * px_per_ms)))
    grid = np.arange(columns + 1, dtype=float)
    palette = sorted(set(colours))
    shade_of = np.array([palette.index(colour) for colour in colours])
    rgb = np.array(palette)
    for rank in range(ranks):
        image = np.zeros((columns, 3))
        busy = np.zeros(columns)
        on_rank = row == rank
        for index in np.unique(shade_of[on_rank]):
            mask = on_rank & (shade_of == index)
            share = np.diff(_ramp(start[mask] * px_per_ms, grid) - _ramp(end[mask] * px_per_ms, grid))
            image += share[:, None] * rgb[index]
            busy += share
        image += np.clip(1.0 - busy, 0.0, 1.0)[:, None]
        axes.imshow(np.clip(image, 0.0, 1.0)[None, :, :], extent=(0, span_ms, rank + 0.4, rank - 0.4),
                    aspect="auto", interpolation="nearest")


def _ramp(points, grid):
    """``sum(max(0, x - p) for p in points)`` at each x of ``grid``: the time ops starting (or ending) at
    ``points`` have run by x; an op's share of a column is the difference of its start's and end's ramps."""
    import numpy as np

    points = np.sort(points)
    below = np.searchsorted(points, grid, side="right")
    return below * grid - np.concatenate([[0.0], np.cumsum(points)])[below]


def _legends(figure, schedule, *, chunks: int, top_in: float, blended: bool = False) -> None:
    """The kinds in one row under the time axis (and, when pixel columns are blended, how to read them); the
    chunk shades (when a rank holds several) in a second."""
    from matplotlib.patches import Rectangle

    used = {action.kind for order in schedule.orders for action in order}
    kinds = [kind for kind in KIND_COLOURS if kind in used]
    handles = [Rectangle((0, 0), 1, 1, color=KIND_COLOURS[k]) for k in kinds]
    labels = [_LABELS[k] for k in kinds]
    if blended:
        handles.append(Rectangle((0, 0), 1, 1, alpha=0))
        labels.append("(ops thinner than a pixel: each pixel mixes the colours of the ops in it, white = idle)")
    legend_row(figure, handles, labels, top_in=top_in)
    if chunks == 1:
        return
    shown = sorted({round(i * (chunks - 1) / 5) for i in range(6)}) if chunks > 8 else range(chunks)
    handles = [Rectangle((0, 0), 1, 1, alpha=0)] + [
        Rectangle((0, 0), 1, 1, color=chunk_shade(KIND_COLOURS[kinds[0]], chunk, chunks)) for chunk in shown]
    labels = [f"shade = model chunk on the rank ({chunks}), every kind:"] + [f"chunk {chunk}" for chunk in shown]
    legend_row(figure, handles, labels, top_in=top_in - _LEGEND_ROW_IN, handletextpad=0.4)
