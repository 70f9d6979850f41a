"""Communication time: the one collective model, and which link a group runs on.

Collectives (Patarasuk & Yuan 2009; Thakur et al. 2005, "Optimization of Collective
Communication Operations in MPICH"): the bandwidth term is the ring's, which is optimal --
an all-reduce moves ``2 (n-1)/n`` of the buffer per GPU, an all-gather or reduce-scatter
``(n-1)/n`` of the full (gathered) buffer -- at the link's bandwidth times the share NCCL
achieves of it (its bus bandwidth in nccl-tests, ``LinkSpec.bandwidth_efficiency``) times the
runtime's in-training scale. The latency term depends on the algorithm:

- ``ring`` (the default): every pass is ``n - 1`` sequential steps, each one ``latency_us``. NCCL's
  ring, which large collectives use inside an NVSwitch node too; with a per-step latency of a few
  microseconds it reproduces nccl-tests' bus-bandwidth ramp from 1 MiB to 1 GiB;
- ``direct``: one ``latency_us`` per collective, for single-shot small collectives (NVLS one-shot).

All-to-all (the MoE token dispatch over expert parallelism, :func:`all_to_all_ms`): every GPU sends
``1/n`` of its buffer to each of the ``n - 1`` others at once (NCCL's grouped send/receive), so the
peers inside its NVLink domain take their share at the NVLink rate while those outside share its NIC;
the slower of the two sets the time, plus one latency of the slowest link.
"""

from __future__ import annotations

import enum

from megapipe.records import ClusterSpec, LinkSpec

__all__ = ["Collective", "Algorithm", "collective_ms", "all_to_all_ms", "domain_members", "p2p_ms", "group_link",
           "p2p_link", "tensor_parallel_link"]


class Collective(str, enum.Enum):
    all_reduce = "all_reduce"
    all_gather = "all_gather"
    reduce_scatter = "reduce_scatter"


class Algorithm(str, enum.Enum):
    """How many latency steps a collective pays: n - 1 per pass (ring) or one (direct, over a switch)."""

    ring = "ring"
    direct = "direct"


def _bytes_per_ms(link: LinkSpec, scale: float) -> float:
    return link.bandwidth_gbytes_per_s * 1e9 * link.bandwidth_efficiency * scale * 1e-3


def collective_ms(*, kind: Collective, num_bytes: float, group_size: int, link: LinkSpec,
                  algorithm: Algorithm = Algorithm.ring, efficiency_scale: float = 1.0) -> float:
    """One collective over ``group_size`` GPUs of a buffer of ``num_bytes`` (the gathered size); 0 for one GPU."""
    if group_size <= 1 or num_bytes <= 0:
        return 0.0
    passes = 2.0 if kind == Collective.all_reduce else 1.0
    moved = passes * (group_size - 1) / group_size * num_bytes
    steps = passes * (group_size - 1) if algorithm == Algorithm.ring else 1
    return moved / _bytes_per_ms(link, efficiency_scale) + steps * link.latency_us * 1e-3


def domain_members(*, cluster: ClusterSpec, group_size: int, stride: int = 1) -> int:
    """Members of a group (ranks ``stride`` apart) that share one NVLink domain with a given member."""
    if group_size * stride <= cluster.domain_gpus:
        return group_size
    return max(1, min(group_size, cluster.domain_gpus // stride))


def all_to_all_ms(*, num_bytes: float, group_size: int, cluster: ClusterSpec, stride: int = 1,
                  efficiency_scale: float = 1.0) -> float:
    """One all-to-all in which every GPU of the group sends ``num_bytes`` in all (``1/n`` to each member,
    its own share staying local); 0 for one GPU."""
    if group_size <= 1 or num_bytes <= 0:
        return 0.0
    local = domain_members(cluster=cluster, group_size=group_size, stride=stride)
    share = num_bytes / group_size
    intra = (local - 1) * share / _bytes_per_ms(cluster.intra_node, efficiency_scale)
    remote = group_size - local
    inter = remote * share / _bytes_per_ms(cluster.inter_node, efficiency_scale) if remote else 0.0
    latency = (cluster.inter_node if remote else cluster.intra_node).latency_us * 1e-3
    return max(intra, inter) + latency


def p2p_ms(*, num_bytes: float, link: LinkSpec, efficiency_scale: float = 1.0) -> float:
    """One point-to-point message: its bytes at the achieved link bandwidth plus one latency."""
    if num_bytes <= 0:
        return 0.0
    return num_bytes / _bytes_per_ms(link, efficiency_scale) + link.latency_us * 1e-3


def group_link(*, cluster: ClusterSpec, span: int, stride: int = 1) -> LinkSpec:
    """The link a collective group runs at: ranks ``stride`` apart over ``span`` consecutive GPUs.

    Inside one NVLink domain (``ClusterSpec.domain_gpus``) it is ``intra_node``. Across domains NCCL
    runs one ring per channel and spreads the channels over the NICs of the group's members in each
    domain, each ring crossing a domain boundary once: the ring's bus bandwidth is the members' NICs
    together, ``k x inter_node`` for k members per domain, up to the NVLink rate inside (nccl-tests
    across 4 nodes of 8 GPUs with one 400 Gb/s NIC each: ~370-380 GB/s bus bandwidth against
    ~480 inside one node).
    """
    domain = cluster.domain_gpus
    if span <= domain:
        return cluster.intra_node
    members = max(1, domain // stride) if stride < domain else 1
    if members == 1:
        return cluster.inter_node
    inter, intra = cluster.inter_node, cluster.intra_node
    achieved = min(members * inter.bandwidth_gbytes_per_s * inter.bandwidth_efficiency,
                   intra.bandwidth_gbytes_per_s * intra.bandwidth_efficiency)
    return LinkSpec(kind=f"{inter.kind} x{members}", bandwidth_gbytes_per_s=achieved, latency_us=inter.latency_us,
                    bandwidth_efficiency=1.0)


def p2p_link(*, cluster: ClusterSpec, span: int) -> LinkSpec:
    """The link of point-to-point messages in a ring over ``span`` consecutive GPUs: each message is one
    GPU's, so across NVLink domains it runs at one NIC (``inter_node``)."""
    return cluster.intra_node if span <= cluster.domain_gpus else cluster.inter_node


def tensor_parallel_link(*, cluster: ClusterSpec, tensor_model_parallel_size: int) -> LinkSpec:
    """NVLink-class ``intra_node`` when the TP group fits in an NVLink domain, else the ``inter_node`` network."""
    return group_link(cluster=cluster, span=tensor_model_parallel_size)
