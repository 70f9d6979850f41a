"""``megapipe report DIR``: gather the plan dirs of a sweep into one table, CSV (+ Parquet) and a plot."""

from __future__ import annotations

import json
import os

from omegaconf import DictConfig

from megapipe.errors import ConfigError
from megapipe.report.sweep import gather, write_tables

__all__ = ["run"]


def run(cfg: DictConfig) -> None:
    root = cfg.get("input")
    if not root:
        raise ConfigError("report needs a directory: megapipe report multirun/plan/DATE")
    root = os.path.expanduser(str(root))
    rows = gather(root)
    out = str(cfg.output.dir) if cfg.output.get("dir") else root
    os.makedirs(out, exist_ok=True)
    paths = write_tables(rows, out)
    if cfg.output.get("pictures", True):
        from megapipe.report.plots import sweep_chart

        paths.append(sweep_chart(rows, os.path.join(out, "sweep.png")))
    fmt = getattr(cfg.output.format, "value", str(cfg.output.format))
    if fmt == "json":
        print(json.dumps({"rows": rows, "files": paths}))
        return
    _print_table(rows, paths)


def _print_table(rows: list[dict], paths: list[str]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"megapipe report: {len(rows)} plans")
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
    console = Console()
    console.print(table)
    console.print("files: " + ", ".join(paths))
