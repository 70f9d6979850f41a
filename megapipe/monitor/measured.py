"""A monitored run's ``megapipe-monitor/1`` records read as a :class:`~megapipe.plan.replan.MeasuredRun`.

``megapipe replan`` re-partitions from it; the monitor's own log format is owned here and in
:mod:`megapipe.monitor.jsonl`, so the planner never parses monitor logs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from megapipe.errors import ConfigError
from megapipe.plan.replan import MeasuredRun

__all__ = ["measured_run"]


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values)


def measured_run(records: Sequence[dict], *, skip_steps: int = 1, layout: str | None = None) -> MeasuredRun:
    """The ``megapipe-monitor/1`` records of a run (``read_monitor``) as a MeasuredRun.

    Uses rank 0's ``pipeline`` records with stage times, dropping the first
    ``skip_steps`` (warm-up) when later ones exist. ``layout`` is used when the log
    records none (e.g. from the run's plan.yaml).
    """
    rows = [r for r in records if r.get("kind") == "pipeline" and r.get("stage_forward_ms")]
    if not rows:
        raise ConfigError("the monitor log has no pipeline records with stage times; monitor the run with "
                          "pipeline_model_parallel_size > 1 and the schedule hook on (attach_monitor)")
    if len(rows) > skip_steps:
        rows = rows[skip_steps:]
    count = len(rows[0]["stage_forward_ms"])
    forward, backward = [], []
    for index in range(count):
        values = [(r["stage_forward_ms"][index], r["stage_backward_ms"][index]) for r in rows
                  if len(r["stage_forward_ms"]) == count]
        if not all(_finite(f) and _finite(b) for f, b in values):
            raise ConfigError(f"the monitor log has a missing stage time for layout stage {index}; "
                              "replan from a run whose monitor stayed on")
        forward.append(_mean([f for f, _ in values]))
        backward.append(_mean([b for _, b in values]))
    recorded = {r.get("layout") for r in records if r.get("kind") in ("start", "pipeline") and r.get("layout")}
    if len(recorded) > 1:
        raise ConfigError(f"the monitor log holds several layouts {sorted(recorded)}; replan one run at a time")
    run_layout = recorded.pop() if recorded else layout
    if not run_layout:
        raise ConfigError("the monitor log records no layout; pass it to attach_monitor(layout=...) or keep the "
                          "run's plan.yaml in the run directory")
    pp = len(rows[0].get("stage_peak_bytes") or []) or _start_field(records, "pipeline_model_parallel_size") or count
    steps = [r["step_time_ms"] for r in rows if _finite(r.get("step_time_ms"))]
    return MeasuredRun(
        layout=str(run_layout), pipeline_model_parallel_size=int(pp), stage_forward_ms=tuple(forward),
        stage_backward_ms=tuple(backward), step_time_ms=_mean(steps) if steps else math.nan,
        num_microbatches=_num_microbatches(records, count // int(pp)),
        rank_peak_bytes=_device_peaks(records, rows), num_steps=len(rows),
    )


def _start_field(records: Sequence[dict], key: str):
    for record in records:
        if record.get("kind") == "start" and record.get(key):
            return record[key]
    return None


def _num_microbatches(records: Sequence[dict], num_model_chunks: int) -> int | None:
    counts = {round(r["num_microbatches"]) for r in records
              if r.get("kind") == "rank" and _finite(r.get("num_microbatches"))}
    return counts.pop() if len(counts) == 1 and num_model_chunks == 1 else None


def _device_peaks(records: Sequence[dict], rows: Sequence[dict]) -> tuple[float, ...]:
    """Per-rank peaks when every rank reported a device capacity (GPU); host RSS is not a model figure."""
    ranks = [r for r in records if r.get("kind") == "rank"]
    if not ranks or not all(_finite(r.get("capacity_bytes")) for r in ranks):
        return ()
    peaks = [r.get("stage_peak_bytes") or [] for r in rows]
    if not peaks[0] or not all(_finite(v) for row in peaks for v in row):
        return ()
    return tuple(max(row[i] for row in peaks) for i in range(len(peaks[0])))
