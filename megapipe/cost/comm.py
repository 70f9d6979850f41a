"""Communication time: the one collective model, and which link a group runs on.

Collectives (Patarasuk & Yuan 2009; Thakur et al. 2005, "Optimization of Collective
Communication Operations in MPICH"): the bandwidth term is the ring's, which is optimal --
an all-reduce moves ``2 (n-1)/n`` of the buffer per GPU, an all-gather or reduce-scatter
``(n-1)/n`` of the full (gathered) buffer. The latency term depends on the algorithm:

- ``ring``: every pass is ``n - 1`` sequential steps, each one ``latency_us`` (a
  data-parallel ring across nodes);
- ``direct``: GPUs on one switch (NVSwitch) exchange with all peers at once, so one
  ``latency_us`` per collective -- the link's effective small-collective latency, as the
  cluster files give it for NVLink (NCCL's single-node NVLS / one-shot paths).
"""

from __future__ import annotations

import enum

from megapipe.records import ClusterSpec, LinkSpec

__all__ = ["Collective", "Algorithm", "collective_ms", "tensor_parallel_link"]


class Collective(str, enum.Enum):
    all_reduce = "all_reduce"
    all_gather = "all_gather"
    reduce_scatter = "reduce_scatter"


class Algorithm(str, enum.Enum):
    """How many latency steps a collective pays: n - 1 per pass (ring) or one (direct, over a switch)."""

    ring = "ring"
    direct = "direct"


def collective_ms(*, kind: Collective, num_bytes: float, group_size: int, link: LinkSpec,
                  algorithm: Algorithm = Algorithm.direct) -> float:
    """One collective over ``group_size`` GPUs of a buffer of ``num_bytes`` (the gathered size); 0 for one GPU."""
    if group_size <= 1 or num_bytes <= 0:
        return 0.0
    passes = 2.0 if kind == Collective.all_reduce else 1.0
    moved = passes * (group_size - 1) / group_size * num_bytes
    steps = passes * (group_size - 1) if algorithm == Algorithm.ring else 1
    return moved / (link.bandwidth_gbytes_per_s * 1e9) * 1e3 + steps * link.latency_us * 1e-3


def tensor_parallel_link(*, cluster: ClusterSpec, tensor_model_parallel_size: int) -> LinkSpec:
    """NVLink-class ``intra_node`` when the TP group fits in a node, else the ``inter_node`` network."""
    if tensor_model_parallel_size <= cluster.gpus_per_node:
        return cluster.intra_node
    return cluster.inter_node
