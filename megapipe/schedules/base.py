"""Pipeline actions and the Schedule record that every schedule builder returns.

Notation follows ``torch.distributed.pipelining`` so orders can be compared with
it: ``str(action)`` is ``"<stage><kind><microbatch>"``, e.g. ``"2F0"``. Kinds:

* ``F`` forward;
* ``I`` backward for the input gradient only (the zero-bubble paper's *B*);
* ``W`` backward for the weight gradient only (the paper's *W*);
* ``B`` full backward (input and weight gradient fused, the paper's *B + W*),
  used by schedules that do not split the backward (GPipe, 1F1B, interleaved).

``stage`` is the model-order stage index, i.e. the index into the layout string
(Megatron's vp-major order for interleaving: ``stage = chunk * P + rank``; for
V-shaped schedules chunk 0 of rank r is stage r and chunk 1 is stage 2P-1-r).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from megapipe.errors import ScheduleError

__all__ = ["Kind", "KIND_CODE", "Action", "LazyOrders", "RankOps", "Schedule", "loop_stage", "v_stage", "check_sizes",
           "rank_ops_of", "warmup_steady_cooldown"]


class Kind(str, enum.Enum):
    F = "F"
    I = "I"  # noqa: E741 - torch.distributed.pipelining's letter for BACKWARD_INPUT
    W = "W"
    B = "B"


KIND_CODE = {Kind.F: 0, Kind.I: 1, Kind.B: 2, Kind.W: 3}
"""Each kind as a small integer, for orders kept as plain lists."""


class Action(NamedTuple):
    """One compute op of one rank: (rank, kind, microbatch, chunk) plus its model-order stage. A named tuple, not a
    dataclass: a schedule holds one per op (thousands), and a tuple is made three times faster."""

    rank: int
    kind: Kind
    microbatch: int
    chunk: int
    stage: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.microbatch}"

    __repr__ = __str__


@dataclass(frozen=True, slots=True)
class RankOps:
    """One rank's order as three parallel tuples, without Action objects: what a pass over many candidates'
    orders reads (each op's :data:`KIND_CODE`, layout stage and microbatch)."""

    kinds: tuple[int, ...]
    stages: tuple[int, ...]
    microbatches: tuple[int, ...]


def rank_ops_of(orders: tuple[tuple[Action, ...], ...]) -> tuple[RankOps, ...]:
    """Built orders as :class:`RankOps`."""
    return tuple(RankOps(kinds=tuple(KIND_CODE[a.kind] for a in order), stages=tuple(a.stage for a in order),
                         microbatches=tuple(a.microbatch for a in order)) for order in orders)


def warmup_steady_cooldown(warmup: int, total: int):
    """(is_backward, k) per op of Megatron's 1F1B-style order over ``total`` forwards: ``warmup`` forwards, then
    forward warmup + k and backward k alternating, then the remaining backwards; as numpy arrays."""
    import numpy as np

    steady = total - warmup
    backward = np.concatenate([np.zeros(warmup, dtype=np.int64), np.tile([0, 1], steady),
                               np.ones(warmup, dtype=np.int64)])
    k = np.concatenate([np.arange(warmup), np.stack([warmup + np.arange(steady), np.arange(steady)], axis=1).ravel(),
                        np.arange(steady, total)])
    return backward, k


class LazyOrders(Sequence):
    """A schedule's per-rank action orders, built on first use: the tuple of tuples ``build()`` returns. The
    simulator reads a closed-form schedule's :class:`RankOps`, so a planner search that simulates a schedule of a
    hundred thousand ops never builds its actions; a Gantt chart, a trace or ``format()`` does, once. Compares,
    hashes and pickles as that tuple."""

    __slots__ = ("_build", "_ranks", "_orders")

    def __init__(self, build, ranks: int):
        self._build, self._ranks, self._orders = build, ranks, None

    def _built(self) -> tuple[tuple[Action, ...], ...]:
        if self._orders is None:
            self._orders = tuple(self._build())
        return self._orders

    def __len__(self) -> int:
        return self._ranks

    def __getitem__(self, index):
        return self._built()[index]

    def __iter__(self):
        return iter(self._built())

    def __eq__(self, other) -> bool:
        if isinstance(other, LazyOrders):
            other = other._built()
        return self._built() == other

    def __hash__(self) -> int:
        return hash(self._built())

    def __reduce__(self):
        return tuple, (self._built(),)

    def __repr__(self) -> str:
        return repr(self._built())


@dataclass(frozen=True, slots=True, kw_only=True)
class Schedule:
    """Per-rank action orders of one pipeline schedule for fixed sizes.

    ``orders[r]`` is the exact sequence rank ``r`` executes; the simulator runs it
    strictly in that order. ``stage_to_rank[s]`` places model-order stage ``s``.
    """

    name: str
    pipeline_model_parallel_size: int
    num_microbatches: int
    virtual_pipeline_model_parallel_size: int
    microbatch_group_size_per_vp_stage: int | None
    stage_to_rank: tuple[int, ...]
    orders: tuple[tuple[Action, ...], ...] | LazyOrders
    """Built on first use where the builder has closed-form :attr:`rank_ops` (:class:`LazyOrders`)."""
    rank_ops: tuple[RankOps, ...] | None = field(default=None, repr=False, compare=False)
    """``orders`` as plain tuples when the builder has them in closed form (tested equal to the actions): the
    simulator then lowers them with array operations, without checking every action."""
    lowered: object = field(default=None, init=False, repr=False, compare=False)
    """The simulator's validated flat form of ``orders``, memoised on first use."""

    @property
    def num_stages(self) -> int:
        return len(self.stage_to_rank)

    @property
    def num_ops(self) -> int:
        return sum(len(order) for order in self.orders)

    def format(self) -> str:
        """One line per rank in torch's notation, e.g. ``"rank 0: 0F0 0F1 0B0 ..."``."""
        return "\n".join(
            f"rank {r}: " + " ".join(str(a) for a in order) for r, order in enumerate(self.orders)
        )


def loop_stage(rank: int, chunk: int, pipeline_model_parallel_size: int) -> int:
    """Megatron's vp-major placement: chunk c of rank r is layout stage c * P + r."""
    return chunk * pipeline_model_parallel_size + rank


def v_stage(rank: int, chunk: int, pipeline_model_parallel_size: int) -> int:
    """V placement (ZB-V, DualPipeV): chunk 0 of rank r is stage r, chunk 1 is stage 2P-1-r."""
    return rank if chunk == 0 else 2 * pipeline_model_parallel_size - 1 - rank


def check_sizes(name: str, *, pipeline_model_parallel_size: int, num_microbatches: int) -> None:
    """Checks shared by every schedule; each builder adds its own."""
    if not isinstance(pipeline_model_parallel_size, int) or pipeline_model_parallel_size < 1:
        raise ScheduleError(
            f"{name}: pipeline_model_parallel_size={pipeline_model_parallel_size!r} must be an int >= 1"
        )
    if not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ScheduleError(
            f"{name}: num_microbatches={num_microbatches!r} must be an int >= 1; "
            "raise train.global_batch_size or lower train.micro_batch_size"
        )
