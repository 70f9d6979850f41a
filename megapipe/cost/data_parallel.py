"""After the pipeline drains: data-parallel gradient sync and the optimizer step.

Data-parallel sync (ring collectives, :mod:`megapipe.cost.comm`): Megatron's DDP reduces
gradients over the data-parallel x context-parallel group (d = DP * CP); with the distributed
optimizer it reduce-scatters the gradients and all-gathers the updated parameters, otherwise it
all-reduces the gradients. Gradients are reduced in fp32 for bf16 training: Megatron-LM sets
``accumulate_allreduce_grads_in_fp32`` for ``--bf16`` unless ``--grad-reduce-in-bf16``
(``megatron/training/arguments.py``), and NeMo's and Megatron-Bridge's DDP configs set
``grad_reduce_in_fp32``; fp16 reduces in fp16. The parameters are gathered in their training
dtype (bf16), or in FP8 with ``--fp8-param-gather``.

Overlap (``overlap_grad_reduce`` / ``overlap_param_gather``): the gradient buffer is cut into
buckets of ``max(40M, 1M x d)`` parameters (megatron-core ``DistributedDataParallel``); each
bucket is reduced as soon as the last microbatch's backward has produced it, so the reduction
runs under that backward, and the last bucket only after it. The parameter all-gather runs
bucket by bucket under the next step's first forward. Exposed time per rank:

    max(one bucket, reduce - backward of one microbatch) + max(one bucket, gather - forward of one)

and the whole of each collective without the overlap flags.

Megatron FSDP (``optim_grads``, ``optim_grads_params``) moves these collectives into every microbatch
(:func:`_fsdp_sync_ms`); its ``optim`` strategy is the distributed optimizer's.

Routed-expert parameters have their own buffers and optimizer, reduced and sharded over the expert
data-parallel group (EDP = world / (ETP x EP x PP); megatron-core ``DistributedDataParallel``'s
``expert_parallel_buffers``), after the dense ones.

Bandwidth: Megatron orders ranks tp-cp-dp-pp, so a DP x CP group spans ``tp * cp * dp``
consecutive GPUs, ``tp`` apart; it stays on the intra-node link inside one NVLink domain, and
across domains runs at its members' NICs together (:func:`megapipe.cost.comm.group_link`).

Optimizer step (memory-bound, Megatron's distributed Adam over its shard of 1/d parameters):
the gradient-norm pass reads the fp32 main gradient (4 bytes); Adam reads the gradient and reads
and writes the fp32 master weight, exp_avg and exp_avg_sq (4 + 3 x 8); the updated master is
copied into the 16-bit parameter buffer (4 + 2): 38 bytes per shard parameter. Zeroing the
whole gradient buffer for the next step writes 4 bytes per parameter of the rank.
"""

from __future__ import annotations

from megapipe.cost.comm import Algorithm, Collective, collective_ms, group_link
from megapipe.records import ClusterSpec, GpuSpec, LinkSpec, ParallelSpec, TrainSpec

__all__ = [
    "grad_bytes_per_param",
    "param_gather_bytes_per_param",
    "bucket_params",
    "dp_link",
    "expert_dp_link",
    "dp_sync_ms",
    "optimizer_step_ms",
    "OPTIMIZER_BYTES_PER_SHARD_PARAM",
]

OPTIMIZER_BYTES_PER_SHARD_PARAM = 4 + (4 + 3 * 8) + (4 + 2)
"""Gradient norm, Adam's reads and writes, and the copy into the 16-bit parameter (see the module docstring)."""
_ZERO_GRAD_BYTES = 4
_BUCKET_MIN_PARAMS = 40_000_000
_BUCKET_PARAMS_PER_RANK = 1_000_000


def grad_bytes_per_param(precision: str) -> int:
    """Bytes per gradient element as Megatron reduces it: fp32 except under fp16."""
    return 2 if precision == "fp16" else 4


def param_gather_bytes_per_param(train: TrainSpec) -> float:
    """Bytes per parameter the distributed optimizer all-gathers: the training dtype, FP8 with fp8_param_gather."""
    if train.precision == "fp32":
        return 4.0
    return 1.0 if train.precision == "fp8" and train.fp8_param_gather else 2.0


def bucket_params(parallel: ParallelSpec) -> int:
    """megatron-core's default DDP bucket: max(40M, 1M x data-parallel ranks) parameters."""
    group = parallel.data_parallel_size * parallel.context_parallel_size
    return max(_BUCKET_MIN_PARAMS, _BUCKET_PARAMS_PER_RANK * group)


def dp_link(*, cluster: ClusterSpec, parallel: ParallelSpec) -> LinkSpec:
    stride = parallel.tensor_model_parallel_size
    return group_link(cluster=cluster, span=stride * parallel.context_parallel_size * parallel.data_parallel_size,
                      stride=stride)


def expert_dp_link(*, cluster: ClusterSpec, parallel: ParallelSpec) -> LinkSpec:
    """The expert data-parallel group: megatron-core's expert grid orders ranks etp-ep-edp-pp, so its
    members are ETP x EP apart over a pipeline stage's GPUs."""
    stride = parallel.expert_tp * parallel.expert_model_parallel_size
    return group_link(cluster=cluster, span=stride * parallel.expert_data_parallel_size, stride=stride)


def _overlapped(total_ms: float, bucket_ms: float, window_ms: float, overlap: bool) -> float:
    if not overlap:
        return total_ms
    return max(min(bucket_ms, total_ms), total_ms - window_ms)


def _group_sync_ms(*, params: float, group: int, link: LinkSpec, train: TrainSpec, cluster: ClusterSpec,
                   parallel: ParallelSpec, backward_ms: float, forward_ms: float) -> float:
    if group <= 1 or params <= 0:
        return 0.0
    scale = cluster.runtime.comm_efficiency_scale

    def ring(kind: Collective, count: float, element_bytes: float) -> float:
        return collective_ms(kind=kind, num_bytes=count * element_bytes, group_size=group, link=link,
                             algorithm=Algorithm.ring, efficiency_scale=scale)

    grad_bytes = grad_bytes_per_param(train.precision)
    bucket = min(params, max(_BUCKET_MIN_PARAMS, _BUCKET_PARAMS_PER_RANK * group))
    if parallel.use_megatron_fsdp and parallel.data_parallel_sharding_strategy in ("optim_grads", "optim_grads_params"):
        return _fsdp_sync_ms(ring, params=params, bucket=bucket, train=train, parallel=parallel,
                             backward_ms=backward_ms, forward_ms=forward_ms)
    if not parallel.use_distributed_optimizer:
        reduce = ring(Collective.all_reduce, params, grad_bytes)
        return _overlapped(reduce, ring(Collective.all_reduce, bucket, grad_bytes), backward_ms,
                           parallel.overlap_grad_reduce)
    reduce = _overlapped(ring(Collective.reduce_scatter, params, grad_bytes),
                         ring(Collective.reduce_scatter, bucket, grad_bytes), backward_ms, parallel.overlap_grad_reduce)
    gather_bytes = param_gather_bytes_per_param(train)
    gather = _overlapped(ring(Collective.all_gather, params, gather_bytes),
                         ring(Collective.all_gather, bucket, gather_bytes), forward_ms, parallel.overlap_param_gather)
    return reduce + gather


def _fsdp_sync_ms(ring, *, params: float, bucket: float, train: TrainSpec, parallel: ParallelSpec,
                  backward_ms: float, forward_ms: float) -> float:
    """Megatron FSDP's exposed collectives over one step: its gradients are sharded, so every microbatch's
    backward reduce-scatters them (``optim_grads``); with the weights sharded too (``optim_grads_params``) every
    forward and backward first all-gathers them, layer by layer with the next layer prefetched (its README's
    runtime schedule), so only what outlasts the compute it runs under is exposed. ``optim_grads`` gathers the
    updated weights once per step, as the distributed optimizer does."""
    microbatches = max(1, train.num_microbatches(parallel.data_parallel_size))
    grad_bytes, gather_bytes = grad_bytes_per_param(train.precision), param_gather_bytes_per_param(train)
    reduce, reduce_bucket = (ring(Collective.reduce_scatter, count, grad_bytes) for count in (params, bucket))
    gather, gather_bucket = (ring(Collective.all_gather, count, gather_bytes) for count in (params, bucket))
    if parallel.data_parallel_sharding_strategy == "optim_grads":
        per_microbatch = _overlapped(reduce, reduce_bucket, backward_ms, parallel.overlap_grad_reduce)
        return microbatches * per_microbatch + _overlapped(gather, gather_bucket, forward_ms,
                                                           parallel.overlap_param_gather)
    forward = _overlapped(gather, gather_bucket, forward_ms, parallel.overlap_param_gather)
    backward = _overlapped(gather + reduce, gather_bucket + reduce_bucket, backward_ms, parallel.overlap_grad_reduce)
    return microbatches * (forward + backward)


def dp_sync_ms(*, params_per_gpu: float, train: TrainSpec, cluster: ClusterSpec, parallel: ParallelSpec,
               backward_ms: float, forward_ms: float, expert_params_per_gpu: float = 0.0) -> float:
    """Exposed DP time of one rank, ms; ``backward_ms``/``forward_ms`` are its per-microbatch times.

    ``params_per_gpu`` includes the routed experts' ``expert_params_per_gpu``, which megatron-core keeps in
    their own buffers and reduces over the expert data-parallel group (EDP) after the dense ones.
    """
    common = dict(train=train, cluster=cluster, parallel=parallel, backward_ms=backward_ms, forward_ms=forward_ms)
    dense = _group_sync_ms(params=params_per_gpu - expert_params_per_gpu,
                           group=parallel.data_parallel_size * parallel.context_parallel_size,
                           link=dp_link(cluster=cluster, parallel=parallel), **common)
    if expert_params_per_gpu <= 0:
        return dense
    return dense + _group_sync_ms(params=expert_params_per_gpu, group=parallel.expert_data_parallel_size,
                                  link=expert_dp_link(cluster=cluster, parallel=parallel), **common)


def optimizer_step_ms(*, params_per_gpu: float, gpu: GpuSpec, parallel: ParallelSpec,
                      expert_params_per_gpu: float = 0.0) -> float:
    """Memory-bound distributed Adam over the rank's shard, and zeroing its gradient buffer, ms."""
    dense, expert = params_per_gpu - expert_params_per_gpu, expert_params_per_gpu
    if parallel.use_distributed_optimizer:
        dense /= parallel.data_parallel_size * parallel.context_parallel_size
        expert /= parallel.expert_data_parallel_size
    num_bytes = (dense + expert) * OPTIMIZER_BYTES_PER_SHARD_PARAM + params_per_gpu * _ZERO_GRAD_BYTES
    return 1e3 * num_bytes / (gpu.hbm_gbytes_per_s * 1e9 * gpu.bandwidth_efficiency)
