"""Predicted against measured: one row per run, the summary, the Markdown table and the runtime file.

Pure: records in, text and numbers out; ``megapipe validate`` prints and writes them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from megapipe.plan.interval import interval_key, intervals_from_errors
from megapipe.records import RuntimeSpec
from megapipe.validation.predict import Resolved

__all__ = ["Row", "Summary", "summarise", "markdown_table", "runtime_yaml", "row_dict", "TOP_PARTS", "loso_intervals"]

TOP_PARTS = 3
"""Breakdown parts shown per run in the table (the largest)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Row:
    resolved: Resolved
    predicted_s: float
    """With the runtime in use (fitted on every run)."""
    loo_s: float | None
    """With the runtime fitted without this run; None when leave-one-out was skipped."""
    loso_s: float | None = None
    """With the runtime fitted without every run of this run's source; None when skipped."""
    uncalibrated_s: float
    """With the uncalibrated runtime: the microbenchmarks alone."""
    breakdown: tuple[tuple[str, float], ...]
    """Where the predicted step goes, ms."""

    @property
    def measured_s(self) -> float:
        return self.resolved.run.step_time_s

    @property
    def error(self) -> float:
        return self.predicted_s / self.measured_s - 1

    @property
    def loo_error(self) -> float | None:
        return None if self.loo_s is None else self.loo_s / self.measured_s - 1

    @property
    def loso_error(self) -> float | None:
        return None if self.loso_s is None else self.loso_s / self.measured_s - 1

    @property
    def uncalibrated_error(self) -> float:
        return self.uncalibrated_s / self.measured_s - 1


@dataclass(frozen=True, slots=True, kw_only=True)
class Summary:
    group: str
    runs: int
    mean_abs_error: float
    max_abs_error: float
    mean_abs_loo_error: float | None
    max_abs_loo_error: float | None
    mean_abs_uncalibrated_error: float
    mean_abs_loso_error: float | None = None
    """Leave-one-source-out: the headline figure (what a new source can expect)."""
    max_abs_loso_error: float | None = None


def _group(rows: Sequence[Row], label: str) -> Summary:
    errors = [abs(row.error) for row in rows]
    loo = [abs(row.loo_error) for row in rows if row.loo_error is not None]
    loso = [abs(row.loso_error) for row in rows if row.loso_error is not None]
    return Summary(group=label, runs=len(rows), mean_abs_error=sum(errors) / len(errors), max_abs_error=max(errors),
                   mean_abs_loo_error=sum(loo) / len(loo) if loo else None, max_abs_loo_error=max(loo) if loo else None,
                   mean_abs_uncalibrated_error=sum(abs(row.uncalibrated_error) for row in rows) / len(rows),
                   mean_abs_loso_error=sum(loso) / len(loso) if loso else None,
                   max_abs_loso_error=max(loso) if loso else None)


def summarise(rows: Sequence[Row]) -> tuple[Summary, ...]:
    """All runs; dense and MoE where both appear; then per precision, then per cluster. Steps of an optimisation
    sequence measured with software their source later fixed (``step_only``) are compared step to step instead."""
    rows = [row for row in rows if not row.resolved.run.step_only]
    unmodelled = [row for row in rows if row.resolved.run.model.not_modelled]
    rows = [row for row in rows if not row.resolved.run.model.not_modelled]
    out = [_group(rows, "all")] if rows else []
    moe = [row for row in rows if row.resolved.run.model.is_moe]
    if moe and len(moe) < len(rows):
        out.append(_group([row for row in rows if not row.resolved.run.model.is_moe], "dense"))
        out.append(_group(moe, "moe"))
    if unmodelled:  # the model has features megapipe neither costs nor emits (GPT-OSS's sinks, Llama 4's NoPE)
        out.append(_group(unmodelled, "unmodelled model features"))
    for key in ("precision", "cluster"):
        for value in sorted({getattr(row.resolved.run, key) for row in rows}):
            out.append(_group([row for row in rows if getattr(row.resolved.run, key) == value], value))
    return tuple(out)


def loso_intervals(rows: Sequence[Row], architectures: dict[str, str]) -> tuple[tuple[str, float, float], ...]:
    """The step-time intervals of :mod:`megapipe.plan.interval` from the rows' leave-one-source-out errors
    (``architectures``: each run's cluster option to its GPU generation); steps and models with unmodelled
    features left out."""
    errors = [(interval_key(moe=row.resolved.run.model.is_moe, architecture=architectures[row.resolved.run.cluster],
                            precision=row.resolved.run.precision), row.loso_error)
              for row in rows if row.loso_error is not None and not row.resolved.run.step_only
              and not row.resolved.run.model.not_modelled]
    return intervals_from_errors(errors)


def _pct(value: float | None) -> str:
    return "" if value is None else f"{value:+.1%}"


def _abs_pct(value: float | None) -> str:
    return "" if value is None else f"{value:.1%}"


def _parts(row: Row) -> str:
    total = sum(ms for _, ms in row.breakdown) or 1.0
    largest = sorted(row.breakdown, key=lambda item: -item[1])[:TOP_PARTS]
    return ", ".join(f"{name} {ms / total:.0%}" for name, ms in largest if ms > 0)


def _settings(row: Row) -> str:
    par, train = row.resolved.parallel, row.resolved.train
    text = (f"{par.tensor_model_parallel_size}/{par.pipeline_model_parallel_size}/"
            f"{par.data_parallel_size}/{par.context_parallel_size}/{par.virtual_pipeline_model_parallel_size} "
            f"mbs {train.micro_batch_size} {train.recompute_granularity.value}")
    return text + (" (step)" if row.resolved.run.step_only else "")


def fits_text(row: Row) -> str:
    """yes, or no with the GiB megapipe's memory model puts the run over its usable memory."""
    over = row.resolved.memory_over_gib
    return "yes" if over == 0 else ("no plan" if math.isinf(over) else f"no (+{over:.1f} GiB)")


def fits_line(rows: Sequence[Row]) -> str:
    """How many runs, as they ran, fit megapipe's memory model, and which do not."""
    misses = [row.resolved.run.id for row in rows if not row.resolved.fits]
    text = f"memory: {len(rows) - len(misses)} of {len(rows)} runs fit megapipe's memory model as they ran"
    verb = "does" if len(misses) == 1 else "do"
    return text + (f"; {len(misses)} {verb} not: {', '.join(misses)}" if misses else "")


def markdown_table(rows: Sequence[Row], summaries: Sequence[Summary], *, runtime: RuntimeSpec, command: str) -> str:
    """The table docs/validation.md holds: the summary, then one line per run."""
    lines = [
        f"Generated by `{command}`; TP/PP/DP/CP/VP, micro-batch and recompute as run (settings the source does not",
        "state chosen by the planner on the uncalibrated model); fits: whether the run, as it ran, fits megapipe's memory model, "
        "else the GiB it needs beyond usable memory.",
        "",
        "LOSO: refitted without every run of the run's source (the headline: what a new source can expect); "
        "LOO: refitted without the run alone.",
        "",
        "| runs | n | mean \\|LOSO\\| | max \\|LOSO\\| | mean \\|LOO\\| | max \\|LOO\\| | mean \\|error\\| | "
        "max \\|error\\| | uncalibrated mean \\|error\\| |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for item in summaries:
        lines.append(f"| {item.group} | {item.runs} | {_abs_pct(item.mean_abs_loso_error)} | "
                     f"{_abs_pct(item.max_abs_loso_error)} | {_abs_pct(item.mean_abs_loo_error)} | "
                     f"{_abs_pct(item.max_abs_loo_error)} | {item.mean_abs_error:.1%} | {item.max_abs_error:.1%} | "
                     f"{item.mean_abs_uncalibrated_error:.1%} |")
    lines += ["", "Runtime fitted on every run: " + runtime_summary(runtime) + ".", "", fits_line(rows) + ".", "",
              "| run | source | GPUs | precision | settings | fits | measured s | predicted s | error | LOSO error | "
              "LOO error | uncalibrated | largest parts |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        run = row.resolved.run
        lines.append(f"| {run.id} | {run.set} | {run.num_gpus:,} {run.cluster} | {run.precision} | {_settings(row)} | "
                     f"{fits_text(row)} | {row.measured_s:.3g} | {row.predicted_s:.3g} | {_pct(row.error)} | {_pct(row.loso_error)} | "
                     f"{_pct(row.loo_error)} | {_pct(row.uncalibrated_error)} | {_parts(row)} |")
    return "\n".join(lines) + "\n"


def runtime_summary(runtime: RuntimeSpec) -> str:
    gemm = ", ".join(f"{arch} {value:.3f}" for arch, value in runtime.gemm_efficiency_by_architecture)
    attention = ", ".join(f"{arch} {value:.3f}" for arch, value in runtime.attention_efficiency_by_architecture)
    return (f"GEMM scale {gemm or runtime.gemm_efficiency_scale}, attention scale "
            f"{attention or runtime.attention_efficiency_scale}, step overhead {runtime.step_overhead_ms:.1f} ms, "
            f"per-microbatch overhead {runtime.microbatch_overhead_ms:.3f} ms, collectives scale "
            f"{runtime.comm_efficiency_scale:.3f}, host {runtime.host_kernel_us:.1f} us per kernel ("
            + ", ".join(f"{cpu} {value:.1f}" for cpu, value in runtime.host_kernel_us_by_cpu) + ") and "
            f"{runtime.host_sync_us:.0f} us per sync, dropless MoE imbalance {runtime.moe_dropless_imbalance:.2f}")


def runtime_yaml(runtime: RuntimeSpec, *, comment: str) -> str:
    """The fitted runtime as a ``hydra_conf/runtime`` file (the same keys and order as megatron_core.yaml)."""
    lines = [f"# {line}" for line in comment.splitlines()]
    lines += ["defaults: [base_runtime, _self_]", f"name: {runtime.name}"]
    for key in ("microbatch_overhead_ms", "step_overhead_ms", "gemm_efficiency_scale"):
        lines.append(f"{key}: {_number(getattr(runtime, key))}")
    lines.append("gemm_efficiency_by_architecture:" + ("" if runtime.gemm_efficiency_by_architecture else " {}"))
    lines += [f"  {arch}: {_number(value)}" for arch, value in runtime.gemm_efficiency_by_architecture]
    lines.append(f"attention_efficiency_scale: {_number(runtime.attention_efficiency_scale)}")
    lines.append("attention_efficiency_by_architecture:"
                 + ("" if runtime.attention_efficiency_by_architecture else " {}"))
    lines += [f"  {arch}: {_number(value)}" for arch, value in runtime.attention_efficiency_by_architecture]
    lines.append(f"comm_efficiency_scale: {_number(runtime.comm_efficiency_scale)}")
    for key in ("host_kernel_us", "host_sync_us", "moe_dropless_imbalance"):
        lines.append(f"{key}: {_number(getattr(runtime, key))}")
    lines.append("host_kernel_us_by_cpu:" + ("" if runtime.host_kernel_us_by_cpu else " {}"))
    lines += [f"  {cpu}: {_number(value)}" for cpu, value in runtime.host_kernel_us_by_cpu]
    lines.append("step_time_intervals:" + ("" if runtime.step_time_intervals else " {}"))
    lines += [f"  {key}: [{_number(low)}, {_number(high)}]" for key, low, high in runtime.step_time_intervals]
    return "\n".join(lines) + "\n"


def _number(value: float) -> str:
    rounded = float(f"{value:.4g}")
    return repr(rounded) if math.isfinite(rounded) else "0.0"


def row_dict(row: Row) -> dict:
    run = row.resolved.run
    return {
        "id": run.id, "set": run.set, "cluster": run.cluster, "num_gpus": run.num_gpus, "precision": run.precision,
        "measured_step_time_s": row.measured_s, "predicted_step_time_s": round(row.predicted_s, 6),
        "error": round(row.error, 6), "loo_step_time_s": None if row.loo_s is None else round(row.loo_s, 6),
        "loo_error": None if row.loo_error is None else round(row.loo_error, 6),
        "loso_step_time_s": None if row.loso_s is None else round(row.loso_s, 6),
        "loso_error": None if row.loso_error is None else round(row.loso_error, 6),
        "uncalibrated_error": round(row.uncalibrated_error, 6), "fits": row.resolved.fits,
        "chosen": {name: value for name, value in row.resolved.chosen},
        "breakdown_ms": {name: round(ms, 3) for name, ms in row.breakdown},
        "source": run.source,
    }
