"""One unit's time, forward and backward, split into its parts (:data:`megapipe.records.TIME_PARTS`), and the
device a unit is costed on. Shared by the dense (:mod:`megapipe.cost.layers`) and the MoE
(:mod:`megapipe.cost.moe`) parts of the cost model."""

from __future__ import annotations

from dataclasses import dataclass
from operator import add
from typing import NamedTuple

from megapipe.records import TIME_PARTS, ClusterSpec, GpuSpec, LinkSpec, RuntimeSpec

__all__ = ["Timing", "part", "Device", "PART_INDEX"]

PART_INDEX = {name: index for index, name in enumerate(TIME_PARTS)}


class Timing(NamedTuple):
    """Forward, backward and weight-gradient milliseconds, and the same split by part. A named tuple, not a frozen
    dataclass: the cost model adds a dozen per unit and a search costs thousands of units, and a tuple is made
    without a Python ``__init__``. ``+`` adds timings (it never concatenates)."""

    fwd_ms: float = 0.0
    bwd_ms: float = 0.0
    wgrad_ms: float = 0.0
    parts: tuple[float, ...] = (0.0,) * len(TIME_PARTS)

    def __add__(self, other: "Timing") -> "Timing":
        return _make((self[0] + other[0], self[1] + other[1], self[2] + other[2], tuple(map(add, self[3], other[3]))))

    def share(self, name: str) -> float:
        """Forward + backward milliseconds of one part."""
        return self.parts[PART_INDEX[name]]


_make = Timing._make


def part(name: str, fwd_ms: float, bwd_ms: float = 0.0, wgrad_ms: float = 0.0) -> Timing:
    parts = [0.0] * len(TIME_PARTS)
    parts[PART_INDEX[name]] = fwd_ms + bwd_ms
    return _make((fwd_ms, bwd_ms, wgrad_ms, tuple(parts)))


@dataclass(frozen=True, slots=True)
class Device:
    gpu: GpuSpec
    link: LinkSpec
    """The tensor-parallel group's link."""
    cp_link: LinkSpec
    runtime: RuntimeSpec
    tp_comm_overlap: bool
    cluster: ClusterSpec

    def __hash__(self) -> int:
        # Hashing every record it holds takes ~20 us and caches key on devices; equal devices agree on these.
        return hash((self.gpu.name, self.tp_comm_overlap, self.link.bandwidth_gbytes_per_s,
                     self.cp_link.bandwidth_gbytes_per_s, self.cluster.name))
