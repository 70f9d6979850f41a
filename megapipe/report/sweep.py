"""Gather plan dirs (each with a megapipe-plan/1 ``plan.yaml``) into one table.

A Hydra multirun writes one plan dir per job under the sweep dir; :func:`gather` finds
them all, and :func:`write_tables` writes ``sweep.csv`` (and ``sweep.parquet`` when
pyarrow is importable). Rows are sorted by model, cluster and sequence length.
"""

from __future__ import annotations

import csv
import io
import os

import yaml

from megapipe.errors import ConfigError
from megapipe.plan.document import FORMAT
from megapipe.units import GIB
from megapipe.io import atomic_write_bytes, atomic_write_text

__all__ = ["COLUMNS", "find_plans", "gather", "write_tables"]

COLUMNS = (
    "model", "cluster", "num_gpus", "seq_length", "global_batch_size", "tensor_model_parallel_size",
    "pipeline_model_parallel_size", "data_parallel_size", "context_parallel_size",
    "virtual_pipeline_model_parallel_size", "micro_batch_size", "recompute_granularity", "schedule",
    "layout", "step_time_s", "tokens_per_s_per_gpu", "mfu", "bubble_fraction", "peak_memory_gib",
    "cost_per_million_tokens", "total_cost", "equal_split_tokens_per_s_per_gpu", "plan_dir",
)


def find_plans(root: str) -> list[str]:
    """Every plan.yaml under ``root``, sorted."""
    if not os.path.isdir(root):
        raise ConfigError(f"report input {root!r} is not a directory; pass a plan or sweep dir")
    found = []
    for directory, _, files in os.walk(root):
        if "plan.yaml" in files:
            found.append(os.path.join(directory, "plan.yaml"))
    return sorted(found)


def _row(path: str, doc: dict) -> dict:
    best = doc["best"]
    par, train = best["parallel"], best["train"]
    baseline = doc.get("baseline") or {}
    return {
        "model": doc["model"]["name"], "cluster": doc["cluster"]["name"], "num_gpus": doc["cluster"]["num_gpus"],
        "seq_length": train["seq_length"], "global_batch_size": train["global_batch_size"],
        **{key: par[key] for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                                     "data_parallel_size", "context_parallel_size",
                                     "virtual_pipeline_model_parallel_size")},
        "micro_batch_size": train["micro_batch_size"], "recompute_granularity": train["recompute_granularity"],
        "schedule": best["schedule"], "layout": best["layout"], "step_time_s": best["step_time_s"],
        "tokens_per_s_per_gpu": best["tokens_per_s_per_gpu"], "mfu": best["mfu"],
        "bubble_fraction": best["bubble_fraction"],
        "peak_memory_gib": max(stage["total_bytes"] for stage in best["stages"]) / GIB,
        "cost_per_million_tokens": best["cost_per_million_tokens"], "total_cost": best["total_cost"],
        "equal_split_tokens_per_s_per_gpu": baseline.get("tokens_per_s_per_gpu"),
        "plan_dir": os.path.dirname(path),
    }


def gather(root: str) -> list[dict]:
    """One row per plan dir under ``root``; raises ConfigError when there is none."""
    rows = []
    for path in find_plans(root):
        with open(path, encoding="utf-8") as handle:
            doc = yaml.safe_load(handle)
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise ConfigError(f"{path}: not a {FORMAT} file; remove it or re-run megapipe plan")
        rows.append(_row(path, doc))
    if not rows:
        raise ConfigError(f"no plan.yaml under {root!r}; run `megapipe plan -m ...` first")
    return sorted(rows, key=lambda r: (r["model"], r["cluster"], r["seq_length"], r["plan_dir"]))


def write_tables(rows: list[dict], directory: str) -> list[str]:
    """sweep.csv, plus sweep.parquet when pyarrow is importable; returns the paths written."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    paths = [os.path.join(directory, "sweep.csv")]
    atomic_write_text(paths[0], buffer.getvalue())
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        return paths
    table = pa.Table.from_pylist([{key: row[key] for key in COLUMNS} for row in rows])
    paths.append(os.path.join(directory, "sweep.parquet"))
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    atomic_write_bytes(paths[1], sink.getvalue().to_pybytes())
    return paths
