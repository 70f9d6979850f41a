"""Pipeline ranks as the solver sees them: one StageSpec per pipeline position.

On a homogeneous cluster every position gets the GPU's usable memory and
time_scale 1. On a mixed cluster, positions are given to node groups in order,
in proportion to each group's share of the GPUs, and a slower GPU's time_scale
is the ratio of achieved matmul throughput (bf16_tflops * matmul_efficiency)
of the reference GPU (the one the profile was measured or costed for) to its own.
"""

from __future__ import annotations

from megapipe.errors import ConfigError
from megapipe.records import ClusterSpec, GpuSpec, StageSpec

__all__ = ["time_scale", "position_gpus", "stage_specs"]


def time_scale(gpu: GpuSpec, reference: GpuSpec) -> float:
    """How many times longer ``gpu`` takes than ``reference`` for the same GEMM-bound work."""
    return (reference.bf16_tflops * reference.matmul_efficiency) / (gpu.bf16_tflops * gpu.matmul_efficiency)


def position_gpus(cluster: ClusterSpec, pipeline_model_parallel_size: int) -> tuple[GpuSpec, ...]:
    """The GPU type at each pipeline position, node groups in order, proportional to their GPU share."""
    total = cluster.num_nodes
    counts = [group.num_nodes * pipeline_model_parallel_size / total for group in cluster.node_groups]
    whole = [int(round(c)) for c in counts]
    whole[-1] = pipeline_model_parallel_size - sum(whole[:-1])
    if any(n < 0 for n in whole):
        raise ConfigError(
            f"cannot place {pipeline_model_parallel_size} pipeline stages on node groups of "
            f"{[g.num_nodes for g in cluster.node_groups]} nodes; use more pipeline stages"
        )
    return tuple(group.gpu for group, n in zip(cluster.node_groups, whole) for _ in range(n))


def stage_specs(
    cluster: ClusterSpec,
    *,
    pipeline_model_parallel_size: int,
    reference: GpuSpec | None = None,
    gpus: tuple[GpuSpec, ...] | None = None,
    time_scales: dict[str, float] | None = None,
) -> tuple[StageSpec, ...]:
    """One StageSpec per pipeline rank; ``gpus`` overrides the default placement.

    ``time_scales`` (GPU name -> scale) overrides the datasheet ratio of :func:`time_scale`,
    e.g. with the ratio of the cost model's per-layer times on each GPU, as the planner uses.
    """
    reference = reference or cluster.gpu
    placed = gpus or position_gpus(cluster, pipeline_model_parallel_size)
    if len(placed) != pipeline_model_parallel_size:
        raise ConfigError(f"{len(placed)} GPU types given for pipeline_model_parallel_size={pipeline_model_parallel_size}")
    return tuple(
        StageSpec(time_scale=(time_scales or {}).get(gpu.name, time_scale(gpu, reference)),
                  memory_bytes=gpu.usable_memory_bytes, gpu_name=gpu.name)
        for gpu in placed
    )
