"""Planner pictures: peak memory per pipeline rank, and a sweep's best plans per model.

Both are laid out in inches on :mod:`megapipe.report.canvas` (same inputs, same bytes; written atomically):
the legend sits in a row under the axes, outside the data, and the text keeps its size whatever the rank
or row count.
"""

from __future__ import annotations

from collections.abc import Sequence

from megapipe.report.canvas import (legend_row, legend_width_in, new_figure, pinned_style, place_axes, put_title,
                                   save_png, text_width_in, title_lines)
from megapipe.units import GIB

__all__ = ["memory_chart", "memory_figure", "sweep_chart", "sweep_figure"]

STATIC_COLOUR, ACTIVATION_COLOUR, LIMIT_COLOUR = "#4C72B0", "#DD8452", "#C44E52"
_LEFT_IN, _RIGHT_IN, _AXIS_IN, _LEGEND_IN = 0.85, 0.3, 0.55, 0.35
"""Margins: left of the axes (tick labels, axis label), right, under them (ticks, axis label), one legend row."""
_MAX_WIDTH_IN, _PLOT_HEIGHT_IN, _MAX_RANK_IN = 12.0, 3.6, 1.3


def memory_chart(plan, path: str, *, baseline=None, usable_gib: float | Sequence[float] | None = None,
                 title: str | None = None) -> str:
    """Write :func:`memory_figure` to ``path`` (PNG) and return the path."""
    with pinned_style():
        figure = memory_figure(plan, baseline=baseline, usable_gib=usable_gib, title=title)
    return save_png(figure, path)


def memory_figure(plan, *, baseline=None, usable_gib: float | Sequence[float] | None = None,
                  title: str | None = None):
    """Stacked bars per pipeline rank, static (weights, gradients, optimizer) under peak activations, the equal
    split's total (``baseline``) outlined beside each, and the usable memory (one figure, or one per rank on a
    mixed cluster) as a dashed line."""
    ranks = len(plan.stages)
    paired = baseline is not None and len(baseline.stages) == ranks
    limits = None if usable_gib is None else (
        [float(usable_gib)] * ranks if isinstance(usable_gib, (int, float)) else [float(v) for v in usable_gib])
    handles, labels = _memory_legend(paired=paired, limited=limits is not None)
    figure = new_figure(_MAX_WIDTH_IN, 1.0)
    width_in = min(_MAX_WIDTH_IN, max(7.0, _LEFT_IN + _RIGHT_IN + ranks * (0.55 if paired else 0.35) + 1.0,
                                      legend_width_in(figure, labels) + 0.4))
    totals = [stage.total_bytes / GIB for stage in plan.stages]
    fullest = max(range(ranks), key=lambda rank: totals[rank])
    title, top_in = title_lines(figure, title or (
        f"peak memory per GPU by pipeline rank: {plan.schedule}, fullest rank {fullest} at {totals[fullest]:.1f} "
        f"GiB, spread CV {plan.memory_cv:.2f}"), width_in=width_in - 0.4)
    bottom_in = _AXIS_IN + _LEGEND_IN + 0.1
    figure.set_size_inches(width_in, top_in + _PLOT_HEIGHT_IN + bottom_in)
    axes = place_axes(figure, left_in=_LEFT_IN, bottom_in=bottom_in, width_in=width_in - _LEFT_IN - _RIGHT_IN,
                      height_in=_PLOT_HEIGHT_IN)
    put_title(figure, title)
    bar = 0.4 if paired else 0.7
    left = [rank - bar / 2 if paired else rank for rank in range(ranks)]
    static = [stage.static_bytes / GIB for stage in plan.stages]
    axes.bar(left, static, bar, color=STATIC_COLOUR)
    axes.bar(left, [stage.activation_bytes / GIB for stage in plan.stages], bar, bottom=static,
             color=ACTIVATION_COLOUR)
    top = max(totals)
    if paired:
        equal = [stage.total_bytes / GIB for stage in baseline.stages]
        axes.bar([rank + bar / 2 for rank in range(ranks)], equal, bar, facecolor="none", edgecolor="#333333",
                 hatch="//", linewidth=0.8)
        top = max(top, *equal)
    if limits is not None:
        if len(set(limits)) == 1:
            axes.axhline(limits[0], color=LIMIT_COLOUR, linestyle="--", linewidth=1.2)
        else:  # a mixed cluster: each rank's own GPU
            axes.step([-0.5, *[rank + 0.5 for rank in range(ranks)]], [limits[0], *limits], where="pre",
                      color=LIMIT_COLOUR, linestyle="--", linewidth=1.2)
        top = max(top, *limits)
    _memory_axes(axes, ranks, top, plot_width_in=width_in - _LEFT_IN - _RIGHT_IN)
    legend_row(figure, handles, labels, top_in=bottom_in - _AXIS_IN)
    return figure


def _memory_legend(*, paired: bool, limited: bool) -> tuple[list, list[str]]:
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles = [Patch(color=STATIC_COLOUR), Patch(color=ACTIVATION_COLOUR)]
    labels = ["static: weights, gradients, optimizer", "peak activations"]
    if paired:
        handles.append(Patch(facecolor="none", edgecolor="#333333", hatch="//"))
        labels.append("equal split, total")
    if limited:
        handles.append(Line2D([], [], color=LIMIT_COLOUR, linestyle="--", linewidth=1.2))
        labels.append("usable memory per GPU")
    return handles, labels


def _memory_axes(axes, ranks: int, top_gib: float, *, plot_width_in: float) -> None:
    """Limits, ticks and labels; a rank takes at most :data:`_MAX_RANK_IN` of the width (one or two ranks are
    drawn as bars, not as slabs)."""
    spare = max(0.0, plot_width_in / _MAX_RANK_IN - ranks) / 2
    axes.set_xlim(-0.6 - spare, ranks - 0.4 + spare)
    axes.set_ylim(0, top_gib * 1.08)
    step = 1 if ranks <= 32 else 2 if ranks <= 64 else 4
    axes.set_xticks(range(0, ranks, step), [str(rank) for rank in range(0, ranks, step)],
                    fontsize=9 if ranks <= 16 else 8)
    axes.tick_params(axis="y", labelsize=9)
    axes.set_xlabel("pipeline rank", fontsize=10)
    axes.set_ylabel("GiB per GPU", fontsize=10)
    axes.grid(axis="y", color="#dddddd", linewidth=0.6)
    axes.set_axisbelow(True)


_METRICS = (("tokens_per_s_per_gpu", "tokens/s per GPU (higher is better)", "#4C72B0", "{:,.0f}"),
            ("cost_per_million_tokens", "$ per 1M tokens (lower is better)", "#55A868", "${:,.3f}"))
_ROW_IN, _PANEL_GAP_IN, _SWEEP_WIDTH_IN = 0.32, 0.55, 12.0


def sweep_chart(rows: Sequence[dict], path: str) -> str:
    """Write :func:`sweep_figure` to ``path`` (PNG) and return the path."""
    with pinned_style():
        figure = sweep_figure(rows)
    return save_png(figure, path)


def _sweep_label(row: dict) -> str:
    shape = "/".join(str(row[key]) for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                                               "data_parallel_size", "context_parallel_size",
                                               "virtual_pipeline_model_parallel_size"))
    return f"{row['num_gpus']} {row['cluster']} GPUs, seq {row['seq_length']:,}, TP/PP/DP/CP/VP {shape}"


def sweep_figure(rows: Sequence[dict]):
    """One panel per model (its own scale: a 70B's 1,000 tokens/s/GPU is not drawn beside an 8B's 9,000), one
    bar per cluster and sequence length, each with its value: tokens/s/GPU on the left, $ per 1M tokens on the
    right."""
    models = sorted({row["model"] for row in rows})
    groups = [[row for row in rows if row["model"] == model] for model in models]
    figure = new_figure(_SWEEP_WIDTH_IN, 1.0)
    title, top_in = title_lines(figure, f"megapipe sweep: the best plan of each of {len(rows)} jobs, one panel "
                                        "per model", width_in=_SWEEP_WIDTH_IN - 0.4)
    label_in = min(4.2, 0.25 + max(text_width_in(figure, _sweep_label(row), fontsize=8) for row in rows))
    panel_in = (_SWEEP_WIDTH_IN - label_in - 0.3 - 0.35) / 2
    heights = [_ROW_IN * len(group) + 0.1 for group in groups]
    height_in = top_in + sum(heights) + _PANEL_GAP_IN * len(groups) + 0.35
    figure.set_size_inches(_SWEEP_WIDTH_IN, height_in)
    put_title(figure, title)
    bottom_in = height_in - top_in
    for model, group, panel_height in zip(models, groups, heights):
        bottom_in -= _PANEL_GAP_IN + panel_height
        for column, metric in enumerate(_METRICS):
            axes = place_axes(figure, left_in=label_in + column * (panel_in + 0.35), bottom_in=bottom_in,
                              width_in=panel_in, height_in=panel_height)
            _metric_bars(axes, group, metric, labelled=column == 0)
            axes.set_title(f"{model}: {metric[1]}", fontsize=10, loc="left")
    return figure


def _metric_bars(axes, group: Sequence[dict], metric, *, labelled: bool) -> None:
    """Horizontal bars with their values at their ends; the best of the model's bars drawn dark."""
    key, _, colour, number = metric
    values = [float(row[key]) for row in group]
    best = (max if key == "tokens_per_s_per_gpu" else min)(range(len(values)), key=lambda index: values[index])
    positions = range(len(group))
    axes.barh(positions, values, 0.7, color=[colour if index == best else colour + "99" for index in positions])
    top = max(values) if values and max(values) > 0 else 1.0
    for index, value in enumerate(values):
        axes.text(value + top * 0.01, index, number.format(value), va="center", ha="left", fontsize=8)
    axes.set_xlim(0, top * 1.22)
    axes.set_ylim(len(group) - 0.5, -0.5)
    axes.set_yticks(list(positions), [_sweep_label(row) for row in group] if labelled else [""] * len(group),
                    fontsize=8)
    axes.tick_params(axis="y", length=0)
    axes.tick_params(axis="x", labelsize=8)
    axes.xaxis.set_major_formatter("{x:,.0f}" if key == "tokens_per_s_per_gpu" else "{x:,.2f}")
    axes.grid(axis="x", color="#dddddd", linewidth=0.6)
    axes.set_axisbelow(True)
