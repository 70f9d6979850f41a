"""Per-stage recompute (AdaPipe, Sun et al. 2024, ASPLOS): each pipeline stage picks its own recompute
granularity jointly with the split, so only the stages where memory is tight pay for recompute.

The split itself is :func:`megapipe.partition.options.split_with_options` (exact); this module
gives it one profile per recompute option and turns its answer into a Partition.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from megapipe.errors import InfeasibleError
from megapipe.partition.build import build_partition
from megapipe.partition.memory import in_flight_counts
from megapipe.partition.options import split_with_options
from megapipe.plan.layer_costs import LayerCosts
from megapipe.plan.plans import Candidate
from megapipe.records import LayerCost, Partition, Recompute, StageSpec

__all__ = ["RECOMPUTE_OPTIONS", "variant", "per_stage_partition"]

RECOMPUTE_OPTIONS = (Recompute.none, Recompute.selective, Recompute.full)
"""The options each rank picks from, least recompute (fastest, most activation bytes) first."""


def variant(cand: Candidate, recompute: Recompute) -> Candidate:
    """The candidate with one recompute setting everywhere."""
    return Candidate(parallel=cand.parallel, train=dataclasses.replace(cand.train, recompute_granularity=recompute),
                     schedule=cand.schedule)


def per_stage_partition(costs: LayerCosts, cand: Candidate, specs: Sequence[StageSpec], *, check_memory: bool
                        ) -> tuple[Partition, tuple[LayerCost, ...], tuple[str, ...]]:
    """The split and each rank's recompute setting; the layers each rank runs (its option's costs).

    Raises InfeasibleError when no split fits even with full recompute where needed.
    """
    pp = cand.parallel.pipeline_model_parallel_size
    profiles = [costs.profile(variant(cand, option)).layers for option in RECOMPUTE_OPTIONS]
    in_flight = in_flight_counts(schedule=cand.schedule, pipeline_model_parallel_size=pp,
                                 num_microbatches=cand.num_microbatches)
    caps = specs if check_memory else [dataclasses.replace(spec, memory_bytes=math.inf) for spec in specs]
    found = split_with_options(options=profiles, stages=caps, in_flight=in_flight)
    if found is None:
        raise InfeasibleError(
            f"per-stage recompute: no split of {len(profiles[0])} entries over pipeline_model_parallel_size={pp} "
            "fits memory even with full recompute; add pipeline stages or use a smaller micro-batch"
        )
    bounds = found.bounds
    layers = tuple(entry for stage, choice in enumerate(found.choices)
                   for entry in profiles[choice][bounds[stage]:bounds[stage + 1]])
    part = build_partition(layers=layers, stages=specs, bounds=bounds, in_flight=in_flight, ranks=tuple(range(pp)),
                           num_microbatches=cand.num_microbatches, schedule=cand.schedule, method="optimal")
    return part, layers, tuple(RECOMPUTE_OPTIONS[choice].value for choice in found.choices)
