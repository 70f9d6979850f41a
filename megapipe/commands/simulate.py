r"""``megapipe simulate``: time one pipeline schedule (or all of them) and draw it.

    megapipe simulate schedule=1f1b parallel.pipeline_model_parallel_size=8 train.num_microbatches=32
    megapipe simulate schedule=all stage_times='[[1,1,1],[1,1,1],[1,1,1],[1,1,1]]' \
        parallel.pipeline_model_parallel_size=4 train.num_microbatches=16

Per-stage times come from ``stage_times`` (one [F, B, W] per layout stage in ms,
B the input-gradient part; or one per rank, split evenly over the rank's chunks),
else from ``profile=FILE`` or the cost model through the optimal partition of the
configured model on the cluster (with the cluster's p2p cost between neighbours).
Prints a summary (a row per schedule for ``schedule=all``) titled with where the
stage times came from (the model on the cluster, a profile, or ``stage_times``), with
the columns explained under it, and where the files went; or, for
``output.format=json``, one JSON object (keyed by schedule for ``schedule=all``).
Writes ``<schedule>_gantt.png`` and ``<schedule>_trace.json`` (Perfetto) into the
output directory unless ``output.pictures=false``.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from omegaconf import DictConfig

from megapipe.commands import painter
from megapipe.commands.common import console, gpus_phrase, pipeline_p2p, print_json, scenario_profile, stage_specs_of, stage_times
from megapipe.config import Scenario, stage_times_of, to_scenario
from megapipe.config.options import output_options
from megapipe.errors import ConfigError, InfeasibleError, MegapipeError
from megapipe.partition import solve
from megapipe.schedules import SCHEDULE_NAMES, Schedule, build, chunks_per_rank, spec
from megapipe.simulate import P2PCost, SimResult, StageTimes, simulate
from megapipe.options import OutputOptions
from megapipe.simulate.bubble import WRITEUP_PERCENT, closed_form_bubble
from megapipe.units import GIB

__all__ = ["SimulateInputs", "prepare", "run", "result_dict", "times_from_triples", "CONFIG_KEYS", "FILES"]

CONFIG_KEYS = ("model", "cluster", "runtime", "parallel", "train", "schedule", "stage_times", "profile",
               "output.format", "output.dir", "output.pictures")
"""What `megapipe simulate --help` lists (:mod:`megapipe.config.keys`)."""
FILES = (("<schedule>_gantt.png", "each simulated schedule's ops, rank by rank over one step"),
         ("<schedule>_trace.json", "the same ops as a Chrome trace: open it in Perfetto (ui.perfetto.dev)"))


@dataclass(frozen=True, slots=True, kw_only=True)
class SimulateInputs:
    scenario: Scenario
    stage_times: tuple | None
    """The per-stage [F, B, W] triples as given (``stage_times=``), checked per schedule."""
    profile_path: str | None
    """``profile=FILE``: the measured layer costs used when no stage times are given."""
    output: OutputOptions


def times_from_triples(triples, *, schedule: Schedule) -> StageTimes:
    """[F, B, W] per layout stage, or per rank split evenly over its chunks (B = input gradient)."""
    try:
        rows = [list(map(float, row)) for row in triples]
    except (TypeError, ValueError):
        rows = [[]]
    if not rows or any(len(row) != 3 for row in rows):
        raise ConfigError(f"stage_times={triples!r} must be a list of [F, B, W] triples in ms")
    for index, row in enumerate(rows):
        for name, value in zip("FBW", row):
            if not (math.isfinite(value) and value >= 0):
                raise ConfigError(f"stage_times[{index}] {name}={value!r} must be a finite number of ms >= 0")
    stages, ranks = schedule.num_stages, schedule.pipeline_model_parallel_size
    if len(rows) == ranks and stages != ranks:
        chunks = stages // ranks
        rows = [[value / chunks for value in rows[schedule.stage_to_rank[stage]]] for stage in range(stages)]
    if len(rows) != stages:
        raise ConfigError(
            f"stage_times has {len(rows)} triples; {schedule.name} with pipeline_model_parallel_size={ranks} "
            f"needs {stages} (one per layout stage) or {ranks} (one per rank)"
        )
    return StageTimes.split(fwd_ms=[r[0] for r in rows], input_grad_ms=[r[1] for r in rows],
                            wgrad_ms=[r[2] for r in rows])


def _model_times(job: SimulateInputs, schedule: Schedule, chunks: int,
                 notes: list[str]) -> tuple[StageTimes, P2PCost]:
    """Stage times of the optimal partition (memory-checked when it fits) and the cluster's p2p cost."""
    profile = scenario_profile(job.scenario, job.profile_path)
    specs = stage_specs_of(job.scenario, pipeline_model_parallel_size=schedule.pipeline_model_parallel_size)
    kwargs = dict(num_microbatches=schedule.num_microbatches, schedule=schedule.name,
                  virtual_pipeline_model_parallel_size=chunks,
                  microbatch_group_size_per_vp_stage=schedule.microbatch_group_size_per_vp_stage)
    try:
        part = solve(profile, list(specs), **kwargs)
    except InfeasibleError as exc:
        notes.append(f"{schedule.name}: does not fit memory ({exc}); timed the time-optimal split")
        part = solve(profile, list(specs), check_memory=False, **kwargs)
    return stage_times(profile, part, specs, schedule.stage_to_rank), pipeline_p2p(job.scenario)


def _chunks(name: str, scenario: Scenario) -> int:
    """A virtual size the user gave is used as given (the builder checks it); otherwise the schedule's own."""
    if "virtual_pipeline_model_parallel_size" in scenario.fixed and scenario.schedule != "all":
        return scenario.parallel.virtual_pipeline_model_parallel_size
    if spec(name).fixed_chunks is None and "virtual_pipeline_model_parallel_size" not in scenario.fixed:
        return 2
    return chunks_per_rank(name, scenario.parallel.virtual_pipeline_model_parallel_size)


def _pipeline_size(job: SimulateInputs) -> int:
    """With ``stage_times`` and no pipeline size given, one triple per rank sets it."""
    if job.stage_times is not None and "pipeline_model_parallel_size" not in job.scenario.fixed:
        return max(1, len(job.stage_times))
    return job.scenario.parallel.pipeline_model_parallel_size


def _simulate_one(name: str, job: SimulateInputs, notes: list[str]) -> SimResult:
    scenario = job.scenario
    chunks = _chunks(name, scenario)
    schedule = build(name, pipeline_model_parallel_size=_pipeline_size(job),
                     num_microbatches=scenario.num_microbatches, virtual_pipeline_model_parallel_size=chunks,
                     microbatch_group_size_per_vp_stage=scenario.parallel.microbatch_group_size_per_vp_stage)
    if job.stage_times is not None:
        return simulate(schedule, times_from_triples(job.stage_times, schedule=schedule))
    times, p2p = _model_times(job, schedule, chunks, notes)
    return simulate(schedule, times, p2p=p2p)


def result_dict(result: SimResult) -> dict:
    """The JSON form of one simulated schedule."""
    schedule = result.schedule
    pp, m = schedule.pipeline_model_parallel_size, schedule.num_microbatches
    closed = closed_form_bubble(schedule.name, pipeline_model_parallel_size=pp, num_microbatches=m,
                                virtual_pipeline_model_parallel_size=schedule.virtual_pipeline_model_parallel_size)
    return {
        "schedule": schedule.name,
        "pipeline_model_parallel_size": pp,
        "virtual_pipeline_model_parallel_size": schedule.virtual_pipeline_model_parallel_size,
        "num_microbatches": m,
        "step_time_ms": round(result.step_time_ms, 6),
        "bubble_fraction": round(result.bubble_fraction, 6),
        "steady_bubble_fraction": round(result.steady_bubble_fraction, 6),
        "closed_form_bubble_equal_stages": None if closed is None else round(closed, 6),
        "writeup_bubble_percent": WRITEUP_PERCENT.get(schedule.name, {}).get(pp),
        "stages": [
            {"rank": r.rank, "busy_ms": round(r.busy_ms, 6), "idle_ms": round(r.idle_ms, 6),
             "bubble_fraction": round(r.bubble_fraction, 6), "peak_in_flight": r.peak_in_flight,
             "peak_activation_bytes": float(round(r.peak_activation_bytes))}
            for r in result.ranks
        ],
        "stage_peak_in_flight": list(result.stage_peak_in_flight),
        "critical_path_ops": len(result.critical_path),
    }


def _write_pictures(result: SimResult, directory: str) -> list[str]:
    from megapipe.report.gantt import gantt_png
    from megapipe.report.trace import write_trace

    os.makedirs(directory, exist_ok=True)
    name = result.schedule.name
    gantt = os.path.join(directory, f"{name}_gantt.png")
    painter.draw(gantt_png, result, gantt)
    return [gantt, write_trace(result, os.path.join(directory, f"{name}_trace.json"))]


def _title(job: SimulateInputs, rows: dict) -> str:
    """What was simulated: the model on the cluster with the sizes its costs depend on, or the stage times given."""
    scenario = job.scenario
    sizes = [row["pipeline_model_parallel_size"] for row in rows.values() if "error" not in row]
    pipeline = f"PP={sizes[0] if sizes else _pipeline_size(job)}, {scenario.num_microbatches} microbatches"
    if job.stage_times is not None:
        return f"megapipe simulate: the stage_times given, {pipeline}"
    par, train, cluster = scenario.parallel, scenario.train, scenario.cluster
    costs = f"profile {job.profile_path}" if job.profile_path else "cost model"
    return (f"megapipe simulate: {scenario.model.name} on {gpus_phrase(cluster)} ({costs}), TP={par.tensor_model_parallel_size} "
            f"CP={par.context_parallel_size} DP={par.data_parallel_size} {pipeline}, micro-batch "
            f"{train.micro_batch_size}, seq_length {train.seq_length:,}, {train.precision}")


def _print_table(job: SimulateInputs, rows: dict, notes: list[str], directory: str) -> None:
    from rich.table import Table

    out = console(soft_wrap=True, width=120)
    table = Table(title=_title(job, rows), title_justify="left")
    for column in ("schedule", "v", "step ms", "bubble", "steady", "closed form", "write-up", "peak in flight",
                   "peak act GiB"):
        table.add_column(column, justify="right")
    for name, row in rows.items():
        if "error" in row:
            table.add_row(name, "", "", "", "", "", "", "", row["error"])
            continue
        closed, writeup = row["closed_form_bubble_equal_stages"], row["writeup_bubble_percent"]
        table.add_row(
            name, str(row["virtual_pipeline_model_parallel_size"]), f"{row['step_time_ms']:.2f}",
            f"{row['bubble_fraction']:.1%}", f"{row['steady_bubble_fraction']:.1%}",
            "-" if closed is None else f"{closed:.1%}", "-" if writeup is None else f"{writeup}%",
            str(max(s["peak_in_flight"] for s in row["stages"])),
            f"{max(s['peak_activation_bytes'] for s in row['stages']) / GIB:.2f}",
        )
    out.print(table)
    out.print("bubble: the share of the step the ranks sit idle (fill, drain, uneven stages); steady: the same within "
              "each rank's own first-to-last-op span; closed form: the papers' formula for equal stages with "
              "F = B = W (- where none is published)", markup=False)
    out.print("write-up: the bubble the write-ups' table prints for this schedule at this many stages (it lists 8 and "
              "32 stages only, - elsewhere, and names no microbatch count: docs/validation.md compares it with the "
              "closed forms)", markup=False)
    for note in notes:
        out.print(f"note: {note}", markup=False)
    files = [os.path.basename(path) for row in rows.values() for path in row.get("files", ())]
    if files:
        out.print(f"files in {directory}: {', '.join(files)} (Gantt charts; the traces open in Perfetto, "
                  "ui.perfetto.dev)", markup=False)


def prepare(cfg: DictConfig) -> SimulateInputs:
    scenario = to_scenario(cfg)
    return SimulateInputs(scenario=scenario, stage_times=stage_times_of(cfg), profile_path=cfg.get("profile"),
                          output=output_options(cfg))


def run(job: SimulateInputs, *, directory: str) -> None:
    scenario = job.scenario
    names = SCHEDULE_NAMES if scenario.schedule == "all" else (scenario.schedule,)
    rows, notes = {}, []
    for name in names:
        try:
            result = _simulate_one(name, job, notes)
        except (InfeasibleError, MegapipeError) as exc:
            if len(names) == 1 or isinstance(exc, ConfigError):
                raise
            rows[name] = {"schedule": name, "error": str(exc)}
            continue
        rows[name] = result_dict(result)
        if job.output.pictures:
            rows[name]["files"] = _write_pictures(result, directory)
    if job.output.json:
        document = rows if len(names) > 1 else rows[names[0]]
        if notes:
            document = {**document, "notes": notes}
        print_json(document)
    else:
        _print_table(job, rows, notes, directory)
