"""Test helper: real megatron-core mixture-of-experts GPTModel chunks on CPU/gloo, under its own schedule.

Builds this rank's GPTModel chunks (one per virtual stage) from a
``pipeline_model_parallel_layout`` string with expert parallelism, describes what
was built, and runs one forward/backward step through
``get_forward_backward_func()``. Everything here runs inside a rank spawned by
``_mcore_build.spawn_ranks`` after ``init_parallel(..., expert_model_parallel_size=...)``::

    def body(rank, world_size, layout):
        init_parallel(pipeline_model_parallel_size=2, expert_model_parallel_size=2)
        with moe_cpu_shims():
            chunks = build_moe_gpt_chunks(layout=layout, num_layers=6, num_moe_experts=4,
                                          moe_router_topk=2, moe_ffn_hidden_size=32)
            losses = run_moe_schedule(chunks, num_microbatches=4)
        return describe_moe_chunks(chunks), losses, gradient_report(chunks)

    spawn_ranks(body, world_size=4, args=("Et*2|t*4L",))

Layer specs come from ``get_gpt_decoder_block_spec(config, use_transformer_engine=False,
vp_stage=...)``: in megatron-core 0.16.1 it is the only spec helper that honours
``moe_layer_freq`` per global layer (``get_gpt_layer_local_spec(num_experts=...)``
makes every layer MoE). The MTP block spec comes from ``get_gpt_mtp_block_spec``;
a chunk whose layout stage holds MTP but no decoder layer has an empty local layer
list, so the spec of the model's last decoder layer is passed instead (MTP follows
the last decoder layer, so that is the layer an MTP layer copies).

Test-only shims (``moe_cpu_shims``; megatron-core 0.16.1 without CUDA or
Transformer Engine; each one is switched off by name with ``disable=`` and undone
on exit):

``cuda_stream``
    ``MoEAlltoAllTokenDispatcher.__init__`` creates ``torch.cuda.Stream()``
    (``RuntimeError: torch.cuda.Stream requires CUDA support``) and
    ``_maybe_dtoh_and_synchronize`` uses ``torch.cuda.current_stream``,
    ``torch.cuda.stream`` and ``Stream.record_event``. token_dispatcher.py alone
    sees a ``torch`` whose ``cuda`` has inert stream and event objects.
``te_general_gemm``
    ``RouterGatingLinearFunction.forward``/``backward`` (moe/moe_utils.py) test
    ``te_general_gemm is not None``, a name bound only when Transformer Engine
    imports: ``NameError: name 'te_general_gemm' is not defined`` on the first
    router forward. The shim binds it to None in moe_utils.
``split_sizes``
    ``_maybe_dtoh_and_synchronize`` turns the all-to-all split sizes into numpy
    with ``maybe_move_tensor_to_cpu(..., as_numpy=True)``, which converts only
    ``.is_cuda`` tensors; CPU tensors reach gloo's ``all_to_all_single`` and raise
    ``TypeError: all_to_all_single(): incompatible function arguments``. The shim
    wraps token_dispatcher's ``maybe_move_tensor_to_cpu`` so CPU tensors become
    numpy arrays when ``as_numpy`` is asked, as CUDA tensors would.
``cuda_calls``
    ``torch.cuda.current_device()`` returns ``"cpu"`` (the router moves its weight
    there, megatron-core's global buffers and p2p receive buffers allocate there),
    and ``_mcore_build._cpu_factory_mode`` turns ``device="cuda"`` kwargs into cpu
    and ``Tensor.cuda()`` into the tensor itself (with MTP on a later stage
    ``setup_embeddings_and_output_layer`` calls ``weight.data.cuda()``:
    ``AssertionError: Torch not compiled with CUDA enabled``).

Also needed, as in the dense harness: ``initialize_rng_tracker(inference_rng_tracker=True)``
(``init_parallel``), ``config.batch_p2p_sync = False`` (``run_schedule``).

Not needed at TP=1 and therefore not installed: a sequence-parallel tolerant norm
(TP>1 MoE needs sequence parallelism, and the local ``WrappedTorchNorm`` asserts
``not sequence_parallel``) and the multi-latent-attention fixes (the local
``DotProductAttention`` takes no ``k_channels``/``v_channels``;
``multi_latent_attention.HAVE_TE`` is wrongly True without TE); this harness
builds neither (``multi_latent_attention=True`` raises NotImplementedError).
The reported "view modified in place after ``_ReduceFromModelParallelRegion``"
failure did not appear in these builds (PP2 x EP2, TP1, shared expert, MTP,
alltoall and allgather dispatchers), so no shim exists for it.
"""

from __future__ import annotations

import contextlib
import math
import types
from collections.abc import Iterable, Iterator
from typing import Any

from _mcore_build import SEQ_LENGTH, VOCAB_SIZE, _cpu_factory_mode, run_schedule

__all__ = [
    "SHIMS",
    "build_moe_gpt_chunks",
    "describe_moe_chunks",
    "gradient_report",
    "moe_cpu_shims",
    "run_moe_schedule",
]

SHIMS = ("cuda_stream", "te_general_gemm", "split_sizes", "cuda_calls")

HIDDEN_SIZE = 32
NUM_ATTENTION_HEADS = 4
FFN_HIDDEN_SIZE = 64

_active_depth = 0


class _InertEvent:
    def synchronize(self) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass


class _InertStream:
    """Stands in for ``torch.cuda.Stream``: CPU work is already ordered."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> _InertEvent:
        return _InertEvent()

    def synchronize(self) -> None:
        pass


def _torch_with_inert_streams():
    """A stand-in ``torch`` module: everything is torch's except ``cuda``'s stream API."""
    import torch

    current = _InertStream()
    cuda = types.ModuleType("torch.cuda")
    cuda.__getattr__ = lambda name: getattr(torch.cuda, name)  # module __getattr__ (PEP 562)
    cuda.Stream = _InertStream
    cuda.Event = _InertEvent
    cuda.current_stream = lambda device=None: current
    cuda.stream = lambda stream=None: contextlib.nullcontext()

    proxy = types.ModuleType("torch")
    proxy.__getattr__ = lambda name: getattr(torch, name)
    proxy.cuda = cuda
    return proxy


@contextlib.contextmanager
def _patched(target: Any, name: str, value: Any) -> Iterator[None]:
    missing = object()
    previous = getattr(target, name, missing) if name in vars(target) else missing
    setattr(target, name, value)
    try:
        yield
    finally:
        if previous is missing:
            delattr(target, name)
        else:
            setattr(target, name, previous)


@contextlib.contextmanager
def moe_cpu_shims(*, disable: Iterable[str] = ()) -> Iterator[None]:
    """Install the test-only shims of this module's docstring; ``disable`` names ones to leave out."""
    import torch
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    disable = set(disable)
    unknown = disable - set(SHIMS)
    if unknown:
        raise ValueError(f"unknown shims {sorted(unknown)}; known: {SHIMS}")
    global _active_depth
    with contextlib.ExitStack() as stack:
        if "cuda_stream" not in disable:
            stack.enter_context(_patched(token_dispatcher, "torch", _torch_with_inert_streams()))
            # A class attribute, created once by the first alltoall dispatcher: drop the inert one on exit.
            stack.enter_context(_patched(token_dispatcher.MoEAlltoAllTokenDispatcher, "cuda_dtoh_stream", None))
        if "te_general_gemm" not in disable and not hasattr(moe_utils, "te_general_gemm"):
            stack.enter_context(_patched(moe_utils, "te_general_gemm", None))
        if "split_sizes" not in disable:
            original = token_dispatcher.maybe_move_tensor_to_cpu

            def splits_to_host(tensor, as_numpy=False, record_stream=False):
                moved = original(tensor, as_numpy=as_numpy, record_stream=record_stream)
                if as_numpy and torch.is_tensor(moved):
                    moved = moved.numpy()
                return moved

            stack.enter_context(_patched(token_dispatcher, "maybe_move_tensor_to_cpu", splits_to_host))
        if "cuda_calls" not in disable:
            stack.enter_context(_patched(torch.cuda, "current_device", lambda: "cpu"))
            stack.enter_context(_cpu_factory_mode())
        _active_depth += 1
        try:
            yield
        finally:
            _active_depth -= 1


def _require_shims(what: str) -> None:
    if not _active_depth:
        raise RuntimeError(f"{what} must run inside `with moe_cpu_shims():` on CPU")


def build_moe_gpt_chunks(
    *,
    layout: str | None,
    num_layers: int,
    num_moe_experts: int,
    moe_router_topk: int,
    moe_ffn_hidden_size: int,
    moe_layer_freq: list[int] | int = 1,
    moe_shared_expert_intermediate_size: int | None = None,
    mtp_num_layers: int | None = None,
    dispatcher: str = "alltoall",
    multi_latent_attention: bool = False,
    moe_aux_loss_coeff: float = 1e-2,
    hidden_size: int = HIDDEN_SIZE,
    num_attention_heads: int = NUM_ATTENTION_HEADS,
    ffn_hidden_size: int = FFN_HIDDEN_SIZE,
    seed: int = 1234,
) -> list:
    """This rank's MoE GPTModel chunks (one per virtual stage): local specs, fp32, tiny sizes.

    Parallel sizes come from megatron-core's parallel_state (``init_parallel``).
    ``layout=None`` is Megatron's default equal split. ``seed`` seeds torch's CPU
    generator before the build, so equal seeds give equal weights on equal ranks.
    Call inside ``moe_cpu_shims()``. megatron-core's aux-loss tracker is a module
    global sized by the first model's layer count; it is emptied here so that one
    process can build models of several depths.
    """
    import torch
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    get_moe_layer_wise_logging_tracker().clear()
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_decoder_layer_specs,
        get_gpt_mtp_block_spec,
    )
    from megatron.core.transformer.transformer_config import TransformerConfig

    _require_shims("build_moe_gpt_chunks")
    if multi_latent_attention:
        raise NotImplementedError("MLA needs further CPU shims (see the module docstring); not built here")
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp > 1:
        raise NotImplementedError("TP>1 MoE needs sequence parallelism and an SP-tolerant norm; not built here")
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    vp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    config = TransformerConfig(
        num_layers=num_layers, hidden_size=hidden_size, num_attention_heads=num_attention_heads,
        ffn_hidden_size=ffn_hidden_size, use_cpu_initialization=True,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vp,
        expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
        expert_tensor_parallel_size=parallel_state.get_expert_tensor_parallel_world_size(),
        pipeline_model_parallel_layout=layout, pipeline_dtype=torch.float32, params_dtype=torch.float32,
        hidden_dropout=0.0, attention_dropout=0.0, add_bias_linear=False,
        num_moe_experts=num_moe_experts, moe_router_topk=moe_router_topk, moe_ffn_hidden_size=moe_ffn_hidden_size,
        moe_layer_freq=moe_layer_freq, moe_shared_expert_intermediate_size=moe_shared_expert_intermediate_size,
        moe_grouped_gemm=False, moe_token_dispatcher_type=dispatcher,
        moe_router_load_balancing_type="aux_loss" if moe_aux_loss_coeff else "none",
        moe_aux_loss_coeff=moe_aux_loss_coeff, mtp_num_layers=mtp_num_layers,
    )  # fmt: skip
    _refuse_mtp_beside_embedding(config)
    torch.manual_seed(seed)
    chunks = []
    for vp_stage in range(vp or 1):
        stage = vp_stage if vp else None
        block_spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, vp_stage=stage)
        mtp_block_spec = None
        if mtp_num_layers:
            # An MTP-only chunk has no local layer spec; an MTP layer copies the model's last decoder layer.
            source = block_spec if block_spec.layer_specs else get_gpt_decoder_layer_specs(config, False)[-1]
            mtp_block_spec = get_gpt_mtp_block_spec(config, source, use_transformer_engine=False, vp_stage=stage)
        chunks.append(
            GPTModel(
                config=config, transformer_layer_spec=block_spec, vocab_size=VOCAB_SIZE,
                max_sequence_length=SEQ_LENGTH,
                pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
                post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
                mtp_block_spec=mtp_block_spec, vp_stage=stage,
            )  # fmt: skip
        )
    return chunks


def _refuse_mtp_beside_embedding(config) -> None:
    """Raise on every rank, before any collective, for a layout whose build would hang.

    MTP outside the loss stage ("standalone") sits on a pp rank before the last;
    with PP2 that is pp rank 0, which then all-reduces two embedding weights over
    the embedding group at init (the pre-process chunk's and the MTP chunk's copy)
    while the last rank all-reduces one: megatron-core 0.16.1 with its default
    embedding ranks waits forever (seen with "Et*3|t*3|m|L", PP2 x VP2).
    """
    from megatron.core.transformer.enums import LayerType

    layout = config.pipeline_model_parallel_layout
    if layout is None or config.pipeline_model_parallel_size < 2:
        return
    if any(LayerType.mtp in stage for stage in layout.layout[0]):
        raise NotImplementedError(
            "MTP on pipeline rank 0 (a standalone MTP stage) hangs megatron-core 0.16.1's embedding all-reduce "
            "at init; put m in the stage with L"
        )


def _is_expert_param(param) -> bool:
    """Expert-parallel weights carry ``allreduce=False`` (megatron-core skips their DP all-reduce)."""
    return getattr(param, "allreduce", True) is False


def _describe_mlp(mlp) -> dict:
    from megatron.core.transformer.moe.moe_layer import MoELayer

    if not isinstance(mlp, MoELayer):
        return {"is_moe": False, "num_local_experts": 0, "local_expert_indices": [], "has_shared_expert": False}
    experts = mlp.experts
    return {
        "is_moe": True,
        "num_local_experts": len(experts.local_experts) if hasattr(experts, "local_experts") else experts.num_local_experts,
        "local_expert_indices": list(mlp.local_expert_indices),
        "has_shared_expert": mlp.shared_experts is not None,
    }


def describe_moe_chunks(chunks: list) -> dict:
    """What this rank built, as plain picklable data.

    ``chunks[i]["layers"]`` lists the decoder layers (global 1-based ``layer_number``,
    whether MoE, local expert count and their global indices, shared expert);
    ``mtp_layers`` the same for each MTP layer's transformer layer.
    """
    from megatron.core import parallel_state

    described = []
    for chunk in chunks:
        mtp = getattr(chunk, "mtp", None)
        params = list(chunk.parameters())
        described.append({
            "layer_numbers": [layer.layer_number for layer in chunk.decoder.layers],
            "layers": [{"layer_number": layer.layer_number, **_describe_mlp(layer.mlp)} for layer in chunk.decoder.layers],
            "has_embedding": chunk.pre_process and getattr(chunk, "embedding", None) is not None,  # E, not MTP's copy
            "has_output_layer": getattr(chunk, "output_layer", None) is not None,
            "has_mtp": mtp is not None,
            "num_mtp_layers": len(mtp.layers) if mtp is not None else 0,
            "mtp_layers": [_describe_mlp(layer.transformer_layer.mlp) for layer in mtp.layers] if mtp is not None else [],
            "expert_param_count": sum(p.numel() for p in params if _is_expert_param(p)),
            "dense_param_count": sum(p.numel() for p in params if not _is_expert_param(p)),
        })  # fmt: skip
    return {
        "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
        "ep_rank": parallel_state.get_expert_model_parallel_rank(),
        "ep_size": parallel_state.get_expert_model_parallel_world_size(),
        "dp_rank": parallel_state.get_data_parallel_rank(),
        "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
        "chunks": described,
    }


def run_moe_schedule(chunks: list, *, num_microbatches: int, micro_batch_size: int = 2) -> list[float]:
    """One forward/backward step through ``get_forward_backward_func()`` (``_mcore_build.run_schedule``).

    Every rank reads the same token batches. Returns the last stage's
    per-microbatch losses (divided by num_microbatches); other ranks return [].
    Call inside ``moe_cpu_shims()``.
    """
    _require_shims("run_moe_schedule")
    return run_schedule(chunks, num_microbatches=num_microbatches, micro_batch_size=micro_batch_size)


def gradient_report(chunks: list) -> dict:
    """After backward: counts and names of expert / dense parameters with missing or non-finite grads."""
    report = {kind: {"params": 0, "with_grad": 0, "missing": [], "nonfinite": [], "abs_sum": 0.0}
              for kind in ("expert", "dense")}  # fmt: skip
    for index, chunk in enumerate(chunks):
        for name, param in chunk.named_parameters():
            entry = report["expert" if _is_expert_param(param) else "dense"]
            entry["params"] += 1
            if param.grad is None:
                entry["missing"].append(f"{index}.{name}")
                continue
            entry["with_grad"] += 1
            total = float(param.grad.abs().sum())
            if not math.isfinite(total):
                entry["nonfinite"].append(f"{index}.{name}")
            else:
                entry["abs_sum"] += total
    return report
