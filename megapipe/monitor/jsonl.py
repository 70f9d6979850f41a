"""The ``megapipe-monitor/1`` JSONL files a monitored run writes, and their reader.

Each rank appends to its own file ``<dir>/rank-<global rank>.jsonl`` (no
interleaving between processes); one JSON object per line, every line with
``format``, ``kind``, ``rank`` and ``step``. Kinds: ``start`` (once per rank at
train start: parallel sizes, layout, measured links), ``rank`` (per rank per
logged step), ``pipeline`` (rank 0 per logged step: the aggregates, per-stage
times and memory, drift against the plan) and ``event`` (warnings, the monitor
turning itself off). Non-finite floats are written as null. The field list is in
docs/monitoring.md.
"""

from __future__ import annotations

import glob
import json
import math
import os
from collections.abc import Iterable
from typing import Any

from megapipe.errors import ConfigError

__all__ = ["FORMAT", "JsonlWriter", "read_monitor", "stage_times", "rank_file"]

FORMAT = "megapipe-monitor/1"
_KIND_ORDER = {"start": 0, "rank": 1, "pipeline": 2, "event": 3}


def _clean(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def rank_file(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank-{rank:05d}.jsonl")


class JsonlWriter:
    """Appends records of one rank; each line is flushed as it is written."""

    def __init__(self, directory: str, *, rank: int) -> None:
        os.makedirs(directory, exist_ok=True)
        self.path = rank_file(directory, rank)
        self._rank = rank
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed by close()

    def write(self, kind: str, step: int, fields: dict) -> None:
        record = {"format": FORMAT, "kind": kind, "rank": self._rank, "step": int(step), **_clean(fields)}
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


def _files(path: str) -> list[str]:
    if os.path.isdir(path):
        files = sorted(glob.glob(os.path.join(path, "rank-*.jsonl")))
        if not files:
            nested = os.path.join(path, "monitor")
            files = sorted(glob.glob(os.path.join(nested, "rank-*.jsonl"))) if os.path.isdir(nested) else []
        if not files:
            raise ConfigError(f"no rank-*.jsonl under {path!r}; pass a run's monitor directory (or the run dir)")
        return files
    if os.path.isfile(path):
        return [path]
    raise ConfigError(f"monitor log {path!r} does not exist; pass a run dir or its monitor/ directory")


def read_monitor(path: str) -> list[dict]:
    """All records of a run (a ``rank-*.jsonl`` file, a monitor dir or the run dir), ordered by step, kind, rank."""
    records = []
    for name in _files(path):
        with open(name, encoding="utf-8") as handle:
            lines = handle.readlines()
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                if number == len(lines):
                    continue  # a last line cut by a killed run
                raise ConfigError(f"{name}:{number} is not JSON; the file is not a megapipe monitor log") from None
            if not isinstance(record, dict) or record.get("format") != FORMAT:
                got = record.get("format") if isinstance(record, dict) else type(record).__name__
                raise ConfigError(f"{name}:{number} has format={got!r}; expected {FORMAT!r}")
            records.append(record)
    records.sort(key=lambda r: (r["step"], _KIND_ORDER.get(r["kind"], 9), r["rank"]))
    return records


def stage_times(records: Iterable[dict], *, skip_steps: int = 1) -> list[list[float]]:
    """Measured ``[F, B, W]`` ms per microbatch per virtual stage (mean over pipeline records), W = 0.

    The form of the ``stage_times`` config key (B includes the weight gradient, as
    megatron-core's non-split backward does). ``skip_steps`` drops the first logged
    steps (warm-up) when later ones exist.
    """
    rows = [r for r in records if r["kind"] == "pipeline" and r.get("stage_forward_ms")]
    steps = sorted({r["step"] for r in rows})
    if len(steps) > skip_steps:
        rows = [r for r in rows if r["step"] >= steps[skip_steps]]
    if not rows:
        raise ConfigError("the monitor log has no pipeline records with stage times; run with pipeline size > 1 "
                          "and the schedule hook on")
    count = len(rows[0]["stage_forward_ms"])
    forward = [sum(r["stage_forward_ms"][i] for r in rows) / len(rows) for i in range(count)]
    backward = [sum(r["stage_backward_ms"][i] for r in rows) / len(rows) for i in range(count)]
    return [[f, b, 0.0] for f, b in zip(forward, backward)]
