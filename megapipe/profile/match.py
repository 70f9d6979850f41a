"""Check that a measured profile fits the model and cluster it is used for, and rescale it.

A profile is one microbatch of one model shape on one device. Using it for another
shape silently mis-sizes every stage, so shape mismatches are errors. Using it for
another GPU is allowed with a warning and an explicit time scale: the user's, or the
ratio of the two GPUs' bf16 peaks when the profile records the profiled GPU's peak
(meta ``gpu_bf16_tflops``, written by ``megapipe profile``).
"""

from __future__ import annotations

import dataclasses
import warnings

from megapipe.errors import ProfileError
from megapipe.records import Profile
from megapipe.records import GpuSpec, ModelSpec, TrainSpec

__all__ = ["ProfileDeviceWarning", "match_profile", "scale_profile"]

_MODEL_KEYS = ("hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size", "vocab_size")
_TRAIN_KEYS = ("seq_length", "micro_batch_size")


class ProfileDeviceWarning(UserWarning):
    """The profile was measured on another device than the cluster's GPU."""


def match_profile(
    profile: Profile,
    *,
    model: ModelSpec,
    train: TrainSpec | None = None,
    gpu: GpuSpec | None = None,
    time_scale: float | None = None,
) -> Profile:
    """Validate ``profile`` against the model (and batch shape), then scale its times for ``gpu``.

    Raises ProfileError on a layer-count or shape mismatch, or when the device differs,
    no ``time_scale`` is given and the profile does not record its GPU's bf16 peak.
    """
    _check_shape(profile, model=model, train=train)
    if time_scale is not None:
        if not time_scale > 0:
            raise ProfileError(f"time_scale={time_scale} must be > 0 (2.0 = the cluster's GPU is twice as slow)")
        return scale_profile(profile, time_scale)
    if gpu is None or not profile.device or profile.device == gpu.name:
        return profile
    profiled_tflops = dict(profile.meta).get("gpu_bf16_tflops")
    if not profiled_tflops:
        raise ProfileError(
            f"profile device {profile.device!r} differs from the cluster's GPU {gpu.name!r}; "
            "give a time scale (profile time x scale = cluster time) or re-profile on that GPU"
        )
    scale = float(profiled_tflops) / gpu.bf16_tflops
    warnings.warn(
        f"profile measured on {profile.device!r}, cluster GPU is {gpu.name!r}: scaling times by "
        f"{scale:.4g} (bf16 peak {float(profiled_tflops):g} / {gpu.bf16_tflops:g} TFLOP/s)",
        ProfileDeviceWarning,
        stacklevel=2,
    )
    return scale_profile(profile, scale)


def _check_shape(profile: Profile, *, model: ModelSpec, train: TrainSpec | None) -> None:
    if profile.num_decoder_layers != model.num_layers:
        raise ProfileError(
            f"profile has {profile.num_decoder_layers} decoder layers but model {model.name!r} has "
            f"num_layers={model.num_layers}; profile this model (megapipe profile model=...)"
        )
    meta = dict(profile.meta)
    expected = {key: getattr(model, key) for key in _MODEL_KEYS}
    if train is not None:
        expected.update(seq_length=train.seq_length, micro_batch_size=train.micro_batch_size)
    for key, value in expected.items():
        recorded = meta.get(key)
        if recorded is not None and int(float(recorded)) != int(value):
            raise ProfileError(
                f"profile was measured with {key}={recorded} but the run uses {key}={value}; "
                f"re-profile with that {key}"
            )


def scale_profile(profile: Profile, time_scale: float) -> Profile:
    """Multiply every time by ``time_scale`` and record it in meta."""
    layers = tuple(
        dataclasses.replace(
            layer,
            fwd_ms=layer.fwd_ms * time_scale,
            bwd_ms=layer.bwd_ms * time_scale,
            wgrad_ms=layer.wgrad_ms * time_scale,
        )
        for layer in profile.layers
    )
    meta = {**dict(profile.meta), "time_scale": f"{time_scale:.6g}"}
    return Profile(layers=layers, device=profile.device, meta=tuple(meta.items()))
