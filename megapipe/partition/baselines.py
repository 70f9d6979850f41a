"""Baseline splits the exact solver is compared against.

- ``equal``: Megatron's uniform split (megatron-core ``get_num_layers_to_build``
  without a layout): every stage builds num_layers / (pp * vp) decoder layers, the
  embedding sits on the first stage and MTP layers and the loss on the last.
  Megatron asserts that num_layers is divisible by pp (and the per-rank count by
  vp); where it is not, this baseline still returns a split for comparison, giving
  one extra decoder layer to each of the first ``num_layers % stages`` stages
  (DeepSpeed's ``partition_uniform`` rule). Where ``num_layers + 2`` divides and ``num_layers`` does not,
  the embedding and the loss each count as one layer, as Megatron's
  ``--account-for-embedding-in-pipeline-split`` and ``--account-for-loss-in-pipeline-split`` count them
  (126 layers on PP16 x VP8: ``E|t|...|t|L``).
- ``parameters``: DeepSpeed ``PipelineModule(partition_method="parameters")``:
  ``ds_utils.partition_balanced`` over per-entry parameter counts. Since December
  2023 that function is a dynamic program that, for each prefix and
  part count, keeps the split whose (max - min) part weight is smallest, chaining
  the running max and min greedily and preferring the latest cut on ties; with no
  more entries than parts it falls back to ``partition_uniform``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from megapipe.errors import InfeasibleError
from megapipe.records import LayerKind

__all__ = ["equal_bounds", "parameters_bounds", "uniform_counts"]


def uniform_counts(*, num_items: int, num_parts: int) -> tuple[int, ...]:
    """DeepSpeed ``partition_uniform`` part sizes: the first ``num_items % num_parts`` parts get one more."""
    base, remainder = divmod(num_items, num_parts)
    return tuple(base + (1 if part < remainder else 0) for part in range(num_parts))


def equal_bounds(kinds: Sequence[LayerKind], *, num_stages: int) -> tuple[int, ...]:
    """Stage boundaries (num_stages + 1) of Megatron's uniform decoder split over profile entries ``kinds``."""
    decoders = [index for index, kind in enumerate(kinds) if kind == LayerKind.decoder]
    ends = [index for index, kind in enumerate(kinds) if kind in (LayerKind.embedding, LayerKind.loss)]
    if len(decoders) % num_stages and len(ends) == 2 and (len(decoders) + 2) % num_stages == 0:
        decoders = sorted(decoders + ends)  # Megatron's account_for_embedding/loss_in_pipeline_split
    if len(decoders) < num_stages:
        raise InfeasibleError(
            f"equal split: num_layers={len(decoders)} decoder layers cannot fill {num_stages} stages; "
            "use fewer pipeline (or virtual) stages"
        )
    bounds = [0]
    taken = 0
    for count in uniform_counts(num_items=len(decoders), num_parts=num_stages)[:-1]:
        taken += count
        bounds.append(decoders[taken - 1] + 1)
    bounds.append(len(kinds))
    return tuple(bounds)


def parameters_bounds(param_counts: Sequence[float], *, num_stages: int) -> tuple[int, ...]:
    """Stage boundaries of DeepSpeed's ``partition_balanced`` (min max-min spread DP) over parameter counts."""
    num_items = len(param_counts)
    if num_items < num_stages:
        raise InfeasibleError(
            f"parameters split: {num_items} profile entries cannot fill {num_stages} stages; use fewer stages"
        )
    if num_items == num_stages:
        return tuple(range(num_items + 1))
    prefix = np.zeros(num_items + 1)
    prefix[1:] = np.cumsum(np.asarray(param_counts, dtype=float))
    best_max = np.full((num_items + 1, num_stages + 1), np.inf)
    best_min = np.full((num_items + 1, num_stages + 1), np.inf)
    best_cost = np.full((num_items + 1, num_stages + 1), np.inf)
    cut = np.zeros((num_items + 1, num_stages + 1), dtype=int)
    best_max[0, 0] = 0.0
    best_cost[0, 0] = 0.0
    for stop in range(1, num_items + 1):
        part = prefix[stop] - prefix[:stop]
        for parts in range(1, min(stop, num_stages) + 1):
            run_max = np.maximum(best_max[:stop, parts - 1], part)
            run_min = np.minimum(best_min[:stop, parts - 1], part)
            spread = run_max - run_min
            # DeepSpeed updates on ``cost <= best``, so the latest cut wins ties.
            start = stop - 1 - int(np.argmin(spread[::-1]))
            best_cost[stop, parts] = spread[start]
            best_max[stop, parts] = run_max[start]
            best_min[stop, parts] = run_min[start]
            cut[stop, parts] = start
    bounds = [num_items]
    for parts in range(num_stages, 0, -1):
        bounds.append(int(cut[bounds[-1], parts]))
    return tuple(reversed(bounds))
