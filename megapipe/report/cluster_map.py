"""``megapipe pack``'s picture of the nodes: every node of the cluster as a cell, coloured by the job it runs.

One panel per packing (the packing at its start, and the what-if repacking when there is one); node groups are
rows of cells in their order, up to 32 cells a row, nodes numbered from 0 in each group. Laid out in inches on
:mod:`megapipe.report.canvas` (same inputs, same bytes).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from megapipe.report.canvas import (legend_row, legend_width_in, new_figure, pinned_style, place_axes, put_title,
                                    save_png, text_width_in, title_lines)

__all__ = ["FAILED", "job_colours", "node_owners", "cluster_map"]


FAILED = "(failed)"
_CELL_IN, _COLUMNS, _PANEL_TITLE_IN, _GAP_IN = 0.3, 32, 0.35, 0.15


def node_owners(capacities: Sequence[int], placed: Sequence[tuple[str, int, int] | None],
                failed: Sequence[int] = ()) -> list[list[str | None]]:
    """Per node group, per node: the job on it (None: idle, FAILED: lost). ``placed``: (job, group, nodes) per
    job; each job takes the next free nodes of its group, in job order; ``failed`` nodes are each group's last."""
    owners: list[list[str | None]] = [[None] * capacity for capacity in capacities]
    for group, lost in enumerate(failed):
        for node in range(capacities[group] - lost, capacities[group]):
            owners[group][node] = FAILED
    cursor = [0] * len(capacities)
    for item in placed:
        if item is None:
            continue
        name, group, nodes = item
        for node in range(cursor[group], cursor[group] + nodes):
            owners[group][node] = name
        cursor[group] += nodes
    return owners


def job_colours(names: Sequence[str]) -> dict[str, tuple]:
    """One colour per job name, in sorted order, from matplotlib's tab20 (the strong shades first)."""
    import matplotlib

    palette = matplotlib.colormaps["tab20"]
    ordered = sorted(names)
    return {name: palette((2 * index) % 20 + (2 * index // 20) % 2) for index, name in enumerate(ordered)}


def cluster_map(panels: Sequence[tuple[str, list[list[str | None]]]], group_names: Sequence[str], path: str, *,
                coloured: Sequence[str] | None = None) -> str:
    """``panels``: (title, node_owners(...)) each; ``coloured``: the job names the colours go over
    (:func:`job_colours`, so other pictures of the same jobs agree), else the names shown; writes a PNG."""
    with pinned_style():
        figure = _figure(panels, group_names, coloured)
    return save_png(figure, path)


def _figure(panels, group_names: Sequence[str], coloured: Sequence[str] | None):
    from matplotlib.patches import Rectangle

    names = sorted({name for _, owners in panels for row in owners for name in row if name not in (None, FAILED)})
    colour = {**job_colours(names if coloured is None else coloured), FAILED: "#222222"}
    labels = names + ([FAILED] if any(FAILED in row for _, owners in panels for row in owners) else [])
    widest = max(len(row) for _, owners in panels for row in owners)
    columns = max(1, min(widest, _COLUMNS))
    figure = new_figure(10.0, 1.0)
    label_in = 0.3 + max(text_width_in(figure, f"{name} ({n})", fontsize=8) for name, n in
                         zip(group_names, (len(row) for row in panels[0][1])))
    width_in = max(label_in + columns * _CELL_IN + 0.3, legend_width_in(figure, labels, fontsize=8) + 0.4, 5.0)
    title, top_in = title_lines(figure, "megapipe pack: each node by the job it runs", width_in=width_in - 0.4)
    lines = [sum(max(1, math.ceil(len(row) / columns)) for row in owners) for _, owners in panels]
    legend_rows = max(1, math.ceil(legend_width_in(figure, labels, fontsize=8) / (width_in - 0.4)))
    bottom_in = 0.3 * legend_rows + 0.15
    height_in = top_in + sum(_PANEL_TITLE_IN + count * _CELL_IN + _GAP_IN for count in lines) + bottom_in
    figure.set_size_inches(width_in, height_in)
    put_title(figure, title)
    top = height_in - top_in
    for (panel_title, owners), count in zip(panels, lines):
        top -= _PANEL_TITLE_IN + count * _CELL_IN
        axes = place_axes(figure, left_in=label_in, bottom_in=top, width_in=columns * _CELL_IN,
                          height_in=count * _CELL_IN)
        top -= _GAP_IN
        _cells(axes, owners, colour, columns=columns, group_names=group_names, rows=count)
        axes.set_title(panel_title, fontsize=10, loc="left")
    handles = [Rectangle((0, 0), 1, 1, color=colour[name]) for name in labels]
    legend_row(figure, handles, labels, top_in=bottom_in - 0.05, fontsize=8,
               ncol=max(1, math.ceil(len(labels) / legend_rows)))
    return figure


def _cells(axes, owners, colour, *, columns: int, group_names: Sequence[str], rows: int) -> None:
    from matplotlib.collections import PatchCollection
    from matplotlib.patches import Rectangle

    patches, faces, y = [], [], 0
    for group, row in enumerate(owners):
        for node, name in enumerate(row):
            patches.append(Rectangle((node % columns + 0.04, y + node // columns + 0.04), 0.92, 0.92))
            faces.append(colour[name] if name else "#dddddd")
        axes.text(-0.3, y + 0.5, f"{group_names[group]} ({len(row)})", ha="right", va="center", fontsize=8)
        y += max(1, math.ceil(len(row) / columns))
    axes.add_collection(PatchCollection(patches, facecolors=faces, edgecolors="none"))
    axes.set_xlim(0, columns)
    axes.set_ylim(rows, 0)
    axes.axis("off")
