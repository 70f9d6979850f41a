"""``megapipe pack``'s timeline: the cluster's nodes (rows) over the hours until every token budget is done.

Each job is a block on the nodes it holds, from its start until a repack moves it or its budget is done; a
restart (the job moved at a repack: checkpoint, restart, reload) is hatched at the start of its block, three
pixels wide at least; a
dotted line marks each repack (a job finished, the rest were repacked). One panel per policy shown, on one
time axis. Laid out in inches on :mod:`megapipe.report.canvas` (same inputs, same bytes).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from megapipe.records import JobSpec
from megapipe.report.canvas import (legend_row, legend_width_in, new_figure, pinned_style, place_axes, put_title,
                                    save_png, text_width_in, title_lines)
from megapipe.report.cluster_map import job_colours

__all__ = ["node_runs", "timeline_chart"]

_WIDTH_IN, _LEFT_IN, _RIGHT_IN, _AXIS_IN, _PANEL_TITLE_IN = 12.0, 1.5, 0.3, 0.5, 0.3


def node_runs(segments, capacities: Sequence[int]) -> list[tuple[object, int, int, int]]:
    """Per segment, the nodes it holds as runs ``(segment, group, first node, node count)``: the segments starting at
    a repack, largest first, each take the first run of free nodes long enough, else the lowest free ones (a job
    that keeps its place keeps its nodes)."""
    owner = [[None] * capacity for capacity in capacities]
    runs = []
    for start in sorted({segment.start_h for segment in segments}):
        for group in owner:
            for node, held in enumerate(group):
                if held is not None and held.end_h <= start * (1 + 1e-12) + 1e-12:
                    group[node] = None
        starting = sorted((s for s in segments if s.start_h == start), key=lambda s: (-s.nodes, s.job))
        for segment in starting:
            free = _first_fit(owner[segment.group], segment.nodes)
            for node in free:
                owner[segment.group][node] = segment
            runs += [(segment, segment.group, first, count) for first, count in _contiguous(free)]
    return runs


def _first_fit(owner: list, count: int) -> list[int]:
    """The first ``count`` free nodes in one run where such a run exists, else the lowest free ones."""
    free = [node for node, held in enumerate(owner) if held is None]
    for first, length in _contiguous(free):
        if length >= count:
            return list(range(first, first + count))
    return free[:count]


def _contiguous(nodes: Sequence[int]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for node in nodes:
        if out and out[-1][0] + out[-1][1] == node:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((node, 1))
    return out


def timeline_chart(panels: Sequence[tuple[str, str, Sequence]], jobs: Sequence[JobSpec], capacities: Sequence[int],
                   group_names: Sequence[str], path: str, *, coloured: Sequence[str] | None = None) -> str:
    """``panels``: (policy name, what it optimises, its segments) each; ``coloured``: the job names the colours go
    over (:func:`megapipe.report.cluster_map.job_colours`, so other pictures of the same jobs agree), else the
    jobs'; writes a PNG."""
    with pinned_style():
        figure = _figure(panels, jobs, capacities, group_names,
                         job_colours([job.name for job in jobs] if coloured is None else coloured))
    return save_png(figure, path)


def _figure(panels, jobs: Sequence[JobSpec], capacities: Sequence[int], group_names: Sequence[str], colour: dict):
    from matplotlib.lines import Line2D
    from matplotlib.patches import Rectangle

    nodes = sum(capacities)
    plot_in = min(3.6, max(1.4, 0.05 * nodes + 0.8))
    labels = [job.name + (f" (deadline {job.deadline_hours:g} h)" if job.deadline_hours is not None else "")
              for job in jobs]
    extra = ["restart after a move", "repack: a job finished"]
    figure = new_figure(_WIDTH_IN, 1.0)
    legend_rows = max(1, math.ceil(legend_width_in(figure, labels + extra, fontsize=8) / (_WIDTH_IN - 0.4)))
    title, top_in = title_lines(figure, "megapipe pack: nodes by hours until every token budget is done",
                                width_in=_WIDTH_IN - 0.4)
    bottom_in = 0.3 * legend_rows + 0.15
    height_in = top_in + len(panels) * (_PANEL_TITLE_IN + plot_in + _AXIS_IN) + bottom_in
    figure.set_size_inches(_WIDTH_IN, height_in)
    put_title(figure, title)
    span_h = max((segment.end_h for _, _, segments in panels for segment in segments), default=1.0) * 1.01
    top = height_in - top_in
    for name, aim, segments in panels:
        top -= _PANEL_TITLE_IN + plot_in
        axes = place_axes(figure, left_in=_LEFT_IN, bottom_in=top, width_in=_WIDTH_IN - _LEFT_IN - _RIGHT_IN,
                          height_in=plot_in)
        top -= _AXIS_IN
        _blocks(axes, segments, jobs, capacities, colour, px_per_h=(_WIDTH_IN - _LEFT_IN - _RIGHT_IN) * figure.dpi
                / span_h, px_per_node=plot_in * figure.dpi / nodes)
        _node_axis(axes, capacities, group_names, span_h)
        axes.set_title(f"{name}: {aim}", fontsize=10, loc="left")
    handles = [Rectangle((0, 0), 1, 1, color=colour[job.name]) for job in jobs]
    handles += [Rectangle((0, 0), 1, 1, facecolor="white", edgecolor="#555555", hatch="////"),
                Line2D([], [], color="#333333", linestyle=":", linewidth=1.2)]
    legend_row(figure, handles, labels + extra, top_in=bottom_in - 0.05, fontsize=8,
               ncol=max(1, math.ceil(len(handles) / legend_rows)))
    return figure


def _blocks(axes, segments, jobs, capacities, colour, *, px_per_h: float, px_per_node: float) -> None:
    """Each segment's node runs as blocks, the restart hatched, the job's name on blocks large enough for it."""
    from matplotlib.collections import PatchCollection
    from matplotlib.patches import Rectangle

    offsets = [sum(capacities[:group]) for group in range(len(capacities))]
    blocks, faces, restarts = [], [], []
    for segment, group, first, count in node_runs(segments, capacities):
        y = offsets[group] + first
        blocks.append(Rectangle((segment.start_h, y), segment.end_h - segment.start_h, count))
        faces.append(colour[jobs[segment.job].name])
        if segment.restart_h > 0:  # 3 pixels at least: ten minutes of a 150-hour run would not show
            restarts.append(Rectangle((segment.start_h, y), max(segment.restart_h, 3 / px_per_h), count))
        name = jobs[segment.job].name
        fits = (text_width_in(axes.figure, name, fontsize=7) * axes.figure.dpi + 6 <= (segment.end_h - segment.start_h)
                * px_per_h and count * px_per_node >= 11)
        if fits:
            axes.text((segment.start_h + segment.end_h) / 2, y + count / 2, name, ha="center", va="center",
                      fontsize=7, color="black")
    axes.add_collection(PatchCollection(blocks, facecolors=faces, edgecolors="white", linewidths=0.5))
    axes.add_collection(PatchCollection(restarts, facecolors="white", edgecolors="#555555", hatch="////",
                                        linewidths=0.0, alpha=0.8))
    for start in sorted({segment.start_h for segment in segments} - {0.0}):
        axes.axvline(start, color="#333333", linestyle=":", linewidth=1.2, zorder=3)


def _node_axis(axes, capacities: Sequence[int], group_names: Sequence[str], span_h: float) -> None:
    nodes = sum(capacities)
    axes.set_xlim(0, span_h)
    axes.set_ylim(nodes, 0)
    offsets = [sum(capacities[:group]) for group in range(len(capacities))]
    axes.set_yticks([offset + capacity / 2 for offset, capacity in zip(offsets, capacities)],
                    [f"{name}\n{capacity} nodes" for name, capacity in zip(group_names, capacities)], fontsize=8)
    for offset in offsets[1:]:
        axes.axhline(offset, color="black", linewidth=0.8)
    axes.tick_params(axis="y", length=0)
    axes.tick_params(axis="x", labelsize=8)
    axes.set_xlabel("hours", fontsize=9)
    axes.xaxis.set_label_coords(1.0, -0.08)
    axes.xaxis.get_label().set_horizontalalignment("right")
