"""Chrome / Perfetto trace of a simulated step (opens in ui.perfetto.dev or chrome://tracing).

Trace Event Format: one complete event (``"ph": "X"``) per op with ``ts``/``dur``
in microseconds, ``pid`` 0 and ``tid`` = pipeline rank, plus metadata events that
name the process and the rank threads. Keys are sorted and floats rounded, so the
same result gives the same bytes.
"""

from __future__ import annotations

import json

from megapipe.files import atomic_write_text
from megapipe.simulate import SimResult

__all__ = ["trace_events", "trace_json", "write_trace"]

_CATEGORY = {"F": "forward", "B": "backward", "I": "backward_input", "W": "backward_weight"}


def trace_events(result: SimResult) -> list[dict]:
    schedule = result.schedule
    events: list[dict] = [
        {"ph": "M", "pid": 0, "tid": 0, "name": "process_name", "args": {"name": f"megapipe {schedule.name}"}}
    ]
    for rank in range(len(schedule.orders)):
        events.append({"ph": "M", "pid": 0, "tid": rank, "name": "thread_name", "args": {"name": f"rank {rank}"}})
        events.append({"ph": "M", "pid": 0, "tid": rank, "name": "thread_sort_index", "args": {"sort_index": rank}})
    for rank, (order, starts, ends) in enumerate(zip(schedule.orders, result.start_ms, result.end_ms)):
        for action, start, end in zip(order, starts, ends):
            events.append({
                "ph": "X", "pid": 0, "tid": rank, "name": str(action), "cat": _CATEGORY[action.kind.value],
                "ts": round(start * 1e3, 3), "dur": round((end - start) * 1e3, 3),
                "args": {"stage": action.stage, "chunk": action.chunk, "microbatch": action.microbatch},
            })
    return events


def trace_json(result: SimResult) -> str:
    document = {"traceEvents": trace_events(result), "displayTimeUnit": "ms"}
    return json.dumps(document, sort_keys=True, separators=(",", ":"))


def write_trace(result: SimResult, path: str) -> str:
    atomic_write_text(path, trace_json(result))
    return path
