"""Mixed clusters: which pipeline positions get which GPU type.

Megatron orders ranks tp-cp-dp-pp, so one pipeline position spans ``TP*CP*DP`` GPUs
(all its data-parallel replicas). A node group of ``g`` GPUs therefore holds
``g / (TP*CP*DP)`` whole pipeline positions, and must hold a whole number of them.
The groups occupy contiguous blocks of positions; every distinct order of the groups
is a placement (two GPU types: fast-first and fast-last). The solver then gives each
position layers in proportion to its speed and memory (StageSpec time_scale and
memory_bytes), and the planner keeps the placement with the best step time, reporting
its gain over Megatron's equal split on the same placement (Metis, Um et al. 2024, does
the same search over device groups at larger scale).
"""

from __future__ import annotations

from itertools import permutations

from megapipe.records import ClusterSpec, GpuSpec, ParallelSpec

__all__ = ["positions_per_group", "placements"]


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
