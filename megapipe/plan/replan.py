"""Re-partition from a measured run: attribute measured stage times to layers, solve again, decide.

Pure: monitor records (parsed JSON dicts) and profiles in, records out; no torch, no I/O.

Attribution. A run measures one forward and one backward time per layout stage
(per microbatch, mean over logged steps), not per layer. Each stage's measured
time is split over the stage's profile entries in proportion to the profile's own
times (Megatron layer order, ``parse_layout``), so for every stage

    sum(corrected fwd_ms of its entries) * time_scale == measured forward ms

and the ratios between entries of one stage are the profile's. ``wgrad_ms`` is
scaled with ``bwd_ms`` (it is a part of it). A stage whose profile time is zero
gets its measured time split evenly. When the run reports device memory (GPU
runs), each pipeline rank's static and activation bytes are scaled by the same
factor, so the corrected profile predicts the measured peak of each rank under
the schedule's in-flight counts; host RSS (CPU runs) is not a model figure and
is left alone.

Decision. The old layout and the newly solved one are both simulated on the
corrected profile with the run's schedule; the gain is ``old / new - 1`` of the
simulated step time. A change is suggested only when the layouts differ and the
gain reaches ``min_gain`` (``search.min_gain``, default 2%): smaller predicted
gains are within the run-to-run noise of measured stage times.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from collections.abc import Sequence
from dataclasses import dataclass

from megapipe.errors import ConfigError
from megapipe.layout import stage_entries
from megapipe.partition import given_split, solve
from megapipe.records import LayerCost, Partition, Profile, StageSpec
from megapipe.schedules import build, spec
from megapipe.simulate import P2PCost, simulate, stage_times

__all__ = ["ATTRIBUTIONS", "MeasuredRun", "Replan", "stage_entries", "kind_factors", "attribute_times",
           "attribute_memory", "replan"]

ATTRIBUTIONS = ("stage", "kind")
"""stage: each stage's time split in proportion to the profile; kind: per-kind factors first (module doc)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class MeasuredRun:
    """What a monitored run measured, per layout stage in Megatron's vp-major order."""

    layout: str
    """The run's pipeline_model_parallel_layout."""
    pipeline_model_parallel_size: int
    stage_forward_ms: tuple[float, ...]
    """Mean forward time per microbatch of each layout stage."""
    stage_backward_ms: tuple[float, ...]
    """Mean backward time (input and weight gradient) per microbatch of each layout stage."""
    step_time_ms: float = math.nan
    """Mean measured step time over the steps used."""
    num_microbatches: int | None = None
    rank_peak_bytes: tuple[float, ...] = ()
    """Peak device memory per pipeline rank (max over steps); empty when the run had no device memory figure."""
    num_steps: int = 0
    """Logged steps averaged (after the warm-up steps dropped)."""

    @property
    def stage_compute_ms(self) -> tuple[float, ...]:
        return tuple(f + b for f, b in zip(self.stage_forward_ms, self.stage_backward_ms))

    @property
    def rank_compute_ms(self) -> tuple[float, ...]:
        """Forward + backward per microbatch on each pipeline rank (its virtual stages summed)."""
        pp = self.pipeline_model_parallel_size
        return tuple(math.fsum(self.stage_compute_ms[rank::pp]) for rank in range(pp))

    @property
    def compute_spread_ms(self) -> float:
        """max - min per-rank compute per microbatch: the imbalance a better layout removes."""
        return max(self.rank_compute_ms) - min(self.rank_compute_ms)


@dataclass(frozen=True, slots=True, kw_only=True)
class Replan:
    corrected: Profile
    """The profile with measured times (and device memory) attributed to its entries."""
    old: Partition
    """The run's layout evaluated on the corrected profile."""
    new: Partition
    """The optimal split of the corrected profile."""
    old_step_ms: float
    """Simulated step time of the old layout on the corrected profile."""
    new_step_ms: float
    gain: float
    """old_step_ms / new_step_ms - 1."""
    min_gain: float
    suggest: bool
    """True when the new layout differs and gain >= min_gain."""
    reason: str


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _spread(layers: Sequence[LayerCost], attr: str, target: float) -> list[float]:
    """``target`` split over ``layers`` in proportion to ``attr`` (evenly when they sum to zero)."""
    total = math.fsum(getattr(layer, attr) for layer in layers)
    if total > 0:
        return [getattr(layer, attr) / total * target for layer in layers]
    return [target / len(layers)] * len(layers)


def kind_factors(profile: Profile, *, entries_per_stage: Sequence[int], attr: str,
                 measured_ms: Sequence[float]) -> dict:
    """Per-kind multipliers ``a`` of ``attr`` closest to 1 that reproduce the measured stage sums (module doc)."""
    kinds = sorted({layer.kind for layer in profile.layers}, key=lambda kind: kind.value)
    matrix = np.zeros((len(entries_per_stage), len(kinds)))
    start = 0
    for stage, count in enumerate(entries_per_stage):
        for layer in profile.layers[start:start + count]:
            matrix[stage, kinds.index(layer.kind)] += getattr(layer, attr)
        start += count
    residual = np.asarray(measured_ms, dtype=float) - matrix.sum(axis=1)
    factors = 1.0 + matrix.T @ np.linalg.pinv(matrix @ matrix.T) @ residual
    return {kind: max(float(factor), 1e-3) for kind, factor in zip(kinds, factors)}


def _by_kind(profile: Profile, counts: Sequence[int], forward: Sequence[float], backward: Sequence[float]) -> Profile:
    fwd = kind_factors(profile, entries_per_stage=counts, attr="fwd_ms", measured_ms=forward)
    bwd = kind_factors(profile, entries_per_stage=counts, attr="bwd_ms", measured_ms=backward)
    layers = tuple(dataclasses.replace(layer, fwd_ms=layer.fwd_ms * fwd[layer.kind],
                                       bwd_ms=layer.bwd_ms * bwd[layer.kind], wgrad_ms=layer.wgrad_ms * bwd[layer.kind])
                   for layer in profile.layers)
    return dataclasses.replace(profile, layers=layers)


def attribute_times(profile: Profile, *, entries_per_stage: Sequence[int], stage_forward_ms: Sequence[float],
                    stage_backward_ms: Sequence[float], stage_time_scale: Sequence[float] | None = None,
                    attribution: str = "stage", corrected_from: str = "measured run") -> Profile:
    """Profile whose entries' times sum, per stage, to the measured ones (divided by the stage's time_scale).

    ``corrected_from`` names the measurements in the profile's meta (the monitor log format).
    """
    if not (len(entries_per_stage) == len(stage_forward_ms) == len(stage_backward_ms)):
        raise ConfigError(f"{len(stage_forward_ms)} measured stages for a layout of {len(entries_per_stage)} stages; "
                          "replan with the monitor log of the run that used this layout")
    if attribution not in ATTRIBUTIONS:
        raise ConfigError(f"attribution={attribution!r} is not known; use one of {', '.join(ATTRIBUTIONS)}")
    scales = tuple(stage_time_scale or (1.0,) * len(entries_per_stage))
    source = profile
    if attribution == "kind":
        profile = _by_kind(profile, entries_per_stage, [f / c for f, c in zip(stage_forward_ms, scales)],
                           [b / c for b, c in zip(stage_backward_ms, scales)])
    layers, start = [], 0
    for stage, count in enumerate(entries_per_stage):
        chunk = profile.layers[start:start + count]
        start += count
        forward = _spread(chunk, "fwd_ms", stage_forward_ms[stage] / scales[stage])
        backward = _spread(chunk, "bwd_ms", stage_backward_ms[stage] / scales[stage])
        for layer, fwd, bwd in zip(chunk, forward, backward):
            share = layer.wgrad_ms / layer.bwd_ms if layer.bwd_ms > 0 else 0.0
            layers.append(dataclasses.replace(layer, fwd_ms=fwd, bwd_ms=bwd, wgrad_ms=min(bwd, share * bwd)))
    meta = {**dict(source.meta), "source": "replan", "corrected_from": corrected_from, "attribution": attribution}
    return Profile(layers=tuple(layers), device=profile.device, meta=tuple(meta.items()))


def attribute_memory(profile: Profile, *, old: Partition, rank_peak_bytes: Sequence[float]) -> Profile:
    """Scale each rank's entries' static and activation bytes so ``old`` predicts the measured rank peaks."""
    predicted = old.rank_memory_bytes
    if len(rank_peak_bytes) != len(predicted):
        raise ConfigError(f"{len(rank_peak_bytes)} measured rank peaks for pipeline_model_parallel_size="
                          f"{len(predicted)}; replan with this run's monitor log")
    ranks = old.stage_to_rank or tuple(s % old.pipeline_model_parallel_size for s in range(len(old.entries_per_stage)))
    layers, start = [], 0
    for stage, count in enumerate(old.entries_per_stage):
        want, have = rank_peak_bytes[ranks[stage]], predicted[ranks[stage]]
        factor = want / have if have > 0 else 1.0
        for layer in profile.layers[start:start + count]:
            layers.append(dataclasses.replace(layer, static_bytes=layer.static_bytes * factor,
                                              act_bytes=layer.act_bytes * factor))
        start += count
    return dataclasses.replace(profile, layers=tuple(layers))


def _step_ms(profile: Profile, part: Partition, stages: Sequence[StageSpec], schedule, p2p: P2PCost) -> float:
    times = stage_times(layers=profile.layers, entries_per_stage=part.entries_per_stage,
                        stage_to_rank=schedule.stage_to_rank, specs=stages)
    return simulate(schedule, times, p2p=p2p).step_time_ms


def replan(profile: Profile, run: MeasuredRun, *, stages: Sequence[StageSpec], schedule: str, num_microbatches: int,
           p2p: P2PCost = P2PCost(), min_gain: float = 0.02,
           microbatch_group_size_per_vp_stage: int | None = None, attribution: str = "stage",
           corrected_from: str = "measured run") -> Replan:
    """Correct ``profile`` with ``run``'s measurements, solve again and decide whether the change is worth it.

    ``stages``: one StageSpec per pipeline rank (:mod:`megapipe.placement`), placed as the run was.
    """
    if not (_finite(min_gain) and min_gain >= 0):
        raise ConfigError(f"search.min_gain={min_gain!r} must be a number >= 0 (0.02 = 2%)")
    pp = len(stages)
    if run.pipeline_model_parallel_size != pp:
        raise ConfigError(f"the run used pipeline_model_parallel_size={run.pipeline_model_parallel_size} but "
                          f"{pp} pipeline stages were given; replan with the run's parallel sizes")
    counts = stage_entries(profile, run.layout)
    if len(counts) % pp:
        raise ConfigError(f"layout {run.layout!r} has {len(counts)} stages, not a multiple of "
                          f"pipeline_model_parallel_size={pp}")
    ranks = spec(schedule).stage_to_rank(pipeline_model_parallel_size=pp, num_stages=len(counts))
    scales = [stages[rank].time_scale for rank in ranks]
    corrected = attribute_times(profile, entries_per_stage=counts, stage_forward_ms=run.stage_forward_ms,
                                stage_backward_ms=run.stage_backward_ms, stage_time_scale=scales,
                                attribution=attribution, corrected_from=corrected_from)
    old = given_split(corrected, stages, entries_per_stage=counts, num_microbatches=num_microbatches, schedule=schedule)
    if run.rank_peak_bytes:
        corrected = attribute_memory(corrected, old=old, rank_peak_bytes=run.rank_peak_bytes)
        old = given_split(corrected, stages, entries_per_stage=counts, num_microbatches=num_microbatches,
                          schedule=schedule)
    vp = len(counts) // pp
    new = solve(corrected, stages, num_microbatches=num_microbatches, schedule=schedule,
                virtual_pipeline_model_parallel_size=vp,
                microbatch_group_size_per_vp_stage=microbatch_group_size_per_vp_stage)
    order = build(schedule, pipeline_model_parallel_size=pp, num_microbatches=num_microbatches,
                  virtual_pipeline_model_parallel_size=vp,
                  microbatch_group_size_per_vp_stage=microbatch_group_size_per_vp_stage)
    old_ms = _step_ms(corrected, old, stages, order, p2p)
    new_ms = _step_ms(corrected, new, stages, order, p2p)
    gain = old_ms / new_ms - 1.0 if new_ms > 0 else 0.0
    if new.layout == old.layout:
        suggest, reason = False, "the run's layout is already optimal for the measured costs"
    elif gain < min_gain:
        suggest, reason = False, (f"predicted gain {gain:+.1%} is below search.min_gain={min_gain:.1%} "
                                  "(measurement noise); keep the current layout")
    else:
        suggest, reason = True, f"predicted gain {gain:+.1%} >= search.min_gain={min_gain:.1%}"
    return Replan(corrected=corrected, old=old, new=new, old_step_ms=old_ms, new_step_ms=new_ms, gain=gain,
                  min_gain=min_gain, suggest=suggest, reason=reason)
