"""The training monitor: one framework-free core that the Lightning and Bridge adapters drive.

Plain Megatron-LM::

    from megapipe.monitor.monitor import attach_monitor
    mon = attach_monitor(model_chunks, log_dir=run_dir, plan="plan.yaml",
                         tokens_per_step=global_batch_size * seq_length)
    mon.train_start()                      # every rank: topology check, start records
    for iteration in ...:
        train_step(...)                    # megatron-core's forward_backward_func + optimizer
        mon.step_end(iteration)            # every rank: metrics every ``log_every`` steps
    mon.train_end()

Every ``log_every`` steps the ranks of the pipeline group exchange one row
(validity flag, mean step time, memory peaks) with a single ``all_gather``; the
schedule hook (:func:`megapipe.monitor.attach`, created with the same period)
gathers the per-stage compute in the same step. Rank 0 of the world logs the
aggregates (bubble, memory spread and CV, headroom, tokens/s, TFLOP/s and MFU
with the planner's FLOP convention: :mod:`megapipe.monitor.aggregate`; drift
against the plan).

Faults never reach training: an exception inside the monitor (hook, sink/logger,
gather) is logged once; the faulting rank sends an invalid row at the next
gather, so every rank of the pipeline turns its monitor off in the same step (a
rank that stopped alone would leave the others waiting in the all-gather), and
each says so once. A rank reporting a non-finite figure is left out of that
figure's aggregate and listed in ``nan_ranks``.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

from megapipe.errors import ConfigError
from megapipe.plandir import checked_plan_document, read_plan
from megapipe.monitor.drift import PlanExpectation, advice, drifts, expectation
from megapipe.monitor.aggregate import FAULTED, ROW, VALID, columns_of, finite, flatten, pipeline_fields, rank_fields
from megapipe.monitor.jsonl import JsonlWriter
from megapipe.monitor.memory import sample_memory
from megapipe.monitor.run_layout import layout_string
from megapipe.monitor.throughput import plan_rates
from megapipe.monitor.topology import compare_link, expected_link, measure_neighbours

__all__ = ["TrainingMonitor", "attach_monitor"]

logger = logging.getLogger("megapipe.monitor")

Sink = Callable[[dict, int], None]


def _plan_document(plan: str | dict | None) -> dict | None:
    """A plan.yaml path (or its parsed dict), checked to be a megapipe-plan/1 document; None passes through."""
    if plan is None:
        return None
    return read_plan(plan) if isinstance(plan, str) else checked_plan_document(plan)


class TrainingMonitor:
    """Create with :func:`attach_monitor`; call ``train_start``, ``step_end`` per step, ``train_end``."""

    def __init__(self, *, hook: Any, group: Any, rank: int, pipeline_rank: int, num_gpus: int,
                 log_dir: str | None, log_every: int, plan: PlanExpectation | None,
                 drift_threshold: float, warmup_steps: int, topology_check: bool, topology_threshold: float,
                 topology_budget_s: float, expected_link: dict | None, tokens_per_step: float | None,
                 flops_per_token: float | None, peak_tflops_per_gpu: float | None, layout: str | None,
                 decoder_layers_per_stage: Sequence[int] | None, sinks: Sequence[Sink], run_dir: str | None,
                 link_latency_to_hook: bool = False) -> None:
        self.hook, self.rank, self.pipeline_rank, self.num_gpus = hook, rank, pipeline_rank, num_gpus
        self.plan, self.log_every, self.drift_threshold, self.warmup_steps = plan, log_every, drift_threshold, warmup_steps
        self.tokens_per_step, self.flops_per_token, self.peak_tflops = tokens_per_step, flops_per_token, peak_tflops_per_gpu
        self.layout = layout or (plan.layout if plan else None)
        self.decoder_layers_per_stage = tuple(decoder_layers_per_stage or (plan.decoder_layers_per_stage if plan else ()))
        self.sinks = list(sinks)
        self.enabled, self.messages, self.last_metrics = True, [], {}
        self.links: list = []
        self._group, self._run_dir = group, run_dir or log_dir
        self._topology = (topology_check, topology_threshold, topology_budget_s, expected_link)
        self._link_latency_to_hook = link_latency_to_hook
        self._writer = JsonlWriter(log_dir, rank=rank) if log_dir else None
        self._faulted, self._warned, self._steps, self._logged = False, set(), 0, 0
        self._window_s, self._window_n = 0.0, 0
        self._mark = time.perf_counter()
        self._last_hook_step = -1

    # ---------------------------------------------------------------- messages
    def _say(self, level: int, message: str, *, step: int | None = None) -> None:
        self.messages.append(message)
        logger.log(level, "%s", message)
        if self._writer is not None and self.enabled:
            try:
                self._writer.write("event", self._steps if step is None else step,
                                   {"level": logging.getLevelName(level).lower(), "message": message})
            except Exception:  # the message is already in the log
                pass

    def _fault(self, where: str, exc: BaseException) -> None:
        if not self._faulted:
            logger.error("megapipe monitor: %s failed; the monitor turns off at the next gather, training "
                         "continues", where, exc_info=exc)
        self._faulted = True
        if self._group is None:
            self._turn_off(f"{where} failed on this rank")

    def _turn_off(self, reason: str) -> None:
        if not self.enabled:
            return
        self._say(logging.WARNING, f"megapipe monitor: turned off ({reason}); training continues unmonitored")
        self.enabled = False
        if self.hook is not None:
            try:
                self.hook.detach()
            except Exception:
                pass
        if self._writer is not None:
            self._writer.close()

    # ------------------------------------------------------------------- events
    def train_start(self) -> None:
        """Every rank together: measure the links to pipeline neighbours, write the start record."""
        if not self.enabled:
            return
        try:
            self._check_topology()
            if self._writer is not None:
                self._writer.write("start", 0, self._start_fields())
        except Exception as exc:
            self._fault("train_start", exc)
        self._mark = time.perf_counter()

    def _start_fields(self) -> dict:
        return {
            "pipeline_rank": self.pipeline_rank, "num_gpus": self.num_gpus, "log_every": self.log_every,
            "pipeline_model_parallel_size": self._pipeline_size(), "layout": self.layout,
            "decoder_layers_per_stage": list(self.decoder_layers_per_stage), "tokens_per_step": self.tokens_per_step,
            "flops_per_token": self.flops_per_token, "peak_tflops_per_gpu": self.peak_tflops,
            "num_model_chunks": getattr(self.hook, "num_model_chunks", 1),
            "links": [{"peer": m.peer, "bandwidth_gbytes_per_s": m.bandwidth_gbytes_per_s,
                       "latency_us": m.latency_us, "sizes": list(m.sizes), "one_way_s": list(m.one_way_s)}
                      for m in self.links],
        }

    def _pipeline_size(self) -> int:
        if self._group is None:
            return 1
        import torch.distributed as dist

        return dist.get_world_size(self._group)

    def _check_topology(self) -> None:
        check, threshold, budget_s, forced = self._topology
        if not check or self._group is None:
            return
        import torch.distributed as dist

        device = "cpu"
        if dist.get_backend(self._group) == "nccl":
            import torch

            device = f"cuda:{torch.cuda.current_device()}"
        self.links = measure_neighbours(self._group, budget_s=budget_s, device=device)
        latencies = [link.latency_us for link in self.links if finite(link.latency_us) and link.latency_us >= 0]
        if self._link_latency_to_hook and self.hook is not None and latencies:
            self.hook.p2p_latency_ms = max(latencies) / 1e3  # the simulator's per-message cost
        for link in self.links:
            if link.peer < self.rank:
                continue  # the lower rank of a pair reports it
            want = forced or (expected_link(self.plan.topology, rank=self.rank, peer=link.peer) if self.plan else None)
            message = compare_link(link, expected=want, threshold=threshold) if want else None
            if message:
                self._say(logging.WARNING, message, step=0)

    def step_start(self) -> None:
        """Optional: marks the step's start (else the previous ``step_end`` is the mark)."""
        self._mark = time.perf_counter()

    def step_end(self, iteration: int | None = None, *, tokens: float | None = None) -> dict:
        """Every rank, after each optimizer step. Returns the metrics logged now ({} between logs)."""
        now = time.perf_counter()
        if not self.enabled:
            return {}
        self._steps += 1
        step = self._steps if iteration is None else int(iteration)
        if self._steps > self.warmup_steps or self.warmup_steps == 0:
            self._window_s += now - self._mark
            self._window_n += 1
        self._mark = now
        if tokens is not None:
            self.tokens_per_step = tokens
        if self.hook is not None and not self.hook.enabled:
            self._turn_off("the schedule hook turned itself off")
            return {}
        if self._steps % self.log_every:
            return {}
        try:
            metrics = self._log(step)
        except Exception as exc:
            self._fault("logging", exc)
            metrics = {}
        self._mark = time.perf_counter()  # the gather and the writes are not training time
        return metrics

    def train_end(self) -> None:
        """Restore the timers and close the log (every rank)."""
        if self.enabled and self.hook is not None:
            self.hook.detach()
        if self._writer is not None:
            self._writer.close()
        self.enabled = False

    # ------------------------------------------------------------------ logging
    def _local_row(self) -> list[float]:
        if self._faulted:
            return [FAULTED] + [math.nan] * (len(ROW) - 1)
        step_ms = self._window_s / self._window_n * 1e3 if self._window_n else math.nan
        mem = sample_memory(reset_peak=False)
        return [VALID, step_ms, mem.peak_allocated_bytes, mem.peak_reserved_bytes, mem.rss_bytes, mem.capacity_bytes]

    def _exchange(self, row: list[float]) -> list[list[float]]:
        if self._group is None:
            return [row]
        import torch
        import torch.distributed as dist

        device = "cpu"
        if dist.get_backend(self._group) == "nccl":
            device = f"cuda:{torch.cuda.current_device()}"
        send = torch.tensor(row, dtype=torch.float64, device=device)
        recv = [torch.empty_like(send) for _ in range(dist.get_world_size(self._group))]
        dist.all_gather(recv, send, group=self._group)
        return [t.tolist() for t in recv]

    def _log(self, step: int) -> dict:
        row = self._local_row()
        try:
            rows = self._exchange(row)
        except Exception as exc:
            logger.error("megapipe monitor: the pipeline-group all_gather failed", exc_info=exc)
            self._turn_off("the gather failed")
            return {}
        if any(r[0] != VALID for r in rows):
            self._turn_off("a pipeline rank's monitor failed" if row[0] == VALID else "it failed on this rank")
            return {}
        self._window_s, self._window_n = 0.0, 0
        report = self._fresh_report()
        local = rank_fields(row, report, pipeline_rank=self.pipeline_rank)
        metrics = {f"megapipe/{k}": v for k, v in local.items() if finite(v)}
        if self._writer is not None:
            self._writer.write("rank", step, local)
        if self.rank == 0:
            pipeline = self._pipeline_record(rows, report)
            metrics.update({f"megapipe/{k}": v for k, v in flatten(pipeline).items() if finite(v)})
            if self._writer is not None:
                self._writer.write("pipeline", step, pipeline)
        self._logged += 1
        self.last_metrics = metrics
        for sink in self.sinks:
            sink(metrics, step)
        return metrics

    def _fresh_report(self) -> Any:
        report = getattr(self.hook, "last_report", None)
        if report is None or report.step == self._last_hook_step:
            return None
        self._last_hook_step = report.step
        return report

    def _pipeline_record(self, rows: list[list[float]], report: Any) -> dict:
        columns = columns_of(rows)
        out = pipeline_fields(columns, report, layout=self.layout, decoder_layers_per_stage=self.decoder_layers_per_stage,
                              num_gpus=self.num_gpus, tokens_per_step=self.tokens_per_step,
                              flops_per_token=self.flops_per_token, peak_tflops_per_gpu=self.peak_tflops)
        out["drift"] = self._drift(out, columns)
        return out

    def _drift(self, out: dict, columns: dict) -> dict:
        if self.plan is None:
            return {}
        on_gpu = all(finite(c) for c in columns["capacity_bytes"])
        found = drifts(self.plan, step_time_s=out["step_time_ms"] / 1e3,
                                 bubble_fraction=out.get("bubble_fraction"),
                                 stage_peak_bytes=columns["peak_allocated_bytes"] if on_gpu else None)
        for d in found:
            if d.drift > self.drift_threshold and d.figure not in self._warned:
                self._warned.add(d.figure)
                self._say(logging.WARNING, advice(d, threshold=self.drift_threshold, run_dir=self._run_dir))
        return {d.figure: {"measured": d.measured, "predicted": d.predicted, "drift": d.drift} for d in found}


def _check_arguments(*, log_every: int, warmup_steps: int, drift_threshold: float, topology_threshold: float,
                     topology_budget_s: float) -> None:
    """ConfigError naming the first of attach_monitor's periods and thresholds that is out of range."""
    for name, value, low in (("log_every", log_every, 1), ("warmup_steps", warmup_steps, 0)):
        if not (isinstance(value, int) and value >= low):
            raise ConfigError(f"{name}={value!r} must be an int >= {low}")
    for name, value in (("drift_threshold", drift_threshold), ("topology_threshold", topology_threshold),
                        ("topology_budget_s", topology_budget_s)):
        if not (finite(value) and value > 0):
            raise ConfigError(f"{name}={value!r} must be a number > 0")


def _throughput_figures(document: dict | None, *, tokens_per_step: float | None, flops_per_token: float | None,
           peak_tflops_per_gpu: float | None) -> tuple[float | None, float | None, float | None]:
    """(tokens_per_step, flops_per_token, peak_tflops_per_gpu): the arguments, the plan's figures where unset."""
    rates = plan_rates(document) if document is not None else None
    if rates is not None:  # explicit arguments win over the plan's figures
        tokens_per_step = tokens_per_step or rates.tokens_per_step
        flops_per_token = flops_per_token or rates.flops_per_token
        peak_tflops_per_gpu = peak_tflops_per_gpu or rates.peak_tflops_per_gpu
    return tokens_per_step, flops_per_token, peak_tflops_per_gpu


def _hook_and_group(models: Any, *, pipeline_group: Any, layout: str | None, schedule_hook: bool, log_every: int,
                    expected: PlanExpectation | None, p2p_latency_ms: float | None) -> tuple[Any, Any, str | None]:
    """(schedule hook, pipeline group, layout) for the model chunks: the hook attached unless turned off, the
    layout from the model config when not given; without models, only an explicit group."""
    hook = group = None
    if models is not None:
        from megapipe.monitor.hook import _config_of, _pipeline_group, attach

        config = _config_of(models[0] if isinstance(models, (list, tuple)) else models)
        group = _pipeline_group(config, pipeline_group)
        if layout is None:
            layout = layout_string(getattr(config, "pipeline_model_parallel_layout", None))
        if schedule_hook:
            hook = attach(models, pipeline_group=group if group is not None else None, gather_every=log_every,
                          plan=expected.bubble_fraction if expected else None,
                          p2p_latency_ms=p2p_latency_ms or 0.0)
    elif pipeline_group != "auto":
        group = pipeline_group
    return hook, group, layout


def _ranks(group: Any) -> tuple[int, int, int]:
    """(world rank, rank in the pipeline group, world size); (0, 0, 1) without torch.distributed."""
    rank, pipeline_rank, num_gpus = 0, 0, 1
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        rank, num_gpus = dist.get_rank(), dist.get_world_size()
        pipeline_rank = dist.get_rank(group) if group is not None else 0
    return rank, pipeline_rank, num_gpus


def attach_monitor(models: Any = None, *, log_dir: str | None = None, log_every: int = 10,
                   plan: str | dict | None = None, drift_threshold: float = 0.1, warmup_steps: int = 1,
                   topology_check: bool = True, topology_threshold: float = 0.2, topology_budget_s: float = 2.0,
                   expected_link: dict | None = None, tokens_per_step: float | None = None,
                   flops_per_token: float | None = None, peak_tflops_per_gpu: float | None = None,
                   layout: str | None = None, sinks: Sequence[Sink] = (), run_dir: str | None = None,
                   schedule_hook: bool = True, pipeline_group: Any = "auto",
                   p2p_latency_ms: float | None = None) -> TrainingMonitor:
    """Create the monitor on this rank (call on every rank, before the first step).

    ``models``: the model chunks (or their TransformerConfigs); the schedule hook is
    attached to them with ``gather_every=log_every`` unless ``schedule_hook`` is
    False. ``log_dir``: where ``rank-*.jsonl`` go (None: no file). ``plan``: a
    plan.yaml path or dict for drift and topology checks. ``expected_link``: a
    link record (``kind``, ``bandwidth_gbytes_per_s``, ``latency_us``) that
    overrides the plan's. ``tokens_per_step``, ``flops_per_token`` (e.g.
    ``megapipe.cost.model_flops_per_token(model, seq_length)``) and
    ``peak_tflops_per_gpu`` default to the plan's (global batch x seq_length, its
    model section, its cluster's GPU). ``layout`` defaults to the model config's
    ``pipeline_model_parallel_layout`` (string or Megatron's layout object).
    ``p2p_latency_ms``: the per-message cost the hook's simulator charges; None
    takes the latency the link check measures at ``train_start`` (0 without it).
    """
    _check_arguments(log_every=log_every, warmup_steps=warmup_steps, drift_threshold=drift_threshold,
                     topology_threshold=topology_threshold, topology_budget_s=topology_budget_s)
    document = _plan_document(plan)
    expected = expectation(document) if document is not None else None
    tokens_per_step, flops_per_token, peak_tflops_per_gpu = _throughput_figures(
        document, tokens_per_step=tokens_per_step, flops_per_token=flops_per_token,
        peak_tflops_per_gpu=peak_tflops_per_gpu)
    hook, group, layout = _hook_and_group(models, pipeline_group=pipeline_group, layout=layout,
                                          schedule_hook=schedule_hook, log_every=log_every, expected=expected,
                                          p2p_latency_ms=p2p_latency_ms)
    rank, pipeline_rank, num_gpus = _ranks(group)
    return TrainingMonitor(
        hook=hook, group=group, rank=rank, pipeline_rank=pipeline_rank, num_gpus=num_gpus, log_dir=log_dir,
        log_every=log_every, plan=expected, drift_threshold=float(drift_threshold), warmup_steps=warmup_steps,
        topology_check=topology_check, topology_threshold=float(topology_threshold),
        topology_budget_s=float(topology_budget_s), expected_link=expected_link, tokens_per_step=tokens_per_step,
        flops_per_token=flops_per_token, peak_tflops_per_gpu=peak_tflops_per_gpu, layout=layout,
        decoder_layers_per_stage=None, sinks=sinks, run_dir=run_dir, link_latency_to_hook=p2p_latency_ms is None,
    )
