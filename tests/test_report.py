"""``megapipe report``: gather plan dirs into one table, CSV (+ Parquet) and a plot."""

from __future__ import annotations

import csv

import pytest

from megapipe.cli import main
from megapipe.errors import ConfigError
from megapipe.report.sweep import COLUMNS, gather


def test_report_gathers_plan_dirs(tmp_path, capsys):
    for name, seq in (("0_seq32", 32), ("1_seq16", 16)):
        assert main(["plan", "model=tiny_gpt", "cluster=cpu_gloo", "train.global_batch_size=8",
                     f"train.seq_length={seq}", f"output.dir={tmp_path / 'sweep' / name}", "output.format=json",
                     "output.pictures=false"]) == 0
    capsys.readouterr()
    assert main(["report", str(tmp_path / "sweep")]) == 0
    text = capsys.readouterr().out
    assert "megapipe report: 2 plans" in text
    with open(tmp_path / "sweep" / "sweep.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [int(row["seq_length"]) for row in rows] == [16, 32]
    assert tuple(rows[0]) == COLUMNS
    assert (tmp_path / "sweep" / "sweep.png").stat().st_size > 0
    assert float(rows[0]["tokens_per_s_per_gpu"]) > 0


def test_report_errors(tmp_path, capsys):
    with pytest.raises(ConfigError, match="no plan.yaml"):
        gather(str(tmp_path))
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert "not a directory" in capsys.readouterr().err


# -- the pictures ------------------------------------------------------------------------------------------
def _stage(static_gib: float, act_gib: float):
    from megapipe.plan.plans import StageUsage
    from megapipe.units import GIB

    return StageUsage(time_ms=1.0, static_bytes=static_gib * GIB, activation_bytes=act_gib * GIB,
                      total_bytes=(static_gib + act_gib) * GIB)


class _Plan:
    """What the memory chart reads of a plan."""

    def __init__(self, stages, schedule="1f1b"):
        self.stages, self.schedule, self.memory_cv = stages, schedule, 0.1


def _inside(outer, inner) -> bool:
    return outer.x0 <= inner.x0 and inner.x1 <= outer.x1 and outer.y0 <= inner.y0 and inner.y1 <= outer.y1


@pytest.mark.parametrize("ranks", [1, 2, 8, 32])
def test_memory_chart_keeps_its_legend_off_the_bars_and_its_text_inside(ranks, tmp_path):
    """The legend sits under the axes at every rank count (32 ranks: it once covered rank 31's bar), the title and
    the legend inside the figure, and the same inputs give the same bytes."""
    from megapipe.report.plots import memory_chart, memory_figure

    plan = _Plan([_stage(17, 30 + rank % 5) for rank in range(ranks)])
    equal = _Plan([_stage(17, 31) for _ in range(ranks)])
    figure = memory_figure(plan, baseline=equal, usable_gib=71.6)
    renderer = figure.canvas.get_renderer()
    figure.draw(renderer)
    frame = figure.bbox
    axes = figure.axes[0].get_window_extent(renderer)
    legend = figure.legends[0].get_window_extent(renderer)
    assert legend.y1 <= axes.y0 and _inside(frame, legend)
    assert all(_inside(frame, text.get_window_extent(renderer)) for text in figure.texts)
    first = memory_chart(plan, str(tmp_path / "a.png"), baseline=equal, usable_gib=71.6)
    second = memory_chart(plan, str(tmp_path / "b.png"), baseline=equal, usable_gib=71.6)
    assert open(first, "rb").read() == open(second, "rb").read()


def test_sweep_chart_gives_each_model_its_own_scale_and_labels_every_bar(tmp_path):
    """A 70B at 998 and 1,097 tokens/s/GPU beside an 8B at 9,000: one panel per model, every value written."""
    from megapipe.report.plots import sweep_chart, sweep_figure

    rows = [{"model": model, "cluster": cluster, "num_gpus": 128, "seq_length": 8192, "tokens_per_s_per_gpu": speed,
             "cost_per_million_tokens": cost, "tensor_model_parallel_size": 4, "pipeline_model_parallel_size": 8,
             "data_parallel_size": 4, "context_parallel_size": 1, "virtual_pipeline_model_parallel_size": 1}
            for model, cluster, speed, cost in (("llama3_70b", "h100_80gb", 998.0, 0.97),
                                                ("llama3_70b", "h200_141gb", 1097.0, 1.09),
                                                ("llama3_8b", "h100_80gb", 8680.0, 0.11),
                                                ("llama3_8b", "h200_141gb", 9280.0, 0.13))]
    figure = sweep_figure(rows)
    assert len(figure.axes) == 4  # two models x (tokens/s/GPU, $ per 1M tokens)
    seventy = figure.axes[0]
    assert seventy.get_xlim()[1] < 2000  # its own scale, not the 8B's
    assert {text.get_text() for text in seventy.texts} == {"998", "1,097"}
    first, second = sweep_chart(rows, str(tmp_path / "a.png")), sweep_chart(rows, str(tmp_path / "b.png"))
    assert open(first, "rb").read() == open(second, "rb").read()
