"""What megapipe knows about one pipeline schedule, in one frozen record per schedule.

Every schedule module (``gpipe``, ``one_f_one_b``, ``interleaved``, ``zb_h``, ``zb_v``,
``dualpipe_v``) defines a :class:`ScheduleSpec`; :mod:`megapipe.schedules.registry`
collects them, and every other package asks the registry instead of keeping its own
set of names. A spec holds:

- its name (:class:`ScheduleName`, a str Enum) and which action orders it builds;
- the placement of layout stages on ranks: ``loop`` (Megatron's vp-major order, stage
  ``c * P + r`` on rank ``r``) or ``v`` (rank ``r`` holds stages ``r`` and ``2P - 1 - r``);
- whether the backward is split into input-gradient (I) and weight-gradient (W) ops;
- the chunk rule: model chunks per rank, fixed (1 or 2) or searched from 2 up;
- whether megatron-core runs it, under which function of ``pipeline_parallel/schedules.py``,
  and the ``torch.distributed.pipelining`` class with the same order;
- the closed forms: flushed and steady-state bubble for equal stages with F = B = W, the
  peak in-flight microbatches per layout stage, and the factors of the planner's lower
  bounds (the share of a rank's time on the forward/backward path, the least in-flight
  count every layer keeps).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

from megapipe.schedules.base import Action

__all__ = ["ScheduleName", "Placement", "PathShare", "InFlightFloor", "ScheduleSpec"]


class ScheduleName(enum.StrEnum):
    """The schedules megapipe builds; the values are the names users type (``schedule=1f1b``)."""

    gpipe = "gpipe"
    one_f_one_b = "1f1b"
    interleaved_1f1b = "interleaved_1f1b"
    zb_h1 = "zb_h1"
    zb_h2 = "zb_h2"
    zb_v = "zb_v"
    dualpipe_v = "dualpipe_v"

    __hash__ = str.__hash__
    """Hash as the plain name, so dicts and sets keyed by names find a member by its string too."""


class Placement(enum.StrEnum):
    """Where layout stage s lives: ``loop`` on rank s mod P; ``v`` on rank s, then 2P - 1 - s."""

    loop = "loop"
    v = "v"


class PathShare(enum.StrEnum):
    """The share phi of a rank's per-microbatch time that lies on the fill/drain path of a later rank.

    ``whole`` (phi = 1): a fused backward must drain back through every earlier rank (GPipe, 1F1B).
    ``forward`` (phi = F / (F + B)): only the forward fills, the split backward's W fills the drain (ZB-H).
    ``none`` (phi = 0): interleaving or a V keeps work on every rank from the start.
    """

    whole = "whole"
    forward = "forward"
    none = "none"


class InFlightFloor(enum.StrEnum):
    """Microbatches every layer on rank r keeps at least, over every split: the memory bound's k_r.

    ``all``: m (GPipe). ``staircase``: min(P - r, m) (1F1B, and ZB-H, which release later, at W).
    ``one``: 1 (a chunk of an interleaved or V schedule may sit where little is in flight).
    """

    all = "all"
    staircase = "staircase"
    one = "one"


Orders = Callable[[int, int, int, "int | None"], tuple[tuple[Action, ...], ...]]
"""``(pp, m, v, group) -> per-rank action orders``; group is None for schedules with fixed chunks."""
Bubble = Callable[[int, int, int], "float | None"]
"""``(pipeline_model_parallel_size, num_microbatches, virtual_pipeline_model_parallel_size) -> fraction``."""
InFlight = Callable[[int, int, int, int], tuple[int, ...]]
"""``(pp, m, v, group) -> peak in-flight microbatches per layout stage``, for sizes the builder accepts."""
SizesOk = Callable[[int, int, int, int], bool]
RankOpsForm = Callable[[int, int, int, int], tuple]
"""``(pp, m, v, group) -> per rank, its order as a RankOps`` (for sizes the builder accepts)."""
RankCounts = Callable[[int, int, int, int], tuple]
"""``(pp, m, v, group) -> per rank, an array of in-flight counts per chunk (one row per forward)``."""
"""``(pp, m, v, group) -> True`` when the builder accepts these sizes (so the closed forms apply)."""


def _none(pp: int, m: int, v: int) -> None:
    return None


@dataclass(frozen=True, slots=True, kw_only=True)
class ScheduleSpec:
    """One schedule: how it is built, placed and bounded, and what Megatron and torch call it."""

    name: ScheduleName
    summary: str
    """One line: the paper and the idea."""
    orders: Orders
    placement: Placement = Placement.loop
    split_backward: bool = False
    """True: backwards are I + W ops (the zero-bubble split); False: one fused B per microbatch."""
    fixed_chunks: int | None = 1
    """Model chunks per rank; None means searched, from 2 up to the search's maximum."""
    megatron_function: str | None = None
    """The megatron-core ``pipeline_parallel/schedules.py`` function that runs this order; None when none does."""
    torch_class: str | None = None
    """``torch.distributed.pipelining`` schedule class whose order this one matches, when there is one."""
    path_share: PathShare = PathShare.none
    in_flight_floor: InFlightFloor = InFlightFloor.one
    bottleneck_sets_step: bool = False
    """Step time = (m - 1) x bottleneck + sum of stage times (Narayanan et al. 2021, sec. 2.2): every
    bottleneck-optimal split is equally fast, so the solver may prefer the one with the most memory headroom."""
    flushed_bubble: Bubble = _none
    """Closed-form bubble of a flushed step (global start to end), equal stages, F = B = W; None if unpublished."""
    steady_bubble: Bubble = _none
    """Closed-form bubble with iterations overlapping (each rank's own span); None if unpublished."""
    in_flight: InFlight
    sizes_ok: SizesOk
    min_microbatches_per_stage: int = 0
    """The search skips m < this x P: V schedules need 2P microbatches to reach their steady state."""
    rank_counts: RankCounts | None = None
    """Closed form of each rank's in-flight counts per chunk after each forward (for sizes the builder
    accepts); None means they are read from the built orders."""
    rank_ops: RankOpsForm | None = None
    """Closed form of each rank's order as plain lists (for sizes the builder accepts); None means they are read
    from the built orders."""
    bound_class: tuple = field(init=False)
    """What the planner's closed-form bounds of a candidate depend on; schedules that share it share them."""
    memory_class: tuple = field(init=False)
    """What the memory lower bound depends on: the in-flight floor and where the loss sits."""

    def __post_init__(self) -> None:
        # Derived once: the search reads them for every candidate.
        object.__setattr__(self, "bound_class", (self.path_share, self.in_flight_floor, self.placement))
        object.__setattr__(self, "memory_class", (self.in_flight_floor, self.placement))

    @property
    def megatron_runs(self) -> bool:
        """True when megatron-core 0.16-0.19 runs this order for pipeline_model_parallel_size > 1."""
        return self.megatron_function is not None

    def chunks_per_rank(self, virtual_pipeline_model_parallel_size: int = 1) -> int:
        """Model chunks each rank holds: the fixed count, or the given virtual size when it is searched."""
        return self.fixed_chunks or virtual_pipeline_model_parallel_size

    def virtual_sizes(self, *, pipeline_model_parallel_size: int, max_virtual: int) -> tuple[int, ...]:
        """Chunk counts the search tries: the fixed one, or 2..max_virtual (none without pipelining).

        ``max_virtual`` is the caller's cap: the most chunks the layers fill, or a user's smaller limit."""
        if self.fixed_chunks is not None:
            return (self.fixed_chunks,)
        return tuple(range(2, max_virtual + 1)) if pipeline_model_parallel_size > 1 else ()

    def admits_virtual(self, *, pipeline_model_parallel_size: int, virtual_pipeline_model_parallel_size: int) -> bool:
        """Whether this schedule runs with that many chunks per rank (a user's fixed VP, of any size)."""
        if self.fixed_chunks is not None:
            return virtual_pipeline_model_parallel_size == self.fixed_chunks
        return pipeline_model_parallel_size > 1 and virtual_pipeline_model_parallel_size >= 2

    def searchable(self, *, pipeline_model_parallel_size: int, num_microbatches: int,
                   virtual_pipeline_model_parallel_size: int, microbatch_group_size_per_vp_stage: int | None) -> bool:
        """Whether the search keeps these sizes: the builder accepts them and the steady state is reached."""
        pp, m = pipeline_model_parallel_size, num_microbatches
        if m < self.min_microbatches_per_stage * pp:
            return False
        return self.sizes_ok(pp, m, virtual_pipeline_model_parallel_size, microbatch_group_size_per_vp_stage or pp)

    def loss_rank(self, pipeline_model_parallel_size: int) -> int:
        """The pipeline rank of the last layout stage (the loss): P - 1 in a loop, 0 at the top of a V."""
        return 0 if self.placement is Placement.v else pipeline_model_parallel_size - 1

    def stage_to_rank(self, *, pipeline_model_parallel_size: int, num_stages: int) -> tuple[int, ...]:
        """Pipeline rank of each layout stage."""
        pp = pipeline_model_parallel_size
        if self.placement is Placement.v:
            return tuple(stage if stage < pp else 2 * pp - 1 - stage for stage in range(num_stages))
        return tuple(stage % pp for stage in range(num_stages))

    def least_in_flight(self, pipeline_model_parallel_size: int, num_microbatches: int) -> tuple[int, ...]:
        """Per rank, microbatches every layer on it keeps at least, over every split (:class:`InFlightFloor`)."""
        pp, m = pipeline_model_parallel_size, num_microbatches
        if self.in_flight_floor is InFlightFloor.all:
            return (m,) * pp
        if self.in_flight_floor is InFlightFloor.staircase:
            return tuple(min(pp - rank, m) for rank in range(pp))
        return (1,) * pp
