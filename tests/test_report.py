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
