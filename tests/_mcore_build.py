"""Test helper: spawn gloo ranks, build real megatron-core GPTModel chunks on CPU, run its schedule.

Every rank runs ``fn(rank, world_size, *args)`` after joining a gloo process group
(MASTER_ADDR=127.0.0.1, a free port, one thread per rank: two cores thrash
otherwise). Return values travel back through a queue; an exception in any rank
fails the caller with that rank's traceback.

    def body(rank, world_size, layout):
        init_parallel(pipeline_model_parallel_size=2)
        return describe_chunks(build_gpt_chunks(layout=layout, num_layers=4))

    results = spawn_ranks(body, world_size=2, args=("Et*2|t*2L",))
"""

from __future__ import annotations

import os
import queue as queue_module
import socket
import traceback
from collections.abc import Callable, Sequence
from typing import Any

__all__ = [
    "HIDDEN_SIZE",
    "SEQ_LENGTH",
    "VOCAB_SIZE",
    "build_gpt_chunks",
    "describe_chunks",
    "destroy_parallel",
    "free_port",
    "init_parallel",
    "route_cuda_buffers_to_cpu",
    "run_schedule",
    "spawn_ranks",
]

HIDDEN_SIZE = 32
NUM_ATTENTION_HEADS = 2
VOCAB_SIZE = 128
SEQ_LENGTH = 16


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_entry(rank: int, world_size: int, port: int, fn: Callable, args: Sequence, results) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        results.put((rank, True, fn(rank, world_size, *args)))
    except BaseException:  # noqa: BLE001 - reported to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        destroy_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn_ranks(fn: Callable[..., Any], *, world_size: int, args: Sequence[Any] = (), timeout_s: float = 120.0) -> list:
    """Run ``fn`` on ``world_size`` gloo ranks; return the per-rank results in rank order."""
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    results = context.Queue()
    processes = mp.start_processes(
        _rank_entry, args=(world_size, free_port(), fn, tuple(args), results),
        nprocs=world_size, join=False, start_method="spawn",
    )  # fmt: skip
    collected: dict[int, Any] = {}
    try:
        for _ in range(world_size):
            rank, ok, value = results.get(timeout=timeout_s)
            if not ok:
                raise AssertionError(f"rank {rank} failed:\n{value}")
            collected[rank] = value
        processes.join(timeout_s)
    except queue_module.Empty:
        raise AssertionError(f"ranks timed out after {timeout_s} s; got {sorted(collected)}") from None
    finally:
        for process in processes.processes:
            if process.is_alive():
                process.terminate()
    return [collected[rank] for rank in range(world_size)]


def init_parallel(
    *,
    pipeline_model_parallel_size: int,
    virtual_pipeline_model_parallel_size: int | None = None,
    tensor_model_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    expert_tensor_parallel_size: int | None = None,
):
    """megatron-core process groups plus the CPU-safe RNG tracker the model init needs.

    The expert sizes default to no expert parallelism; data parallelism is whatever
    ``world_size`` leaves over (megatron-core's order tp-cp-ep-dp-pp).
    """
    from megatron.core import parallel_state, tensor_parallel

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
        expert_model_parallel_size=expert_model_parallel_size,
        expert_tensor_parallel_size=expert_tensor_parallel_size,
    )
    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


def route_cuda_buffers_to_cpu() -> None:
    """Forward passes allocate megatron-core's global memory buffer on ``torch.cuda.current_device()``.

    On a CPU-only rank that call raises; pointing it at "cpu" is enough for a
    GPTModel forward/backward. Call it inside a spawned rank only.
    """
    import torch

    torch.cuda.current_device = lambda: "cpu"


def destroy_parallel() -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()


def build_gpt_chunks(*, layout: str | None, num_layers: int) -> list:
    """This rank's GPTModel chunks (one per virtual stage), tiny sizes, local layer spec.

    ``layout=None`` builds Megatron's default equal split.
    """
    import torch
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    pp = parallel_state.get_pipeline_model_parallel_world_size()
    vp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    config = TransformerConfig(
        num_layers=num_layers, hidden_size=HIDDEN_SIZE, num_attention_heads=NUM_ATTENTION_HEADS,
        use_cpu_initialization=True, pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vp,
        pipeline_model_parallel_layout=layout, pipeline_dtype=torch.float32, params_dtype=torch.float32,
        hidden_dropout=0.0, attention_dropout=0.0,
    )  # fmt: skip
    chunks = []
    for vp_stage in range(vp or 1):
        stage = vp_stage if vp else None
        chunks.append(
            GPTModel(
                config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB_SIZE,
                max_sequence_length=SEQ_LENGTH,
                pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
                post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
                vp_stage=stage,
            )  # fmt: skip
        )
    return chunks


def describe_chunks(chunks: list) -> dict:
    """What this rank built: per vp_stage the global (1-based) decoder layer numbers, embedding, output layer."""
    from megatron.core import parallel_state

    return {
        "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
        "chunks": [
            {
                "layer_numbers": [layer.layer_number for layer in chunk.decoder.layers],
                "has_embedding": getattr(chunk, "embedding", None) is not None,
                "has_output_layer": getattr(chunk, "output_layer", None) is not None,
            }
            for chunk in chunks
        ],
    }


def _cpu_factory_mode():
    """A TorchFunctionMode that turns ``device="cuda"`` factory kwargs into cpu (schedules.py allocates on cuda).

    ``Tensor.cuda()`` returns the tensor itself: with MTP, megatron-core's
    ``setup_embeddings_and_output_layer`` moves the embedding copy with ``.cuda()``
    before all-reducing it, which fails with "Torch not compiled with CUDA enabled".
    """
    import torch
    from torch.overrides import TorchFunctionMode

    class CpuFactories(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is torch.Tensor.cuda:
                return args[0]
            kwargs = dict(kwargs or {})
            if "cuda" in str(kwargs.get("device", "")):
                kwargs["device"] = "cpu"
            return func(*args, **kwargs)

    return CpuFactories()


def _token_batches(micro_batch_size: int):
    import torch

    generator = torch.Generator().manual_seed(0)
    while True:
        yield torch.randint(VOCAB_SIZE, (micro_batch_size, SEQ_LENGTH + 1), generator=generator)


def _forward_step(data_iterator, model):
    import torch

    tokens = next(data_iterator)
    position_ids = torch.arange(SEQ_LENGTH).expand(tokens.shape[0], -1)
    mask = torch.ones(1, 1, SEQ_LENGTH, SEQ_LENGTH).triu(1).bool()
    output = model(tokens[:, :-1], position_ids, mask, labels=tokens[:, 1:])

    def loss_func(output_tensor):
        loss = output_tensor.float().mean()
        return loss, {"loss": loss.detach()}

    return output, loss_func


def run_schedule(chunks: list, *, num_microbatches: int, micro_batch_size: int = 2) -> list[float]:
    """One training step's forward/backward through megatron-core's own pipeline schedule.

    ``get_forward_backward_func()`` picks 1F1B or interleaved 1F1B from parallel_state.
    Returns the last stage's per-microbatch losses (already divided by
    num_microbatches, as Megatron reports them); other ranks return [].
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    route_cuda_buffers_to_cpu()
    for chunk in chunks:
        chunk.config.batch_p2p_sync = False
    with _cpu_factory_mode():
        losses = get_forward_backward_func()(
            forward_step_func=_forward_step, data_iterator=[_token_batches(micro_batch_size) for _ in chunks],
            model=chunks, num_microbatches=num_microbatches, seq_length=SEQ_LENGTH,
            micro_batch_size=micro_batch_size, forward_only=False,
        )  # fmt: skip
    return [float(item["loss"]) for item in losses]
