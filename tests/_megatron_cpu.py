"""Test-only harness: run real megatron-core pipeline schedules on CPU with gloo.

megatron-core 0.16.1 assumes CUDA in a few places of its schedules; this module
installs a small shim so the *real* ``get_forward_backward_func()`` runs on CPU:

* a ``TorchFunctionMode`` rewrites ``device="cuda"`` factory kwargs to cpu
  (schedules.py allocates ``torch.zeros([], device="cuda")``);
* ``torch.cuda.current_device`` returns ``"cpu"`` (p2p receive buffers) and
  ``torch.cuda.synchronize`` is a no-op (megatron's own ``Timer`` calls it);
* ``tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True)``
  (the training tracker needs CUDA RNG states);
* ``config.batch_p2p_sync = False`` and ``torch.set_num_threads(1)`` per rank.

The shim lives in tests only; it is never part of the package.

Typical use (every function below runs inside a spawned rank)::

    def body(rank, world_size):
        with megatron_cpu():
            init_model_parallel(pipeline_model_parallel_size=2)
            models = build_gpt_chunks(layout="Et*2|t*2L", num_layers=4,
                                      delays_ms=UnitDelays(decoder=(2.0, 4.0)))
            run = train_steps(models, num_steps=3, num_microbatches=4)
            return run.losses

    results = run_ranks(body, world_size=2)   # one entry per rank

Stage costs are made deterministic by :class:`UnitDelays`: a custom autograd
Function sleeps a fixed time in forward and in backward after every embedding,
decoder layer and output layer, on top of the real GPT compute, so stage times
are stable on two contended cores.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "UnitDelays",
    "TrainRun",
    "megatron_cpu",
    "free_port",
    "run_ranks",
    "init_model_parallel",
    "destroy_model_parallel",
    "build_gpt_chunks",
    "train_steps",
    "canonical_grads",
    "canonical_name",
    "p2p_latency_ms",
]

VOCAB_SIZE = 64
HIDDEN_SIZE = 16
NUM_ATTENTION_HEADS = 2


@dataclass(frozen=True)
class UnitDelays:
    """Sleep (forward_ms, backward_ms) added per microbatch after each pipeline unit."""

    embedding: tuple[float, float] = (0.0, 0.0)
    decoder: tuple[float, float] = (0.0, 0.0)
    loss: tuple[float, float] = (0.0, 0.0)
    """Charged on the output layer (the vocab head), i.e. the layout's L."""


@dataclass
class TrainRun:
    """What :func:`train_steps` measured on this rank."""

    losses: list[list[float]] = field(default_factory=list)
    """Per step, the per-microbatch losses (last pipeline stage only; empty elsewhere)."""
    wall_s: list[float] = field(default_factory=list)
    """Per step, the wall time of the ``forward_backward_func`` call."""


# --------------------------------------------------------------------------- shim


def _cpu_device_mode():
    import torch
    from torch.overrides import TorchFunctionMode

    class _CudaToCpu(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            device = kwargs.get("device")
            if device is not None and "cuda" in str(device):
                kwargs = {**kwargs, "device": "cpu"}
            return func(*args, **kwargs)

    del torch
    return _CudaToCpu()


@contextlib.contextmanager
def megatron_cpu() -> Iterator[None]:
    """Install the CPU shim for megatron-core's schedules; undo it on exit."""
    import torch
    from megatron.core.tensor_parallel import random as mc_random

    torch.set_num_threads(1)
    saved = torch.cuda.current_device, torch.cuda.synchronize
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *args, **kwargs: None
    mc_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    try:
        with _cpu_device_mode():
            yield
    finally:
        torch.cuda.current_device, torch.cuda.synchronize = saved


# ------------------------------------------------------------------- process spawn


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(rank, world_size, port, fn, args, queue):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        queue.put((rank, True, result))
    except BaseException:  # the parent reports it with the traceback
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], *, world_size: int, args: Sequence[Any] = (), timeout_s: float = 120.0) -> list:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` spawned gloo ranks.

    ``fn`` must be importable (module level) and return something picklable.
    Returns the per-rank results in rank order; raises RuntimeError with the
    rank's traceback if any rank failed or the run exceeded ``timeout_s``.
    """
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world_size, port, fn, tuple(args), queue)) for r in range(world_size)]
    for proc in procs:
        proc.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < world_size:
            rank, ok, payload = queue.get(timeout=max(1.0, deadline - time.monotonic()))
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{payload}")
            results[rank] = payload
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    return [results[r] for r in range(world_size)]


# ------------------------------------------------------------------ model parallel


def init_model_parallel(*, pipeline_model_parallel_size: int, virtual_pipeline_model_parallel_size: int | None = None) -> None:
    """(Re)initialize megatron-core's parallel state: TP=1, the given PP, the rest DP."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
    )


def destroy_model_parallel() -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()


def p2p_latency_ms(*, shape: tuple[int, ...] = (16, 2, HIDDEN_SIZE), repeats: int = 20) -> float:
    """One-way send time between pipeline neighbours: median ping-pong round trip / 2.

    Every rank of the pipeline group must call it; ranks pair up 0<->1, 2<->3, ...
    """
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    group = parallel_state.get_pipeline_model_parallel_group()
    ranks = dist.get_process_group_ranks(group)
    me = ranks.index(dist.get_rank())
    if len(ranks) < 2 or me == len(ranks) - 1 and len(ranks) % 2:
        return 0.0
    peer = ranks[me + 1] if me % 2 == 0 else ranks[me - 1]
    from megapipe.monitor.topology import ping_pong_s

    return ping_pong_s(torch.zeros(shape), peer=peer, leader=me % 2 == 0, repeats=repeats, group=group) * 1e3


def _sleep_function():
    import torch

    class _Sleep(torch.autograd.Function):
        """Identity whose forward and backward each sleep a fixed time."""

        @staticmethod
        def forward(ctx, tensor, forward_s, backward_s):
            ctx.backward_s = backward_s
            if forward_s > 0:
                time.sleep(forward_s)
            return tensor.clone()  # a view would break in-place ops downstream (vocab cross-entropy)

        @staticmethod
        def backward(ctx, grad):
            if ctx.backward_s > 0:
                time.sleep(ctx.backward_s)
            return grad, None, None

    return _Sleep


def _add_delay(module, delay_ms: tuple[float, float], sleep_fn) -> None:
    forward_s, backward_s = delay_ms[0] / 1e3, delay_ms[1] / 1e3
    if forward_s <= 0 and backward_s <= 0:
        return

    def hook(_module, _inputs, output):
        if isinstance(output, tuple):
            return (sleep_fn.apply(output[0], forward_s, backward_s), *output[1:])
        return sleep_fn.apply(output, forward_s, backward_s)

    module.register_forward_hook(hook)


def _canonical_init(model, seed: int) -> None:
    """Set every parameter from its global name, so any layout starts from the same weights."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            key = canonical_name(model, name)
            gen = torch.Generator().manual_seed(seed + sum(ord(c) * (i + 1) for i, c in enumerate(key)))
            if key.endswith("layer_norm_weight") or key.endswith("layernorm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
            else:
                param.copy_(0.2 * torch.randn(param.shape, generator=gen))


def canonical_name(model, name: str) -> str:
    """``decoder.layers.<local>.x`` -> ``layers.<global>.x``; other names unchanged."""
    parts = name.split(".")
    if parts[:2] == ["decoder", "layers"]:
        layer = model.decoder.layers[int(parts[2])]
        return ".".join(["layers", str(layer.layer_number), *parts[3:]])
    return name


def build_gpt_chunks(
    *,
    layout: str | None,
    num_layers: int,
    delays_ms: UnitDelays = UnitDelays(),
    seq_length: int = 16,
    vocab_size: int = VOCAB_SIZE,
    hidden_size: int = HIDDEN_SIZE,
    seed: int = 1234,
    batch_p2p_comm: bool = False,
    overlap_p2p_comm: bool | None = None,
) -> list:
    """Build this rank's GPTModel chunks (one per virtual stage) from a layout string.

    Uses the local (no Transformer Engine) layer spec, fp32, untied embedding and
    output weights, and the pipeline sizes set by :func:`init_model_parallel`.
    ``layout=None`` builds Megatron's even split. Weights are set from global
    parameter names (:func:`canonical_name`), so every layout of the same
    ``num_layers`` starts from identical weights.

    ``batch_p2p_comm`` defaults to False, as Megatron-LM sets it when
    ``overlap_p2p_comm`` is on (its default): with pipeline size 2 both
    neighbours are the same rank, and batched gloo p2p then pairs an
    interleaved step's activation and gradient messages in the wrong order.
    ``overlap_p2p_comm`` defaults to Megatron-LM's choice: on for interleaved
    schedules (sends are posted right after each forward/backward), off for 1F1B,
    which rejects it.
    """
    import torch
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    pp = parallel_state.get_pipeline_model_parallel_world_size()
    vp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    config = TransformerConfig(
        num_layers=num_layers,
        hidden_size=hidden_size,
        num_attention_heads=NUM_ATTENTION_HEADS,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vp,
        pipeline_model_parallel_layout=layout,
        pipeline_dtype=torch.float32,
        params_dtype=torch.float32,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        batch_p2p_sync=False,
        batch_p2p_comm=batch_p2p_comm,
        overlap_p2p_comm=bool(vp) if overlap_p2p_comm is None else overlap_p2p_comm,
    )
    sleep_fn = _sleep_function()
    models = []
    for vp_stage in range(vp or 1):
        stage = vp_stage if vp else None
        model = GPTModel(
            config=config,
            transformer_layer_spec=get_gpt_layer_local_spec(),
            vocab_size=vocab_size,
            max_sequence_length=seq_length,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
            share_embeddings_and_output_weights=False,
            vp_stage=stage,
        )
        _canonical_init(model, seed)
        if model.pre_process:
            _add_delay(model.embedding, delays_ms.embedding, sleep_fn)
        for layer in model.decoder.layers:
            _add_delay(layer, delays_ms.decoder, sleep_fn)
        if model.post_process:
            _add_delay(model.output_layer, delays_ms.loss, sleep_fn)
        models.append(model)
    return models


# ------------------------------------------------------------------------ training


def _microbatches(*, step: int, num_microbatches: int, micro_batch_size: int, seq_length: int, data_seed: int, vocab_size: int):
    import torch

    for index in range(num_microbatches):
        gen = torch.Generator().manual_seed(data_seed + 1000 * step + index)
        tokens = torch.randint(0, vocab_size, (micro_batch_size, seq_length + 1), generator=gen)
        yield {
            "tokens": tokens[:, :-1].contiguous(),
            "labels": tokens[:, 1:].contiguous(),
            "position_ids": torch.arange(seq_length).expand(micro_batch_size, -1),
        }


def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])

    def loss_func(per_token_loss):
        loss = per_token_loss.float().mean()
        return loss, {"loss": loss.detach().clone()}

    return output, loss_func


def train_steps(
    models: list,
    *,
    num_steps: int,
    num_microbatches: int,
    micro_batch_size: int = 2,
    seq_length: int = 16,
    data_seed: int = 7,
    between_steps: Callable[[int], None] | None = None,
) -> TrainRun:
    """Run the real ``get_forward_backward_func()`` schedule for ``num_steps`` steps.

    Gradients accumulate in ``param.grad`` and are zeroed before each step (no
    optimizer: the weights stay fixed, so every step computes the same thing on
    new data). ``between_steps(step)`` runs after each step.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    forward_backward = get_forward_backward_func()
    run = TrainRun()
    vocab_size = models[0].vocab_size
    for step in range(num_steps):
        for model in models:
            model.zero_grad(set_to_none=True)
        iterators = [
            _microbatches(step=step, num_microbatches=num_microbatches, micro_batch_size=micro_batch_size,
                          seq_length=seq_length, data_seed=data_seed, vocab_size=vocab_size)
            for _ in models
        ]
        start = time.perf_counter()
        out = forward_backward(
            forward_step_func=_forward_step,
            data_iterator=iterators if len(models) > 1 else iterators[0],
            model=models if len(models) > 1 else models[0],
            num_microbatches=num_microbatches,
            seq_length=seq_length,
            micro_batch_size=micro_batch_size,
            forward_only=False,
        )
        run.wall_s.append(time.perf_counter() - start)
        run.losses.append([float(item["loss"]) for item in out])
        if between_steps is not None:
            between_steps(step)
    return run


def canonical_grads(models: list) -> dict:
    """Gradients of every parameter on this rank, keyed by :func:`canonical_name`."""
    grads = {}
    for model in models:
        for name, param in model.named_parameters():
            if param.grad is not None:
                grads[canonical_name(model, name)] = param.grad.detach().clone()
    return grads
