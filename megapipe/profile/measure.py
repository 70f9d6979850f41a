"""Measured profiling: time and weigh megatron-core's real layers on the current device.

One pipeline unit of each kind is built with megatron-core's local layer spec
(``get_gpt_layer_local_spec``) inside a one-layer ``GPTModel``: the embedding
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

import contextlib
import datetime
import os
import platform
import statistics
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from megapipe.cost.params import bytes_per_parameter
from megapipe.errors import ConfigError
from megapipe.profile.format import Profile
from megapipe.profile.timing import Unit, UnitResult, clock_name, measure_unit, spread
from megapipe.records import Activation, LayerCost, LayerKind, ModelSpec, ParallelSpec, Recompute, TrainSpec

__all__ = ["MeasureOptions", "measure_profile"]

_DTYPES = ("bf16", "fp16", "fp32")


@dataclass(frozen=True, slots=True, kw_only=True)
class MeasureOptions:
    """How to measure; the model, batch shape and parallel sizes come from the records."""

    device: str = "auto"
    """cpu, cuda or auto (cuda when available)."""
    warmup: int = 2
    """Untimed iterations before timing each unit."""
    iters: int = 5
    """Timed iterations; the profile holds their median, the meta their p10/p90."""
    num_threads: int | None = None
    """torch.set_num_threads for the CPU path; None leaves torch's default."""
    dtype: str | None = None
    """bf16, fp16 or fp32 for weights and activations; None takes train.precision."""
    seed: int = 1234

    def __post_init__(self) -> None:
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"device={self.device!r}; use cpu, cuda or auto")
        if self.warmup < 0 or self.iters < 1:
            raise ConfigError(f"warmup={self.warmup}, iters={self.iters}; use warmup >= 0 and iters >= 1")
        if self.dtype is not None and self.dtype not in _DTYPES:
            raise ConfigError(f"dtype={self.dtype!r}; use one of {', '.join(_DTYPES)}")


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
    if dtype_name not in _DTYPES:
        raise ConfigError(f"train.precision={dtype_name!r}; use one of {', '.join(_DTYPES)}")
    threads = torch.get_num_threads()
    torch.set_num_threads(options.num_threads or threads)
    try:
        with _megatron_session(device=device, parallel=parallel, seed=options.seed):
            gpt = _build_gpt(model=model, train=train, parallel=parallel, dtype_name=dtype_name, device=device)
            results = {}
            for unit in _units(gpt, model=model, train=train, parallel=parallel, device=device):
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


@contextlib.contextmanager
def _megatron_session(*, device: str, parallel: ParallelSpec, seed: int) -> Iterator[None]:
    """A process group and megatron-core's parallel state, torn down afterwards if we made them.

    Under ``torchrun`` the existing group is reused and its world size must equal the
    tensor-parallel size (one profile per TP group); otherwise a 1-rank group is made.
    """
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mcore_random

    tp = parallel.tensor_model_parallel_size
    own_group = not dist.is_initialized()
    if own_group:
        backend = "nccl" if device == "cuda" else "gloo"
        launched = int(os.environ.get("WORLD_SIZE", "1"))
        if launched > 1:  # torchrun: rendezvous through its MASTER_ADDR / MASTER_PORT environment
            dist.init_process_group(backend)
        elif tp != 1:
            raise ConfigError(
                f"parallel.tensor_model_parallel_size={tp} needs {tp} processes; launch with "
                f"`torchrun --nproc-per-node {tp}` or profile with tensor_model_parallel_size=1"
            )
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    if dist.get_world_size() != tp:
        raise ConfigError(
            f"world size {dist.get_world_size()} != parallel.tensor_model_parallel_size={tp}; "
            "launch as many processes as the tensor-parallel size"
        )
    if device == "cuda":
        torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    try:
        with _cpu_current_device(device):
            parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=1)
            if device == "cuda":
                mcore_random.model_parallel_cuda_manual_seed(seed)
            else:
                torch.manual_seed(seed)
                mcore_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
            yield
    finally:
        parallel_state.destroy_model_parallel()
        if own_group:
            dist.destroy_process_group()


@contextlib.contextmanager
def _cpu_current_device(device: str) -> Iterator[None]:
    """On CPU, answer megatron-core's ``torch.cuda.current_device()`` calls (rotary tables) with cpu."""
    import torch

    if device != "cpu":
        yield
        return
    original = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"
    try:
        yield
    finally:
        torch.cuda.current_device = original


def _torch_dtype(dtype_name: str):
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype_name]


def _build_gpt(*, model: ModelSpec, train: TrainSpec, parallel: ParallelSpec, dtype_name: str, device: str):
    """A one-layer GPTModel: its embedding, decoder.layers[0] and output layer are the profiled units.

    swiglu models are built llama-style (RMSNorm, no linear biases), gelu models GPT-style
    (LayerNorm, biases), as ModelSpec has no separate normalization field.
    """
    import torch
    import torch.nn.functional as functional
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    swiglu = model.activation == Activation.swiglu
    normalization = "RMSNorm" if swiglu else "LayerNorm"
    dtype = _torch_dtype(dtype_name)
    recompute = train.recompute_granularity
    config = TransformerConfig(
        num_layers=1,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        ffn_hidden_size=model.ffn_hidden_size,
        kv_channels=model.head_dim,
        gated_linear_unit=swiglu,
        activation_func=functional.silu if swiglu else functional.gelu,
        normalization=normalization,
        add_bias_linear=not swiglu,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        sequence_parallel=parallel.sequence_parallel and parallel.tensor_model_parallel_size > 1,
        use_cpu_initialization=device == "cpu",
        params_dtype=dtype,
        bf16=dtype_name == "bf16",
        fp16=dtype_name == "fp16",
        pipeline_dtype=dtype,
        # megatron-core's own recompute saves CUDA RNG states; on CPU _units applies torch's checkpoint instead.
        recompute_granularity=None if recompute == Recompute.none or device == "cpu" else recompute.value,
        recompute_method="uniform" if recompute == Recompute.full and device != "cpu" else None,
        recompute_num_layers=1 if recompute == Recompute.full and device != "cpu" else None,
    )
    try:
        gpt = GPTModel(
            config=config,
            transformer_layer_spec=get_gpt_layer_local_spec(normalization=normalization),
            vocab_size=model.vocab_size,
            max_sequence_length=train.seq_length,
            position_embedding_type=model.position_embedding_type,
            share_embeddings_and_output_weights=not model.untie_embeddings_and_output_weights,
        )
    except AssertionError as exc:
        if "sequence parallel" in str(exc):
            raise ConfigError(
                "sequence parallelism needs apex or Transformer Engine norms, which this install lacks; "
                "profile with parallel.sequence_parallel=false"
            ) from None
        raise
    # Without apex/TE the norms keep fp32 weights; cast everything so the CPU path runs in one dtype.
    return gpt.to(device=device, dtype=dtype)


def _units(gpt, *, model: ModelSpec, train: TrainSpec, parallel: ParallelSpec, device: str) -> list[Unit]:
    """Closures that run each unit on fresh inputs of the training shape [s, b, h]."""
    import torch

    seq, batch = train.seq_length, train.micro_batch_size
    dtype = gpt.config.params_dtype
    seq_local = seq // parallel.tensor_model_parallel_size if gpt.config.sequence_parallel else seq
    generator = torch.Generator(device="cpu").manual_seed(0)
    input_ids = torch.randint(0, model.vocab_size, (batch, seq), generator=generator).to(device)
    labels = torch.randint(0, model.vocab_size, (batch, seq), generator=generator).to(device)
    position_ids = torch.arange(seq, device=device).unsqueeze(0).expand(batch, -1)
    hidden = torch.randn(seq_local, batch, model.hidden_size, generator=generator).to(device=device, dtype=dtype)
    causal_mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=device), diagonal=1)[None, None]
    rotary = gpt.rotary_pos_emb(seq) if model.position_embedding_type == "rope" else None
    layer = gpt.decoder.layers[0]
    checkpoint = _checkpoint_function(device)
    full_recompute = train.recompute_granularity == Recompute.full
    if train.recompute_granularity == Recompute.selective and device == "cpu":
        _recompute_core_attention(layer)

    def embedding() -> object:
        return gpt.embedding(input_ids=input_ids, position_ids=position_ids)

    def run_layer(hidden_states):
        return layer(hidden_states=hidden_states, attention_mask=causal_mask, rotary_pos_emb=rotary)[0]

    def decoder() -> object:
        hidden_states = hidden.detach().requires_grad_()
        if full_recompute:
            # TransformerBlock's uniform full recompute: keep only the layer input, rerun forward in backward.
            return checkpoint(run_layer, hidden_states)
        return run_layer(hidden_states)

    def loss() -> object:
        hidden_states = hidden.detach().requires_grad_()
        logits, _ = gpt.output_layer(
            gpt.decoder.final_layernorm(hidden_states), weight=_shared_output_weight(gpt)
        )
        return gpt.compute_language_model_loss(labels, logits).mean()

    head_modules = (gpt.decoder.final_layernorm, gpt.output_layer)
    if gpt.share_embeddings_and_output_weights:
        head_modules += (gpt.embedding.word_embeddings,)
    return [
        Unit("embedding", LayerKind.embedding, embedding, (gpt.embedding,), has_input_grad=False),
        Unit("decoder", LayerKind.decoder, decoder, (layer,), has_input_grad=True),
        Unit("loss", LayerKind.loss, loss, head_modules, has_input_grad=True),
    ]


def _checkpoint_function(device: str) -> Callable:
    """Megatron's activation checkpoint on GPU; torch's (same keep-input, rerun-forward semantics) on CPU."""
    if device == "cuda":
        from megatron.core import tensor_parallel

        return lambda function, *args: tensor_parallel.checkpoint(function, False, *args)
    import torch.utils.checkpoint

    return lambda function, *args: torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)


def _recompute_core_attention(layer) -> None:
    """Selective recompute as megatron-core's default recompute_modules=["core_attn"] does it."""
    core = layer.self_attention.core_attention
    forward = core.forward
    checkpoint = _checkpoint_function("cpu")
    core.forward = lambda *args, **kwargs: checkpoint(lambda *inner: forward(*inner, **kwargs), *args)


def _shared_output_weight(gpt):
    return gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights else None


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
