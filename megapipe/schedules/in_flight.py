"""Peak in-flight microbatches per layout stage in closed form, without building a schedule.

A stage holds a microbatch's activations from its F until its last backward op (B, or
W after a split I). The counts below are what the builders' orders give; tests compare
them with the counts derived from the built orders over a grid of sizes.

* GPipe: every stage holds all m (Huang et al. 2019).
* 1F1B: stage s holds min(P - s, m) (Narayanan et al. 2021, sec. 2.2).
* ZB-H1: each stage defers its W so that it holds min(P, m) (Qi et al. 2024, sec. 3.1).
* ZB-H2: the list schedule caps F-to-W at 2P - 1, so min(2P - 1, m) (Qi et al. 2024, sec. 3.1).
* ZB-V and DualPipe-V: layout stage s (rank s going down, rank 2P-1-s coming back)
  holds min(2P - s, m) (Qi et al. 2024, sec. 6: the V's first stage holds 2P).
* Interleaved 1F1B (megatron-core 0.16.1 ``forward_backward_pipelining_with_interleaving``):
  rank r runs W_r = min(m v, 2(P - r - 1) + (v - 1) g) warm-up forwards, then pairs
  F(W_r + k), B(k) over Megatron's schedule table. After j forwards the chunk-c count is
  F_c(j) - B_c(j - W_r - 1), with F_c(n) the table's chunk-c entries among the first n and
  B_c(n) = F_{v-1-c}(n) (backwards walk the table with the chunk mirrored); the peak is
  the maximum over j, evaluated for all j at once.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

__all__ = ["interleaved_in_flight", "v_in_flight"]


def v_in_flight(pp: int, m: int, v: int, group: int) -> tuple[int, ...]:
    """ZB-V and DualPipe-V: layout stage s holds min(2P - s, m)."""
    return tuple(min(2 * pp - stage, m) for stage in range(2 * pp))


def interleaved_in_flight(pp: int, m: int, v: int, group: int) -> tuple[int, ...]:
    """Megatron's interleaved 1F1B, vp-major (stage = chunk * P + rank); ``group`` already resolved."""
    return _interleaved(pp, m, v, group)


def table_chunks(m: int, vp: int, group: int) -> np.ndarray:
    """The chunk column of Megatron's ``get_schedule_table`` (:func:`megapipe.schedules.interleaved.schedule_table`),
    as an array: each group of ``group`` microbatches (the last may be smaller) walks every chunk in turn."""
    return np.concatenate([np.repeat(np.arange(vp), min(group, m - first)) for first in range(0, m, group)])


@lru_cache(maxsize=1024)
def _interleaved(pp: int, m: int, vp: int, group: int) -> tuple[int, ...]:
    total = m * vp
    chunk_of = table_chunks(m, vp, group)
    seen = np.zeros((vp, total + 1), dtype=np.int64)
    seen[:, 1:] = np.cumsum(chunk_of[None, :] == np.arange(vp)[:, None], axis=1)
    forwards = np.arange(1, total + 1)
    peaks = np.zeros((vp, pp), dtype=np.int64)
    for rank in range(pp):
        warmup = min(total, 2 * (pp - rank - 1) + (vp - 1) * group)
        done = np.maximum(forwards - warmup - 1, 0)
        held = seen[:, forwards] - seen[::-1][:, done]
        peaks[:, rank] = held.max(axis=1)
    return tuple(int(count) for count in peaks.ravel())  # vp-major: stage = chunk * P + rank
