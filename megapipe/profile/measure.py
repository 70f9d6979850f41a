"""Measured profiling: time and weigh megatron-core's real layers on the current device.

One pipeline unit of each kind is built with megatron-core's local layer spec
(``get_gpt_layer_local_spec``) inside a one-layer ``GPTModel``
(:mod:`megapipe.profile.gpt_units`): the embedding
(``LanguageModelEmbedding``), ONE decoder ``TransformerLayer`` and the loss unit
(final norm + ``output_layer`` + ``compute_language_model_loss``). Every decoder layer
of a dense GPT is identical, so the decoder entry is replicated ``num_layers`` times
(recorded in the profile's meta as ``decoder_replicated``).

Per unit: forward ms, backward ms, the weight-gradient part of backward (W in
zero-bubble schedules, Qi et al. 2024), activation bytes kept per in-flight
microbatch and parameter bytes. The weight-gradient part is measured, not assumed:
backward is timed once with trainable weights (B + W) and once with frozen weights,
where megatron-core's ``LinearWithFrozenWeight`` and autograd compute only input
gradients (B); W = (B + W) - B.

This module and ``megapipe.monitor`` are the only torch users; torch and megatron-core
are imported inside functions so the pure core stays importable without them.
"""

from __future__ import annotations

import datetime
import platform
import statistics
from collections.abc import Callable

from megapipe.cost.params import bytes_per_parameter
from megapipe.errors import ConfigError
from megapipe.options import MEASURE_DTYPES, MeasureOptions
from megapipe.records import Profile
from megapipe.profile.gpt_units import build_gpt, gpt_units, megatron_session
from megapipe.profile.timing import UnitResult, clock_name, measure_unit, spread
from megapipe.records import LayerCost, LayerKind, ModelSpec, ParallelSpec, TrainSpec

__all__ = ["measure_profile"]



def measure_profile(
    *,
    model: ModelSpec,
    train: TrainSpec,
    parallel: ParallelSpec = ParallelSpec(),
    options: MeasureOptions = MeasureOptions(),
    device_name: str | None = None,
    on_unit: Callable[[str], None] | None = None,
) -> Profile:
    """Measure embedding, one decoder layer and the loss unit; return a megapipe-profile/1 record.

    ``device_name`` names the profile's device (e.g. the cluster's GPU name); the torch
    device name is used when None. ``on_unit`` is called with each unit's name before it
    is measured (the CLI drives a progress bar with it).
    """
    import torch

    _check_supported(model, parallel)
    device = _resolve_device(options.device)
    dtype_name = options.dtype or train.precision
    if dtype_name not in MEASURE_DTYPES:
        raise ConfigError(f"train.precision={dtype_name!r}; use one of {', '.join(MEASURE_DTYPES)}")
    threads = torch.get_num_threads()
    torch.set_num_threads(options.num_threads or threads)
    try:
        with megatron_session(device=device, parallel=parallel, seed=options.seed):
            gpt = build_gpt(model=model, train=train, parallel=parallel, dtype_name=dtype_name, device=device)
            results = {}
            for unit in gpt_units(gpt, model=model, train=train, parallel=parallel, device=device):
                if on_unit is not None:
                    on_unit(unit.name)
                results[unit.name] = measure_unit(unit, device=device, warmup=options.warmup, iters=options.iters)
            num_threads, clock = torch.get_num_threads(), clock_name(device)
    finally:
        torch.set_num_threads(threads)
    layers = _layer_costs(results, model=model, parallel=parallel, dtype_name=dtype_name)
    meta = _meta(results, model=model, train=train, parallel=parallel, options=options,
                 device=device, dtype_name=dtype_name)
    meta["timing"] = f"median of iters; {clock}"
    if device == "cpu":
        meta["num_threads"] = str(num_threads)
    return Profile(layers=layers, device=device_name or _torch_device_name(device), meta=tuple(meta.items()))


def _check_supported(model: ModelSpec, parallel: ParallelSpec) -> None:
    if model.mtp_num_layers:
        raise ConfigError(
            f"model.mtp_num_layers={model.mtp_num_layers}: multi-token-prediction layers are not profiled; "
            "profile with model.mtp_num_layers=0"
        )
    if parallel.context_parallel_size != 1:
        raise ConfigError(
            f"parallel.context_parallel_size={parallel.context_parallel_size}: profiling runs without context "
            "parallelism; set it to 1 for the profile"
        )


def _resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device='cuda' but torch sees no CUDA device; use device=cpu")
    return device


def _torch_device_name(device: str) -> str:
    import torch

    if device == "cuda":
        return torch.cuda.get_device_name()
    return f"cpu:{platform.machine()}"


def _median(values: tuple[float, ...]) -> float:
    return float(statistics.median(values)) if values else 0.0


def _layer_costs(results: dict[str, UnitResult], *, model: ModelSpec, parallel: ParallelSpec,
                 dtype_name: str) -> tuple:
    # The cost model's per-parameter accounting (mixed-precision Adam, distributed optimizer shards).
    per_param = bytes_per_parameter(precision=dtype_name, parallel=parallel)

    def cost(name: str, kind: LayerKind, result: UnitResult) -> LayerCost:
        bwd_ms = _median(result.bwd_ms)
        if result.bwd_input_ms:
            wgrad_ms = min(max(bwd_ms - _median(result.bwd_input_ms), 0.0), bwd_ms)
        else:  # the embedding has no input gradient: its whole backward is the weight gradient
            wgrad_ms = bwd_ms
        return LayerCost(
            name=name,
            kind=kind,
            fwd_ms=_median(result.fwd_ms),
            bwd_ms=bwd_ms,
            wgrad_ms=wgrad_ms,
            static_bytes=result.param_count * per_param,
            act_bytes=result.act_bytes,
            param_count=result.param_count,
        )

    decoder = results["decoder"]
    return (
        cost("embedding", LayerKind.embedding, results["embedding"]),
        *(cost(f"decoder.{index}", LayerKind.decoder, decoder) for index in range(model.num_layers)),
        cost("loss", LayerKind.loss, results["loss"]),
    )


def _meta(results, *, model, train, parallel, options, device, dtype_name) -> dict[str, str]:
    import megatron.core
    import torch

    meta = {
        "source": "megapipe profile (megatron-core local layer spec)",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch_device": _torch_device_name(device),
        "torch_version": torch.__version__,
        "megatron_core_version": getattr(megatron.core, "__version__", "unknown"),
        "model": model.name,
        "num_layers": model.num_layers,
        "decoder_replicated": f"1 measured TransformerLayer replicated {model.num_layers} times",
        "hidden_size": model.hidden_size,
        "num_attention_heads": model.num_attention_heads,
        "num_query_groups": model.num_query_groups,
        "ffn_hidden_size": model.ffn_hidden_size,
        "vocab_size": model.vocab_size,
        "activation": model.activation.value,
        "kv_channels": model.head_dim,
        "untie_embeddings_and_output_weights": model.untie_embeddings_and_output_weights,
        "position_embedding_type": model.position_embedding_type,
        "attention_backend": "unfused",
        "attention": "megatron-core local DotProductAttention (keeps the s x s scores)",
        "seq_length": train.seq_length,
        "micro_batch_size": train.micro_batch_size,
        "recompute_granularity": train.recompute_granularity.value,
        "dtype": dtype_name,
        "tensor_model_parallel_size": parallel.tensor_model_parallel_size,
        "sequence_parallel": parallel.sequence_parallel,
        "warmup": options.warmup,
        "iters": options.iters,
        "wgrad_method": "bwd(trainable weights) - bwd(frozen weights)",
        "act_bytes_method": "distinct storages saved for backward (saved_tensors_hooks), parameters excluded",
    }
    for name, result in results.items():
        meta[f"{name}.fwd_ms_p10_p90"] = spread(result.fwd_ms)
        meta[f"{name}.bwd_ms_p10_p90"] = spread(result.bwd_ms)
        if result.cuda_peak_bytes is not None:
            meta[f"{name}.cuda_peak_bytes"] = f"{result.cuda_peak_bytes:.6g}"
    return {key: str(value) for key, value in meta.items()}
