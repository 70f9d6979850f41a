"""Measure the links between neighbouring pipeline ranks and compare them with the plan.

At train start every pipeline rank ping-pongs a few message sizes with its
neighbours (pairs (0,1), (2,3), ... then (1,2), (3,4), ...), within a small time
budget: after each size the lower rank tells the upper one whether to go on.
One-way time per size = median round trip / 2; a least-squares line
``t(n) = latency + n / bandwidth`` over the sizes (the Hockney model, Hockney
1994, "The communication challenge for MPP") gives bandwidth and latency.
:func:`fit_link`, :func:`like_kind` and :func:`compare_link` are pure.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["LinkMeasurement", "fit_link", "like_kind", "compare_link", "expected_link", "measure_neighbours",
           "DEFAULT_SIZES", "ping_pong_s"]

DEFAULT_SIZES = (4 * 1024, 256 * 1024, 4 * 1024 * 1024)
"""Message sizes in bytes (fp32 elements x 4)."""

_KINDS = ((150.0, "nvlink/xgmi"), (20.0, "infiniband/roce"), (3.0, "roce/ethernet"), (0.0, "ethernet/loopback"))
"""Lower bandwidth bound (GB/s, one direction) of each class of link, fastest first."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkMeasurement:
    """The link from this rank to one pipeline neighbour."""

    peer: int
    """Global rank of the neighbour."""
    bandwidth_gbytes_per_s: float
    latency_us: float
    sizes: tuple[int, ...]
    one_way_s: tuple[float, ...]
    """Median one-way time per size."""


def fit_link(sizes: Sequence[int], one_way_s: Sequence[float]) -> tuple[float, float]:
    """(bandwidth GB/s, latency us) of ``t = latency + n / bandwidth``, least squares over the sizes.

    With one size, or a fitted slope that is not positive (noise), the largest
    message alone gives the bandwidth and the smallest the latency.
    """
    n = [float(s) for s in sizes]
    t = [float(x) for x in one_way_s]
    if len(n) >= 2:
        mean_n, mean_t = sum(n) / len(n), sum(t) / len(t)
        var = sum((x - mean_n) ** 2 for x in n)
        slope = sum((x - mean_n) * (y - mean_t) for x, y in zip(n, t)) / var if var > 0 else 0.0
        if slope > 0:
            latency = max(0.0, mean_t - slope * mean_n)
            return 1.0 / slope / 1e9, latency * 1e6
    big = max(range(len(n)), key=n.__getitem__)
    small = min(range(len(n)), key=n.__getitem__)
    return n[big] / t[big] / 1e9 if t[big] > 0 else math.inf, t[small] * 1e6


def like_kind(bandwidth_gbytes_per_s: float) -> str:
    """The class of link a measured bandwidth looks like."""
    for bound, kind in _KINDS:
        if bandwidth_gbytes_per_s >= bound:
            return kind
    return _KINDS[-1][1]


def compare_link(measured: LinkMeasurement, *, expected: dict, threshold: float = 0.2) -> str | None:
    """A one-line warning when measured bandwidth deviates from ``expected`` by more than ``threshold``.

    ``expected`` is a plan's link record: ``kind``, ``bandwidth_gbytes_per_s``, ``latency_us``.
    """
    want = float(expected["bandwidth_gbytes_per_s"])
    got = measured.bandwidth_gbytes_per_s
    if want <= 0 or abs(got - want) / want <= threshold:
        return None
    return (f"topology: plan assumed {expected.get('kind', 'a link')} {want:g} GB/s "
            f"({float(expected.get('latency_us', float('nan'))):g} us) to rank {measured.peer}, link measures "
            f"{got:.3g} GB/s ({measured.latency_us:.3g} us, like {like_kind(got)}); deviation "
            f"{abs(got - want) / want:.0%} > {threshold:.0%}: re-plan with the measured link "
            f"(cluster.inter_node / cluster.intra_node) or check the fabric")


def expected_link(topology: dict, *, rank: int, peer: int) -> dict | None:
    """The plan's link between two global ranks: intra_node when on the same node, else inter_node."""
    per_node = int(topology.get("gpus_per_node") or 0)
    if per_node <= 0:
        return None
    key = "intra_node" if rank // per_node == peer // per_node else "inter_node"
    return topology.get(key)


def ping_pong_s(buf: Any, *, peer: int, leader: bool, repeats: int, group: Any) -> float:
    """One-way time of ``buf`` to ``peer``: median send/recv round trip over ``repeats``, halved, in s."""
    import torch.distributed as dist

    trips = []
    for _ in range(repeats):
        start = time.perf_counter()
        if leader:
            dist.send(buf, peer, group=group)
            dist.recv(buf, peer, group=group)
        else:
            dist.recv(buf, peer, group=group)
            dist.send(buf, peer, group=group)
        trips.append(time.perf_counter() - start)
    return statistics.median(trips) / 2


def _measure_pair(*, peer: int, leader: bool, sizes: Sequence[int], repeats: int, budget_s: float, group: Any,
                  device: str) -> LinkMeasurement:
    import torch
    import torch.distributed as dist

    flag = torch.zeros(1, device=device)
    done_sizes, times = [], []
    deadline = time.perf_counter() + budget_s
    for size in sizes:
        buf = torch.zeros(max(1, size // 4), dtype=torch.float32, device=device)
        ping_pong_s(buf, peer=peer, leader=leader, repeats=1, group=group)  # warm-up
        times.append(ping_pong_s(buf, peer=peer, leader=leader, repeats=repeats, group=group))
        done_sizes.append(size)
        if leader:
            flag.fill_(1.0 if time.perf_counter() < deadline else 0.0)
            dist.send(flag, peer, group=group)
        else:
            dist.recv(flag, peer, group=group)
        if flag.item() == 0.0:
            break
    bandwidth, latency = fit_link(done_sizes, times)
    return LinkMeasurement(peer=peer, bandwidth_gbytes_per_s=bandwidth, latency_us=latency,
                           sizes=tuple(done_sizes), one_way_s=tuple(times))


def measure_neighbours(group: Any, *, sizes: Sequence[int] = DEFAULT_SIZES, repeats: int = 5,
                       budget_s: float = 2.0, device: str = "cpu") -> list[LinkMeasurement]:
    """Links from this rank to its pipeline neighbours; call on every rank of ``group`` together.

    ``budget_s`` bounds each of the two pairing rounds (a size already started finishes).
    """
    import torch.distributed as dist

    ranks = dist.get_process_group_ranks(group)
    me = ranks.index(dist.get_rank())
    out = []
    for parity in (0, 1):
        if me % 2 == parity and me + 1 < len(ranks):
            peer, leader = ranks[me + 1], True
        elif me % 2 != parity and me - 1 >= 0:
            peer, leader = ranks[me - 1], False
        else:
            continue
        out.append(_measure_pair(peer=peer, leader=leader, sizes=sizes, repeats=repeats, budget_s=budget_s,
                                 group=group, device=device))
    return out
