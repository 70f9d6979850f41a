"""The profiled units, built from megatron-core: a process group, a one-layer GPTModel and its unit closures.

:func:`megatron_session` sets up (and tears down) the process group and megatron-core's
parallel state, :func:`build_gpt` builds a one-layer ``GPTModel`` with the local layer spec
(``get_gpt_layer_local_spec``), and :func:`gpt_units` wraps its embedding
(``LanguageModelEmbedding``), its one decoder ``TransformerLayer`` and the loss unit (final
norm + ``output_layer`` + ``compute_language_model_loss``) as :class:`megapipe.profile.timing.Unit`
closures that :mod:`megapipe.profile.measure` times. Recompute follows megatron-core: full
recompute keeps only the layer input, selective recomputes the core attention.
torch and megatron-core are imported inside functions.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator

from megapipe.errors import ConfigError
from megapipe.profile.timing import Unit
from megapipe.records import Activation, LayerKind, ModelSpec, ParallelSpec, Recompute, TrainSpec

__all__ = ["megatron_session", "build_gpt", "gpt_units"]


@contextlib.contextmanager
def megatron_session(*, device: str, parallel: ParallelSpec, seed: int) -> Iterator[None]:
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


def build_gpt(*, model: ModelSpec, train: TrainSpec, parallel: ParallelSpec, dtype_name: str, device: str):
    """A one-layer GPTModel: its embedding, decoder.layers[0] and output layer are the profiled units.

    swiglu models are built llama-style (RMSNorm, no linear biases), gelu models GPT-style
    (LayerNorm, biases), as ModelSpec has no separate normalization field.
    """
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
        # megatron-core's own recompute saves CUDA RNG states; on CPU gpt_units applies torch's checkpoint instead.
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


def gpt_units(gpt, *, model: ModelSpec, train: TrainSpec, parallel: ParallelSpec, device: str) -> list[Unit]:
    """Closures that run each unit (embedding, decoder, loss) on fresh inputs of the training shape [s, b, h]."""
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
