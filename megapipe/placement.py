"""Stage placement: which GPU type each pipeline rank gets, and what it offers the solver.

One module owns it, so the planner, ``partition``, ``simulate`` and ``replan`` model the
same pipeline.

Positions. Megatron orders ranks tp-cp-dp-pp, so one pipeline position spans
``TP*CP*DP`` GPUs (all its data-parallel replicas). A node group of ``g`` GPUs holds
``g / (TP*CP*DP)`` whole pipeline positions, and must hold a whole number of them. The
groups occupy contiguous blocks of positions; every distinct order of the groups is a
placement (:func:`placements`; two GPU types: fast-first and fast-last). The planner
keeps the placement with the best step time (Metis, Um et al. 2024, searches device
groups the same way at larger scale). Without a search (:func:`default_gpus`), positions
go to node groups in the cluster file's order, in proportion to their nodes.

Speed. A slower GPU's ``time_scale`` is the ratio of the cost model's time for the same
layers on it to that on the reference GPU (the one the profile was measured or costed
for): :func:`modelled_stage_specs`. The datasheet ratio of achieved matmul throughput
(:func:`datasheet_time_scale`) only bounds it for the planner's pruning.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import permutations

from megapipe.errors import ConfigError
from megapipe.records import ClusterSpec, GpuSpec, LayerCost, ParallelSpec, StageSpec

__all__ = [
    "node_gpus",
    "node_ranges",
    "positions_per_group",
    "placements",
    "default_gpus",
    "gpus_by_name",
    "datasheet_time_scale",
    "modelled_stage_specs",
]


def positions_per_group(cluster: ClusterSpec, parallel: ParallelSpec) -> tuple[int, ...] | None:
    """Pipeline positions each node group holds; None when a group splits a position."""
    stride = parallel.tensor_model_parallel_size * parallel.context_parallel_size * parallel.data_parallel_size
    counts = []
    for group in cluster.node_groups:
        gpus = group.num_nodes * cluster.gpus_per_node
        if gpus % stride:
            return None
        counts.append(gpus // stride)
    if sum(counts) != parallel.pipeline_model_parallel_size:
        return None
    return tuple(counts)


def placements(cluster: ClusterSpec, parallel: ParallelSpec) -> tuple[tuple[GpuSpec, ...], ...]:
    """Every distinct GPU-type sequence over the pipeline positions (one for a homogeneous cluster)."""
    pp = parallel.pipeline_model_parallel_size
    if not cluster.is_heterogeneous:
        return ((cluster.gpu,) * pp,)
    counts = positions_per_group(cluster, parallel)
    if counts is None:
        return ()
    seen: dict[tuple[str, ...], tuple[GpuSpec, ...]] = {}
    for order in permutations(range(len(counts))):
        gpus = tuple(cluster.node_groups[k].gpu for k in order for _ in range(counts[k]))
        seen.setdefault(tuple(g.name for g in gpus), gpus)
    return tuple(seen[key] for key in sorted(seen))


def default_gpus(cluster: ClusterSpec, pipeline_model_parallel_size: int) -> tuple[GpuSpec, ...]:
    """The GPU type at each pipeline position, node groups in file order, proportional to their nodes."""
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


def gpus_by_name(cluster: ClusterSpec, names: Sequence[str]) -> tuple[GpuSpec, ...]:
    """The cluster's GpuSpecs for a recorded placement (a plan's ``stage_gpus``)."""
    known = {group.gpu.name: group.gpu for group in cluster.node_groups}
    unknown = sorted(set(names) - set(known))
    if unknown:
        raise ConfigError(f"placement names GPU types {unknown} that cluster {cluster.name!r} does not have "
                          f"({', '.join(sorted(known))}); use the cluster the plan was made for")
    return tuple(known[name] for name in names)


def node_gpus(cluster: ClusterSpec, parallel: ParallelSpec, stage_gpus: Sequence[str]) -> tuple[str, ...]:
    """The GPU type each node rank must have for the pipeline placement ``stage_gpus`` (one name per rank).

    Megatron orders global ranks tp-cp-dp-pp, so node rank n (global ranks n*g .. n*g+g-1, g GPUs
    per node) holds pipeline rank (n*g) // (TP*CP*DP). A launcher must start node rank n on a node
    of this type.
    """
    stride = parallel.tensor_model_parallel_size * parallel.context_parallel_size * parallel.data_parallel_size
    return tuple(stage_gpus[(node * cluster.gpus_per_node) // stride] for node in range(cluster.num_nodes))


def node_ranges(names: Sequence[str]) -> str:
    """``0-7 a100_80gb, 8-15 h100_80gb``: runs of node ranks with one GPU type."""
    parts, start = [], 0
    for index in range(1, len(names) + 1):
        if index == len(names) or names[index] != names[start]:
            span = f"{start}" if index - 1 == start else f"{start}-{index - 1}"
            parts.append(f"{span} {names[start]}")
            start = index
    return ", ".join(parts)


def datasheet_time_scale(gpu: GpuSpec, reference: GpuSpec) -> float:
    """How many times longer ``gpu`` takes than ``reference`` for GEMM-bound work, by achieved matmul peak."""
    return (reference.bf16_tflops * reference.matmul_efficiency) / (gpu.bf16_tflops * gpu.matmul_efficiency)


def _total_ms(layers: Sequence[LayerCost]) -> float:
    return sum(layer.fwd_ms + layer.bwd_ms for layer in layers)


def modelled_stage_specs(gpus: Sequence[GpuSpec], *, reference: GpuSpec,
                         layers_of: Callable[[GpuSpec], Sequence[LayerCost]],
                         microbatch_overhead_ms: float = 0.0) -> tuple[StageSpec, ...]:
    """One StageSpec per pipeline rank: its GPU's usable memory, modelled time scale and the framework's
    time per model chunk and microbatch.

    ``layers_of(gpu)`` gives the cost model's layers of the candidate on ``gpu``; a GPU's
    scale is their total time over the reference GPU's (1 on the reference GPU itself).
    """
    ref_ms = None
    specs = []
    for gpu in gpus:
        scale = 1.0
        if gpu != reference:
            ref_ms = ref_ms if ref_ms is not None else _total_ms(layers_of(reference))
            scale = _total_ms(layers_of(gpu)) / ref_ms
        specs.append(StageSpec(time_scale=scale, memory_bytes=gpu.usable_memory_bytes, gpu_name=gpu.name,
                               microbatch_overhead_ms=microbatch_overhead_ms))
    return tuple(specs)
