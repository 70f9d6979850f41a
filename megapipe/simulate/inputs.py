"""What the simulator needs from a partition and a cluster: per-stage op times and the p2p cost.

:func:`stage_times` sums each layout stage's layer costs (:class:`megapipe.records.LayerCost`)
and scales the times by its rank's ``StageSpec.time_scale``; :func:`pipeline_link` and
:func:`p2p_cost` price one message between pipeline neighbours from Megatron's rank order
(``RankGenerator`` order ``tp-cp-ep-dp-pp``: the pipeline dimension varies slowest, so
neighbours are ``TP * CP * DP`` ranks apart) and :func:`megapipe.cost.p2p_bytes`.
"""

from __future__ import annotations

from collections.abc import Sequence

from megapipe import cost
from megapipe.records import ClusterSpec, LayerCost, LinkSpec, ModelSpec, ParallelSpec, StageSpec, TrainSpec
from megapipe.simulate.result import P2PCost, StageTimes

__all__ = ["stage_times", "pipeline_link", "p2p_cost"]


def stage_times(*, layers: Sequence[LayerCost], entries_per_stage: Sequence[int], stage_to_rank: Sequence[int],
                specs: Sequence[StageSpec]) -> StageTimes:
    """Per layout stage: F, B, W of its layers times its rank's ``time_scale``, and its activation bytes.

    Each stage's F and B also carry half of its rank's ``microbatch_overhead_ms`` (the framework's time
    per model chunk and microbatch).

    ``entries_per_stage`` counts consecutive entries of ``layers`` (a ``Partition``'s split);
    ``stage_to_rank`` maps each layout stage to the pipeline rank whose ``specs`` entry applies.
    """
    fwd, bwd, wgrad, act = [], [], [], []
    start = 0
    for stage, count in enumerate(entries_per_stage):
        spec = specs[stage_to_rank[stage]]
        scale, overhead = spec.time_scale, spec.microbatch_overhead_ms / 2
        f = b = w = a = 0  # the chunk's sums, one pass in entry order (what sum() of each field gives)
        for layer in layers[start:start + count]:
            f += layer.fwd_ms
            b += layer.bwd_ms
            w += layer.wgrad_ms
            a += layer.act_bytes
        start += count
        fwd.append(scale * f + overhead)
        bwd.append(scale * b + overhead)
        wgrad.append(scale * w)
        act.append(a)
    return StageTimes(fwd_ms=tuple(fwd), bwd_ms=tuple(bwd), wgrad_ms=tuple(wgrad), act_bytes=tuple(act))


def pipeline_link(*, cluster: ClusterSpec, stride: int, pipeline_model_parallel_size: int) -> LinkSpec:
    """The link pipeline neighbours use: ranks ``stride = TP*CP*DP`` apart in Megatron's order.

    If any neighbouring pair sits on different nodes, the pipeline runs at the inter-node link.
    """
    gpn = cluster.domain_gpus
    crosses = any((r * stride) // gpn != ((r + 1) * stride) // gpn for r in range(pipeline_model_parallel_size - 1))
    return cluster.inter_node if crosses else cluster.intra_node


def p2p_cost(*, model: ModelSpec, cluster: ClusterSpec, parallel: ParallelSpec, train: TrainSpec) -> P2PCost:
    """One activation (or gradient) message between pipeline neighbours on ``cluster``."""
    stride = parallel.tensor_model_parallel_size * parallel.context_parallel_size * parallel.data_parallel_size
    link = pipeline_link(cluster=cluster, stride=stride,
                         pipeline_model_parallel_size=parallel.pipeline_model_parallel_size)
    return P2PCost.from_link(link, p2p_bytes=cost.p2p_bytes(model=model, parallel=parallel, train=train),
                             efficiency_scale=cluster.runtime.comm_efficiency_scale)
