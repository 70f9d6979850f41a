"""``megapipe pack``'s picture: every node of the cluster as a cell, coloured by the job it runs.

One panel per packing (the packing, and the what-if repacking when there is one); node groups are rows
of cells in their order, nodes numbered from 0 in each group. Same inputs, same bytes (pinned metadata).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from megapipe.report.plots import _pyplot, save_png

__all__ = ["node_owners", "cluster_map"]


FAILED = "(failed)"


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


def cluster_map(panels: Sequence[tuple[str, list[list[str | None]]]], group_names: Sequence[str], path: str) -> str:
    """``panels``: (title, node_owners(...)) each; writes a PNG."""
    plt = _pyplot()
    names = sorted({name for _, owners in panels for row in owners for name in row if name not in (None, FAILED)})
    colours = plt.get_cmap("tab20")
    colour = {name: colours((2 * index) % 20 + (2 * index // 20) % 2) for index, name in enumerate(names)}
    colour[FAILED] = "#222222"
    if any(FAILED in row for _, owners in panels for row in owners):
        names.append(FAILED)
    width = max(1, max(len(row) for _, owners in panels for row in owners))
    columns = min(width, 32)
    heights = [sum(max(1, math.ceil(len(row) / columns)) for row in owners) for _, owners in panels]
    figure, axes = plt.subplots(len(panels), 1, figsize=(10, 1.2 + 0.35 * sum(heights) + 0.8 * len(panels)),
                                squeeze=False)
    for axis, (title, owners) in zip(axes[:, 0], panels):
        y = 0
        for group, row in enumerate(owners):
            lines = max(1, math.ceil(len(row) / columns))
            for node, name in enumerate(row):
                cx, cy = node % columns, y + node // columns
                axis.add_patch(plt.Rectangle((cx, -cy - 1), 0.92, 0.92, color=colour[name] if name else "#dddddd"))
            axis.text(-0.5, -y - 0.5, f"{group_names[group]} ({len(row)})", ha="right", va="center", fontsize=7)
            y += lines
        axis.set_xlim(-6, columns)
        axis.set_ylim(-y - 0.2, 0.2)
        axis.set_aspect("equal")
        axis.axis("off")
        axis.set_title(title, fontsize=9)
    handles = [plt.Rectangle((0, 0), 1, 1, color=colour[name]) for name in names]
    figure.legend(handles, names, loc="lower center", ncol=min(6, max(1, len(names))), fontsize=7, frameon=False)
    figure.tight_layout(rect=(0, 0.08, 1, 1))
    return save_png(figure, path)
