"""``megapipe validate [RUNS.yaml]``: predicted against measured step time for published runs.

For every run of the data set (megapipe's public runs, or a ``megapipe-runs/1`` file of your own):
the prediction with the runtime in use (``runtime=``, fitted on these runs), the leave-one-out
prediction (the runtime refitted without that run), the uncalibrated one (microbenchmarks alone),
and where the predicted step goes. Settings a source does not state are chosen by the planner on
the uncalibrated model. Writes ``validation.md`` (the table), ``validation.json`` and
``runtime.yaml`` (the fit on every run, a ``hydra_conf/runtime`` file) into the run directory, and
with ``validate.docs=docs/validation.md`` rewrites that file's table. ``validate.ids=[a,b]`` takes
a subset, ``validate.leave_one_out=false`` skips the refits (about a minute for 60 runs).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from dataclasses import dataclass

from omegaconf import DictConfig

from megapipe.commands.common import console, print_json, process_map
from megapipe.config import compose, to_scenario
from megapipe.config.options import output_options
from megapipe.errors import ConfigError
from megapipe.files import atomic_write_text, replace_marked_section
from megapipe.options import OutputOptions
from megapipe.validation.runs import PUBLIC_RUNS, read_runs
from megapipe.records import ClusterSpec, RuntimeSpec
from megapipe.validation.fit import (
    DEFAULT_FIT,
    FIT_FIELDS,
    MOE_FIT,
    RunSet,
    fit_stages,
    leave_one_source_out,
    staged_leave_one_out,
    stages_of,
)
from megapipe.validation.ranking import (
    RankingGroup,
    ablation_markdown,
    ablation_steps,
    ranking_groups,
    ranking_markdown,
)
from megapipe.validation.predict import resolve
from megapipe.validation.report import (
    Row,
    fits_line,
    fits_text,
    loso_intervals,
    markdown_table,
    row_dict,
    runtime_summary,
    runtime_yaml,
    summarise,
)
from megapipe.validation.runs import PublishedRun

__all__ = ["ValidateInputs", "prepare", "run", "DOCS_BEGIN", "DOCS_END", "CONFIG_KEYS"]

CONFIG_KEYS = ("input", "runtime", "validate", "output.format", "output.dir")
"""What `megapipe validate --help` lists (:mod:`megapipe.config.keys`); each run brings its own model and cluster."""

DOCS_BEGIN = "<!-- megapipe validate: begin -->"
DOCS_END = "<!-- megapipe validate: end -->"


@dataclass(frozen=True, slots=True, kw_only=True)
class ValidateInputs:
    runtime: RuntimeSpec
    """The runtime in use (``runtime=``): the fits start from it and the predictions use it."""
    output: OutputOptions
    runs: tuple[PublishedRun, ...]
    clusters: tuple[ClusterSpec, ...]
    """Each run's cluster option as composed (its size is set per run)."""
    fields: tuple[str, ...]
    """Fitted on the dense runs."""
    moe_fields: tuple[str, ...]
    """Fitted on the MoE runs, the dense runs' fields held."""
    leave_one_out: bool
    leave_one_source_out: bool
    docs: str | None
    source: str


def _base_clusters(runs: tuple[PublishedRun, ...], cfg: DictConfig) -> tuple[ClusterSpec, ...]:
    searchpath = list(cfg.hydra.searchpath) if "hydra" in cfg and cfg.hydra.get("searchpath") else []
    extra = [f"hydra.searchpath=[{','.join(searchpath)}]"] if searchpath else []
    found: dict[str, ClusterSpec] = {}
    for run in runs:
        if run.cluster in found:
            continue
        try:
            scenario = to_scenario(compose([f"cluster={run.cluster}", "parallel.tensor_model_parallel_size=1",
                                            "parallel.pipeline_model_parallel_size=1", *extra]))
        except ConfigError:
            raise
        except Exception:
            raise ConfigError(f"run {run.id} names cluster={run.cluster!r}, which is not a cluster option; "
                              "add hydra_conf/cluster/<name>.yaml (or hydra.searchpath) or fix the run") from None
        found[run.cluster] = scenario.cluster
    return tuple(found[run.cluster] for run in runs)


def prepare(cfg: DictConfig) -> ValidateInputs:
    scenario = to_scenario(cfg)
    source = str(cfg.get("input") or PUBLIC_RUNS)
    runs = read_runs(source)
    options = cfg.get("validate") or {}
    ids = list(options.get("ids") or [])
    if ids:
        known = {run.id for run in runs}
        missing = [run_id for run_id in ids if run_id not in known]
        if missing:
            raise ConfigError(f"validate.ids names {missing}, which {source} lacks; use ids from that file")
        runs = tuple(run for run in runs if run.id in set(ids))
    fields = tuple(options.get("fit") or DEFAULT_FIT)
    moe_fields = tuple(MOE_FIT if options.get("fit_moe") is None else options.get("fit_moe"))
    unknown = [name for name in fields + moe_fields if name not in FIT_FIELDS]
    if unknown:
        raise ConfigError(f"validate.fit names {unknown}; fit a subset of {list(FIT_FIELDS)}")
    if len(runs) < len(fields) + (1 if options.get("leave_one_out", True) else 0):
        raise ConfigError(f"{len(runs)} runs cannot fit {len(fields)} runtime fields (and leave one out); "
                          "give more runs or fewer validate.fit fields")
    docs = options.get("docs")
    return ValidateInputs(runtime=scenario.cluster.runtime, output=output_options(cfg), runs=runs,
                          clusters=_base_clusters(runs, cfg), fields=fields, moe_fields=moe_fields,
                          leave_one_out=bool(options.get("leave_one_out", True)),
                          leave_one_source_out=bool(options.get("leave_one_source_out", True)),
                          docs=str(docs) if docs else None,
                          source=source)


class _Progress:
    """Where validate is: a bar per phase on a terminal's stderr, else one line per phase (what a piped run shows)."""

    def __init__(self):
        self._bar = None
        if sys.stderr.isatty():
            from rich.progress import Progress

            self._bar = Progress(transient=True)

    def __enter__(self):
        if self._bar is not None:
            self._bar.__enter__()
        return self

    def __exit__(self, *exc):
        if self._bar is not None:
            self._bar.__exit__(*exc)

    def phase(self, label: str):
        """Start the phase ``label``: its bar's task, or its line when there is no terminal (None)."""
        if self._bar is None:
            print(f"validate: {label}", file=sys.stderr, flush=True)
            return None
        return self._bar.add_task(label, total=None)

    def mapper(self, mapper, label: str):
        """``mapper`` whose results advance the phase ``label`` (each call adds its items to the total)."""
        task = self.phase(label)

        def mapped(function, items):
            items = list(items)
            if task is None:
                return list(mapper(function, items))
            self._bar.update(task, total=(self._bar.tasks[task].total or 0) + len(items))
            out = []
            for result in mapper(function, items):
                out.append(result)
                self._bar.advance(task)
            return out
        return mapped


def _rows(job: ValidateInputs) -> tuple[list[Row], RuntimeSpec, RuntimeSpec]:
    with process_map(len(job.runs)) as mapper:
        with _Progress() as progress:
            resolved = progress.mapper(mapper, f"resolving {len(job.runs)} runs")(
                _resolve, list(zip(job.runs, job.clusters)))
            runs = RunSet(resolved, job.clusters)
            in_use = job.runtime
            stages = stages_of(resolved, dense=job.fields, moe=job.moe_fields)
            progress.phase("fitting the runtime on every run")
            fitted = fit_stages(runs, start=in_use, stages=stages)
            loo = staged_leave_one_out(runs, start=fitted, stages=stages,
                                       mapper=progress.mapper(mapper, "leave-one-run-out refits")) \
                if job.leave_one_out else (None,) * len(runs)
            loso = leave_one_source_out(runs, start=fitted, stages=stages,
                                        mapper=progress.mapper(mapper, "leave-one-source-out refits"),
                                        neutral=RuntimeSpec(name=in_use.name)) \
                if job.leave_one_source_out else (None,) * len(runs)
    rows = []
    for index, item in enumerate(resolved):
        plan = runs.plan(index, in_use)
        rows.append(Row(resolved=item, predicted_s=plan.step_time_s, loo_s=loo[index], loso_s=loso[index],
                        breakdown=plan.breakdown,
                        uncalibrated_s=runs.plan(index, RuntimeSpec(name=in_use.name)).step_time_s))
    return rows, in_use, fitted


def _resolve(item):
    run, base = item
    return resolve(run, base)


def run(job: ValidateInputs, *, directory: str) -> None:
    rows, in_use, fitted = _rows(job)
    summaries = summarise(rows)
    command = "megapipe validate" + ("" if job.source == PUBLIC_RUNS else f" {os.path.basename(job.source)}")
    ranked = ranking_groups(rows)
    ranked_loso = ranking_groups(rows, predicted=lambda row: row.loso_s) if job.leave_one_source_out else ()
    steps = ablation_steps(rows, predicted=(lambda row: row.loso_s) if job.leave_one_source_out else
                           (lambda row: row.predicted_s))
    table = (markdown_table(rows, summaries, runtime=in_use, command=command)
             + "\nRanking checks (runs of one model on one GPU count within one source, ordered by measured "
             "throughput):\n\n" + ranking_markdown(ranked, loso=ranked_loso)
             + "\nAblation steps (each run against the previous one of its published sequence"
             + (", leave-one-source-out" if job.leave_one_source_out else "") + "):\n\n" + ablation_markdown(steps))
    if job.leave_one_source_out:
        architectures = {run.cluster: base.gpu.architecture for run, base in zip(job.runs, job.clusters)}
        fitted = dataclasses.replace(fitted, step_time_intervals=loso_intervals(rows, architectures))
    runtime_text = runtime_yaml(fitted, comment=(
        f"{fitted.name}: fitted by `{command}` on {len(rows)} runs ({', '.join(job.fields)} on the dense runs; "
        f"{', '.join(job.moe_fields)} on the MoE runs).\n"
        "Copy to hydra_conf/runtime/ to plan with it."))
    atomic_write_text(os.path.join(directory, "validation.md"), table)
    atomic_write_text(os.path.join(directory, "runtime.yaml"), runtime_text)
    result = {
        "runs": [row_dict(row) for row in rows],
        "summary": [dataclasses.asdict(summary) for summary in summaries],
        "runtime_in_use": runtime_summary(in_use),
        "runtime_fitted": runtime_summary(fitted),
        "fitted_fields": list(job.fields),
        "files": [os.path.join(directory, name) for name in ("validation.md", "validation.json", "runtime.yaml")],
    }
    atomic_write_text(os.path.join(directory, "validation.json"), json.dumps(result, indent=2) + "\n")
    if job.docs:
        replace_marked_section(job.docs, begin=DOCS_BEGIN, end=DOCS_END, body=table)
    if job.output.json:
        print_json(result)
        return
    _print(rows, summaries, in_use=in_use, fitted=fitted, directory=directory, docs=job.docs,
           ranked=ranked, ranked_loso=ranked_loso)


def _print(rows, summaries, *, in_use: RuntimeSpec, fitted: RuntimeSpec, directory: str, docs: str | None,
           ranked: tuple[RankingGroup, ...] = (), ranked_loso: tuple[RankingGroup, ...] = ()) -> None:
    from rich.table import Table

    out = console(soft_wrap=True)
    table = Table(title="predicted against measured step time")
    for column in ("run", "GPUs", "prec", "fits", "measured s", "predicted s", "error", "LOSO", "LOO", "uncalibrated",
                   "largest parts"):
        table.add_column(column, justify="left" if column in ("run", "largest parts") else "right")
    for row in rows:
        run = row.resolved.run
        parts = sorted(row.breakdown, key=lambda item: -item[1])[:3]
        total = sum(ms for _, ms in row.breakdown) or 1.0
        table.add_row(run.id, f"{run.num_gpus:,} {run.cluster}", run.precision, fits_text(row), f"{row.measured_s:.3g}",
                      f"{row.predicted_s:.3g}", f"{row.error:+.1%}",
                      "" if row.loso_error is None else f"{row.loso_error:+.1%}",
                      "" if row.loo_error is None else f"{row.loo_error:+.1%}", f"{row.uncalibrated_error:+.1%}",
                      ", ".join(f"{name} {ms / total:.0%}" for name, ms in parts))
    out.print(table)
    out.print(fits_line(rows), markup=False)
    for item in summaries:
        loso = "" if item.mean_abs_loso_error is None else (
            f"leave-one-source-out |error| mean {item.mean_abs_loso_error:.1%} max {item.max_abs_loso_error:.1%}; ")
        loo = "" if item.mean_abs_loo_error is None else (f"leave-one-run-out mean {item.mean_abs_loo_error:.1%} "
                                                          f"max {item.max_abs_loo_error:.1%}; ")
        out.print(f"{item.group:>12}: {item.runs:3d} runs, {loso}{loo}fitted on all: mean {item.mean_abs_error:.1%} "
                  f"max {item.max_abs_error:.1%} (uncalibrated mean {item.mean_abs_uncalibrated_error:.1%})",
                  markup=False)
    for label, groups in (("fitted runtime", ranked), ("leave-one-source-out", ranked_loso)):
        if not groups:
            continue
        held = sum(group.holds for group in groups)
        out.print(f"ranking ({label}): {held} of {len(groups)} groups in the measured order", markup=False)
        for group in groups:
            if not group.holds:
                pairs = "; ".join(f"{fast} measured faster than {slow}" for fast, slow in group.inverted)
                out.print(f"  inverted in {group.source} ({group.model}, {group.num_gpus} GPUs, tau "
                          f"{group.tau:+.2f}): {pairs}", markup=False)
    out.print(f"runtime in use: {runtime_summary(in_use)}", markup=False)
    out.print(f"fitted on these runs: {runtime_summary(fitted)}", markup=False)
    out.print(f"files: {directory}/validation.md, validation.json, runtime.yaml" +
              (f"; table written into {docs}" if docs else ""), markup=False)
