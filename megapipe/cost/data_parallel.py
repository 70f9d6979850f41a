"""After the pipeline drains: data-parallel gradient sync and the optimizer step.

Data-parallel sync (ring collectives, :mod:`megapipe.cost.comm`): each of d ranks sends
``2 (d-1)/d * B`` bytes for an all-reduce of B bytes, and half that for a reduce-scatter
or an all-gather. Megatron's DDP reduces gradients over the data-parallel x context-parallel
group (d = DP * CP); with the distributed optimizer it reduce-scatters gradients and
all-gathers the updated bf16 parameters, the same 2 (d-1)/d * B in total.

Overlap (Megatron ``overlap_grad_reduce`` / ``overlap_param_gather``): gradient buckets are
reduced while the last microbatch's backward still runs on the rank, and the parameter
all-gather runs under the next step's first forward. So the exposed time is
``max(0, reduce - backward of one microbatch) + max(0, gather - forward of one microbatch)``.
This is optimistic when buckets are few and pessimistic when the last stage's early finish
hides more; it is a stated approximation, validated in docs/validation.md when measured.

Bandwidth: Megatron orders ranks tp-cp-dp-pp, so a DP x CP group spans ``tp * cp * dp``
consecutive GPUs; it stays on the intra-node link when that fits in one node, otherwise
the ring is limited by the per-GPU inter-node bandwidth.

Optimizer step (memory-bound Adam with fp32 master weights, Megatron's mixed precision):
per parameter it reads the gradient (2 bytes bf16 / 4 fp32), reads and writes the fp32
master weight, exp_avg and exp_avg_sq (3 x 8 bytes) and writes the 16-bit parameter
(2 bytes): 28 bytes in bf16. With the distributed optimizer each rank updates 1/d of them.
"""

from __future__ import annotations

from megapipe.cost.comm import Algorithm, Collective, collective_ms
from megapipe.records import ClusterSpec, GpuSpec, LinkSpec, ParallelSpec

__all__ = ["grad_bytes_per_param", "dp_link", "dp_sync_ms", "optimizer_step_ms", "ADAM_BYTES_PER_PARAM"]

ADAM_BYTES_PER_PARAM = 3 * 8 + 2
"""fp32 master, exp_avg, exp_avg_sq read and written, plus the 16-bit parameter written; the gradient read is added."""


def grad_bytes_per_param(precision: str) -> int:
    """Megatron's default grad_reduce_in_fp32=False keeps gradients in the training dtype."""
    return 4 if precision == "fp32" else 2


def dp_link(*, cluster: ClusterSpec, parallel: ParallelSpec) -> LinkSpec:
    span = parallel.tensor_model_parallel_size * parallel.context_parallel_size * parallel.data_parallel_size
    return cluster.intra_node if span <= cluster.gpus_per_node else cluster.inter_node


def dp_sync_ms(
    *,
    params_per_gpu: float,
    precision: str,
    cluster: ClusterSpec,
    parallel: ParallelSpec,
    backward_ms: float,
    forward_ms: float,
) -> float:
    """Exposed DP time of one rank, ms; ``backward_ms``/``forward_ms`` are its per-microbatch times."""
    group = parallel.data_parallel_size * parallel.context_parallel_size
    link = dp_link(cluster=cluster, parallel=parallel)
    num_bytes = params_per_gpu * grad_bytes_per_param(precision)
    if not parallel.use_distributed_optimizer:
        reduce = collective_ms(kind=Collective.all_reduce, num_bytes=num_bytes, group_size=group, link=link,
                               algorithm=Algorithm.ring)
        return max(0.0, reduce - backward_ms)
    half = collective_ms(kind=Collective.reduce_scatter, num_bytes=num_bytes, group_size=group, link=link,
                         algorithm=Algorithm.ring)
    return max(0.0, half - backward_ms) + max(0.0, half - forward_ms)


def optimizer_step_ms(*, params_per_gpu: float, gpu: GpuSpec, parallel: ParallelSpec, precision: str) -> float:
    """Memory-bound Adam over the rank's share of parameters, ms."""
    share = params_per_gpu
    if parallel.use_distributed_optimizer:
        share /= parallel.data_parallel_size * parallel.context_parallel_size
    per_param = ADAM_BYTES_PER_PARAM + grad_bytes_per_param(precision)
    bandwidth = gpu.hbm_gbytes_per_s * 1e9 * gpu.bandwidth_efficiency
    return 1e3 * share * per_param / bandwidth
