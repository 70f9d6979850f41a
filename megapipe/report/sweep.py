"""Gather plan dirs (each with a megapipe-plan/1 ``plan.yaml``) into one table, and the sweep jobs that failed.

A Hydra multirun writes one plan dir per job under the sweep dir; :func:`gather` finds
them all, and :func:`write_tables` writes ``sweep.csv`` (and ``sweep.parquet`` when
pyarrow is importable). Rows are sorted by model, cluster and sequence length.
"""

from __future__ import annotations

import csv
import io
import os

from megapipe.errors import ConfigError
from megapipe.units import GIB
from megapipe.files import FAILED_FILE, atomic_write_bytes, atomic_write_text
from megapipe.plandir import PLAN_FILE, read_plan

__all__ = ["COLUMNS", "find_plans", "gather", "write_tables"]

COLUMNS = (
    "model", "cluster", "num_gpus", "seq_length", "global_batch_size", "tensor_model_parallel_size",
    "pipeline_model_parallel_size", "data_parallel_size", "context_parallel_size",
    "virtual_pipeline_model_parallel_size", "micro_batch_size", "recompute_granularity", "schedule",
    "layout", "step_time_s", "tokens_per_s_per_gpu", "mfu", "bubble_fraction", "peak_memory_gib",
    "cost_per_million_tokens", "total_cost", "equal_split_tokens_per_s_per_gpu", "plan_dir",
)


def find_plans(root: str) -> tuple[list[str], list[str]]:
    """Every plan directory under ``root`` and every failed job's directory, sorted."""
    if not os.path.isdir(root):
        raise ConfigError(f"report input {root!r} is not a directory; pass a plan or sweep dir")
    found, failed = [], []
    for directory, _, files in os.walk(root):
        if PLAN_FILE in files:
            found.append(directory)
        elif FAILED_FILE in files:
            failed.append(directory)
    return sorted(found), sorted(failed)


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


def gather(root: str) -> tuple[list[dict], list[dict]]:
    """One row per plan dir under ``root``, and one ``{plan_dir, error}`` per failed job; ConfigError when empty."""
    plans, failures = find_plans(root)
    rows = [_row(os.path.join(directory, PLAN_FILE), read_plan(directory)) for directory in plans]
    failed = []
    for directory in failures:
        with open(os.path.join(directory, FAILED_FILE), encoding="utf-8") as handle:
            failed.append({"plan_dir": directory, "error": handle.read().strip()})
    if not rows and not failed:
        raise ConfigError(f"no plan.yaml under {root!r}; run `megapipe plan -m ...` first")
    return sorted(rows, key=lambda r: (r["model"], r["cluster"], r["seq_length"], r["plan_dir"])), failed


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
