"""Fit the cost model's GPU efficiency fields to measured profiles.

The analytical model predicts each unit's forward and backward time from FLOPs, bytes
and a :class:`~megapipe.records.GpuSpec`. Three of its fields are efficiencies rather
than datasheet figures: ``matmul_efficiency`` (achieved share of peak on large GEMMs),
``kernel_overhead_us`` (fixed time per kernel, which dominates small GEMMs) and
``bandwidth_efficiency`` (achieved share of HBM bandwidth). :func:`fit_gpu` chooses
them to minimise the squared log-ratio of predicted to measured time over every
measured unit (log residuals weigh a 0.1 ms layer like a 100 ms one), by
Levenberg-Marquardt (Marquardt 1963; Nocedal & Wright, *Numerical Optimization*,
sec. 10.3) in free coordinates: the logit of each efficiency, so it stays in (0, 1),
and the logarithm of ``kernel_overhead_us``, so it stays positive. The predictor is a
black box, so the fit follows whatever form the cost model takes.

Pure: no torch, no I/O. The CLI (``megapipe calibrate``) reads profiles and writes the
overlay built by :func:`overlay_yaml`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from megapipe.errors import ProfileError
from megapipe.least_squares import identified, jacobian, levenberg_marquardt
from megapipe.records import (
    Activation,
    AttentionBackend,
    ClusterSpec,
    GpuSpec,
    LayerCost,
    LayerKind,
    LinkSpec,
    ModelSpec,
    NodeGroup,
    ParallelSpec,
    Profile,
    Recompute,
    TrainSpec,
)

__all__ = [
    "FIELDS",
    "Sample",
    "Calibration",
    "Fold",
    "Predictor",
    "sample_from_profile",
    "time_errors",
    "fit_gpu",
    "cross_validate",
    "overlay_yaml",
]

FIELDS = ("matmul_efficiency", "kernel_overhead_us", "bandwidth_efficiency")
_LOOPBACK = LinkSpec(kind="loopback", bandwidth_gbytes_per_s=1e6, latency_us=0.0)
_TIMES = ("fwd_ms", "bwd_ms")


@dataclass(frozen=True, slots=True, kw_only=True)
class Sample:
    """One measured profile and the shapes it was measured with."""

    profile: Profile
    model: ModelSpec
    train: TrainSpec
    parallel: ParallelSpec = ParallelSpec()
    cluster: ClusterSpec | None = None
    """Supplies the tensor-parallel link when TP > 1; None means a single-GPU loopback."""

    @property
    def label(self) -> str:
        return f"{self.model.name} h={self.model.hidden_size} mbs={self.train.micro_batch_size} s={self.train.seq_length}"


Predictor = Callable[[Sample, GpuSpec], Sequence[LayerCost]]
"""Analytical per-unit costs for a sample's shapes on a GPU (embedding, decoders, loss)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Calibration:
    gpu: GpuSpec
    """The input GpuSpec with the fitted fields replaced."""
    identified: tuple[str, ...]
    """Fields the measurements determine; the others keep their prior value."""
    rms_log_error_before: float
    rms_log_error_after: float
    mean_abs_rel_error_before: float
    """Mean |predicted / measured - 1| over units and fwd/bwd, with the prior GpuSpec."""
    mean_abs_rel_error_after: float
    iterations: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Fold:
    """A held-out sample: prediction error with the prior GpuSpec and with one fitted on the others."""

    label: str
    mean_abs_rel_error_before: float
    mean_abs_rel_error_after: float
    gpu: GpuSpec


def _default_predictor(sample: Sample, gpu: GpuSpec) -> Sequence[LayerCost]:
    """megapipe.cost's analytical units; the cluster only supplies the tensor-parallel link."""
    from megapipe.cost import layer_costs

    cluster = sample.cluster or ClusterSpec(
        name="calibration", gpus_per_node=sample.parallel.tensor_model_parallel_size, price_per_gpu_hour=0.0,
        intra_node=_LOOPBACK, inter_node=_LOOPBACK, node_groups=(NodeGroup(gpu=gpu, num_nodes=1),),
    )
    return layer_costs(model=sample.model, gpu=gpu, cluster=cluster, parallel=sample.parallel, train=sample.train).layers


def _pairs(sample: Sample, gpu: GpuSpec, predict: Predictor) -> list[tuple[float, float]]:
    """(predicted, measured) ms for the first unit of each kind, forward and backward."""
    measured = _first_of_each_kind(sample.profile.layers)
    predicted = _first_of_each_kind(tuple(predict(sample, gpu)))
    pairs = []
    for kind, unit in measured.items():
        if kind not in predicted:
            continue
        for key in _TIMES:
            measured_ms = getattr(unit, key)
            if measured_ms > 0:
                pairs.append((getattr(predicted[kind], key), measured_ms))
    return pairs


def _first_of_each_kind(layers: Sequence[LayerCost]) -> dict[LayerKind, LayerCost]:
    first: dict[LayerKind, LayerCost] = {}
    for layer in layers:
        first.setdefault(layer.kind, layer)
    return first


def _log_residuals(samples: Sequence[Sample], gpu: GpuSpec, predict: Predictor) -> np.ndarray:
    values = []
    for sample in samples:
        for predicted_ms, measured_ms in _pairs(sample, gpu, predict):
            if not predicted_ms > 0:
                raise ProfileError(f"{sample.label}: the cost model predicts {predicted_ms} ms; cannot compare in log")
            values.append(math.log(predicted_ms / measured_ms))
    return np.asarray(values, dtype=float)


def time_errors(*, samples: Sequence[Sample], gpu: GpuSpec, predict: Predictor | None = None) -> tuple[float, ...]:
    """predicted / measured - 1 for every measured unit's fwd_ms and bwd_ms."""
    predict = predict or _default_predictor
    return tuple(
        predicted / measured - 1.0 for sample in samples for predicted, measured in _pairs(sample, gpu, predict)
    )


def _to_free(name: str, value: float) -> float:
    """Unconstrained coordinate: logit for efficiencies (kept in (0, 1)), log for kernel_overhead_us."""
    if name == "kernel_overhead_us":
        return math.log(max(value, 1e-6))
    value = min(max(value, 1e-9), 1 - 1e-9)
    return math.log(value / (1 - value))


def _from_free(name: str, theta: float) -> float:
    if name == "kernel_overhead_us":
        return math.exp(theta)
    return 1.0 / (1.0 + math.exp(-theta))


def _with_free(gpu: GpuSpec, fields: Sequence[str], theta: np.ndarray) -> GpuSpec:
    return dataclasses.replace(gpu, **{name: _from_free(name, float(value)) for name, value in zip(fields, theta)})


def fit_gpu(
    *,
    samples: Sequence[Sample],
    gpu: GpuSpec,
    predict: Predictor | None = None,
    fields: Sequence[str] = FIELDS,
    max_iter: int = 200,
) -> Calibration:
    """Least squares on log time over the given GpuSpec fields, starting from ``gpu``'s values.

    Combinations of fields that the measurements do not determine (e.g. bandwidth_efficiency
    when the predictor ignores bandwidth, or matmul_efficiency apart from kernel_overhead_us
    when every GEMM is tiny) keep their prior values and those fields are reported as not
    identified.
    """
    predict = predict or _default_predictor
    unknown = [name for name in fields if name not in FIELDS]
    if unknown:
        raise ProfileError(f"cannot calibrate {unknown}; calibrate a subset of {list(FIELDS)}")
    if not samples:
        raise ProfileError("calibration needs at least one measured profile")
    before = _log_residuals(samples, gpu, predict)
    if before.size == 0:
        raise ProfileError("the profiles hold no positive fwd_ms/bwd_ms to fit; re-profile")
    moving = list(fields)

    def residual(values: np.ndarray) -> np.ndarray:
        return _log_residuals(samples, _with_free(gpu, moving, values), predict)

    theta, iterations = levenberg_marquardt(residual, np.array([_to_free(name, getattr(gpu, name)) for name in moving]),
                                             max_iter=max_iter)
    fitted = _with_free(gpu, moving, theta)
    after = residual(theta)
    determined = identified(jacobian(residual, theta, after), moving)
    return Calibration(
        gpu=fitted,
        identified=tuple(determined),
        rms_log_error_before=float(np.sqrt(np.mean(before**2))),
        rms_log_error_after=float(np.sqrt(np.mean(after**2))),
        mean_abs_rel_error_before=_mean_abs(time_errors(samples=samples, gpu=gpu, predict=predict)),
        mean_abs_rel_error_after=_mean_abs(time_errors(samples=samples, gpu=fitted, predict=predict)),
        iterations=iterations,
    )


def _mean_abs(values: Sequence[float]) -> float:
    return float(np.mean(np.abs(values))) if values else 0.0


def cross_validate(
    *,
    samples: Sequence[Sample],
    gpu: GpuSpec,
    predict: Predictor | None = None,
    fields: Sequence[str] = FIELDS,
) -> tuple[Fold, ...]:
    """Leave one sample out: fit on the rest, predict it; once per sample (needs >= 2)."""
    predict = predict or _default_predictor
    if len(samples) < 2:
        raise ProfileError(f"cross-validation needs >= 2 profiles, got {len(samples)}; measure more shapes")
    folds = []
    for index, held_out in enumerate(samples):
        rest = [sample for position, sample in enumerate(samples) if position != index]
        fitted = fit_gpu(samples=rest, gpu=gpu, predict=predict, fields=fields).gpu
        folds.append(
            Fold(
                label=held_out.label,
                mean_abs_rel_error_before=_mean_abs(time_errors(samples=[held_out], gpu=gpu, predict=predict)),
                mean_abs_rel_error_after=_mean_abs(time_errors(samples=[held_out], gpu=fitted, predict=predict)),
                gpu=fitted,
            )
        )
    return tuple(folds)


def sample_from_profile(profile: Profile, *, source: str = "profile") -> Sample:
    """Rebuild the shapes a ``megapipe profile`` run recorded in the profile's meta."""
    meta = dict(profile.meta)
    try:
        model = ModelSpec(
            name=meta.get("model", "profiled"),
            num_layers=profile.num_decoder_layers,
            hidden_size=int(meta["hidden_size"]),
            num_attention_heads=int(meta["num_attention_heads"]),
            num_query_groups=int(meta["num_query_groups"]),
            ffn_hidden_size=int(meta["ffn_hidden_size"]),
            vocab_size=int(meta["vocab_size"]),
            seq_length=int(meta["seq_length"]),
            activation=Activation(meta.get("activation", "swiglu")),
            untie_embeddings_and_output_weights=meta.get("untie_embeddings_and_output_weights", "True") == "True",
            position_embedding_type=meta.get("position_embedding_type", "rope"),
            attention_backend=AttentionBackend(meta.get("attention_backend", "unfused")),
            kv_channels=int(meta["kv_channels"]) if meta.get("kv_channels") else None,
        )
        train = TrainSpec(
            micro_batch_size=int(meta["micro_batch_size"]),
            global_batch_size=int(meta["micro_batch_size"]),
            seq_length=int(meta["seq_length"]),
            recompute_granularity=Recompute(meta.get("recompute_granularity", "none")),
            precision=meta.get("dtype", "bf16"),
        )
        parallel = ParallelSpec(
            tensor_model_parallel_size=int(meta.get("tensor_model_parallel_size", 1)),
            sequence_parallel=meta.get("sequence_parallel", "False") == "True",
        )
    except (KeyError, ValueError) as exc:
        raise ProfileError(
            f"{source}: meta lacks or garbles {exc}; calibrate with profiles written by `megapipe profile`"
        ) from None
    return Sample(profile=profile, model=model, train=train, parallel=parallel)


def overlay_yaml(calibration: Calibration, *, comment: str = "") -> str:
    """A Hydra overlay (``# @package _global_``) setting the fitted fields of cluster.gpu."""
    lines = ["# @package _global_"]
    lines += [f"# {line}" for line in comment.splitlines() if line]
    lines += ["cluster:", "  gpu:"]
    # repr of a float rounded to 6 digits always has a '.' or 'e-', so YAML reads it back as a float.
    lines += [f"    {name}: {float(f'{getattr(calibration.gpu, name):.6g}')!r}" for name in FIELDS]
    return "\n".join(lines) + "\n"
