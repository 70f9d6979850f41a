"""``megapipe report DIR``: gather the plan dirs of a sweep into one table, CSV (+ Parquet) and a plot.

The files (sweep.csv, sweep.parquet when pyarrow is installed, sweep.png) go into DIR, or output.dir.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from omegaconf import DictConfig

from megapipe.commands import painter
from megapipe.commands.common import console, print_json
from megapipe.options import OutputOptions
from megapipe.config.options import output_options
from megapipe.errors import ConfigError
from megapipe.report.sweep import gather, write_tables

__all__ = ["ReportInputs", "prepare", "run", "CONFIG_KEYS"]

CONFIG_KEYS = ("input", "output.format", "output.dir", "output.pictures")
"""What `megapipe report --help` lists (:mod:`megapipe.config.keys`)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ReportInputs:
    root: str
    """The sweep (or plan) directory to gather."""
    output: OutputOptions


def prepare(cfg: DictConfig) -> ReportInputs:
    """Only the directory and the output options: a report plans nothing, so no model or cluster is checked."""
    root = cfg.get("input")
    if not root:
        raise ConfigError("report needs a directory: megapipe report multirun/plan/DATE")
    return ReportInputs(root=os.path.expanduser(str(root)), output=output_options(cfg))


def run(inputs: ReportInputs, *, directory: str) -> None:
    rows, failed = gather(inputs.root)
    out = inputs.output.dir or inputs.root
    os.makedirs(out, exist_ok=True)
    picture = os.path.join(out, "sweep.png") if inputs.output.pictures else None
    paths = write_tables(rows, out) + ([picture] if picture else [])
    if inputs.output.json:
        print_json({"rows": rows, "failed": failed, "files": paths})
    else:
        _print_table(rows, failed, paths)
    if picture:  # drawn after the answer is printed
        from megapipe.report.plots import sweep_chart

        painter.draw(sweep_chart, rows, picture)


def _print_table(rows: list[dict], failed: list[dict], paths: list[str]) -> None:
    from rich.table import Table

    table = Table(title=f"megapipe report: {len(rows)} plans" + (f", {len(failed)} failed" if failed else ""))
    for name in ("model", "cluster", "seq", "TP/PP/DP/CP/VP", "schedule", "mbs", "tok/s/GPU", "MFU", "$/1M tok",
                 "vs equal split"):
        table.add_column(name)
    for row in rows:
        shape = "/".join(str(row[k]) for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                                               "data_parallel_size", "context_parallel_size",
                                               "virtual_pipeline_model_parallel_size"))
        equal = row["equal_split_tokens_per_s_per_gpu"]
        gain = f"{row['tokens_per_s_per_gpu'] / equal - 1:+.1%}" if equal else "-"
        table.add_row(row["model"], row["cluster"], str(row["seq_length"]), shape, row["schedule"],
                      str(row["micro_batch_size"]), f"{row['tokens_per_s_per_gpu']:,.0f}", f"{row['mfu']:.1%}",
                      f"${row['cost_per_million_tokens']:.3f}", gain)
    out = console()
    out.print(table)
    for job in failed:
        out.print(f"FAILED {job['plan_dir']}: {job['error']}", markup=False)
    out.print("files: " + ", ".join(paths))
